"""A TCP proxy in front of Redis (or any TCP server: a decode worker's KV endpoint) that can
cut every connection through it: the network between a process and its broker failing, as a
load balancer, a NAT or a restarting host does.

`cut(for_s)` resets (RST) every open connection, then for `for_s` seconds resets each new
one right after accepting it: a client's reconnect succeeds at TCP level and fails on its
first read, which is where a client library's retry logic has its gaps.

One thread owns every socket (a selector loop), so a reset is a real RST: a socket closed
from another thread while one blocks in `recv` on it stays open in the kernel.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
import time

from cli.redis_server import free_port

_BUFFER_BYTES = 65536
_TICK_S = 0.02


def _reset(sock: socket.socket) -> None:
    """Close with RST instead of FIN (linger on, timeout 0)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class CuttingProxy:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self._target = (host, target_port)
        self.port = free_port()
        self._listener = socket.create_server((host, self.port))
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._peers: dict[socket.socket, socket.socket] = {}
        self._cut_requested_for_s: float | None = None
        self._cut_until = 0.0
        self._closed = False
        self.num_cut = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="cutting-proxy")
        self._thread.start()

    @property
    def url(self) -> str:
        return self.url_of("redis")

    def url_of(self, scheme: str) -> str:
        """The proxy's address as a `scheme` URL (`tcp` for a ZeroMQ endpoint)."""
        return f"{scheme}://{self._target[0]}:{self.port}"

    def cut(self, for_s: float) -> None:
        """Reset every connection now and every new one for `for_s` seconds."""
        self._cut_requested_for_s = for_s

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)

    def _run(self) -> None:
        while not self._closed:
            if (for_s := self._cut_requested_for_s) is not None:
                self._cut_requested_for_s = None
                self._cut_until = time.monotonic() + for_s
                for sock in list(self._peers):
                    self._drop(sock, reset=True)
            for key, _ in self._selector.select(_TICK_S):
                if key.fileobj is self._listener:
                    self._accept()
                elif key.fileobj in self._peers:
                    self._forward(key.fileobj)
        for sock in list(self._peers):
            self._drop(sock, reset=True)
        self._selector.close()
        self._listener.close()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if time.monotonic() < self._cut_until:
            self.num_cut += 1
            _reset(client)
            return
        try:
            upstream = socket.create_connection(self._target, timeout=1)
        except OSError:
            _reset(client)
            return
        for sock, peer in ((client, upstream), (upstream, client)):
            sock.setblocking(False)
            self._peers[sock] = peer
            self._selector.register(sock, selectors.EVENT_READ)

    def _forward(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(_BUFFER_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sock, reset=False)
            return
        peer = self._peers[sock]
        peer.setblocking(True)  # a few kB at most: simpler than buffering writes
        try:
            peer.sendall(data)
        except OSError:
            self._drop(sock, reset=True)
        else:
            peer.setblocking(False)

    def _drop(self, sock: socket.socket, *, reset: bool) -> None:
        """Close a connection on both sides (with RST when `reset`)."""
        peer = self._peers.pop(sock, None)
        if peer is None:
            return
        self._peers.pop(peer, None)
        if reset:
            self.num_cut += 1
        for s in (sock, peer):
            self._selector.unregister(s)
            _reset(s) if reset else s.close()
