"""KV hand-off between workers over the network: a prefill worker sends a sequence's KV
blocks to a decode worker directly, never through the Redis broker (issue 22).

Transport: ZeroMQ (pyzmq), a well-kept library with zero-copy sends of large frames. A
decode worker binds a ROUTER socket (`KVReceiver`); a prefill worker keeps a DEALER socket
per decode worker it sends to (`KVSender`). A transfer is one multipart message, [empty
delimiter, header, payload]: the header is JSON (the request id, the sender's `KVLayout`,
the token count; `HEADER_FIELDS`), the payload the raw blocks (`worker/runner/kv_blocks.py`).
No pickle on the wire. The receiver answers once the blocks are in its pool, and the sender
waits for that answer for at most `timeout_s`: a transfer is done when it is acknowledged,
and one that is not is the caller's to retry or to end (the hand-off's state lives in Redis
like every other hand-off).

Plain I/O around buffers: no torch here (the runner turns pools into bytes and back).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

HEADER_FIELDS = ("request_id", "layout", "num_tokens", "num_blocks")


class KVTransferError(Exception):
    """A transfer that was not acknowledged in time, or that the receiver refused."""


class KVTransferRefused(KVTransferError):
    """The receiver answered, and did not take the blocks (no room, or not offered to it)."""


@dataclass(frozen=True, slots=True)
class KVTransfer:
    header: dict[str, Any]
    payload: memoryview  # valid until the next receive


class KVSender:
    def __init__(self, context: zmq.Context | None = None) -> None:
        self._context = context or zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}

    def send(
        self, endpoint: str, header: dict[str, Any], payload: memoryview | bytes, timeout_s: float
    ) -> None:
        """Send one sequence's blocks to the receiver at `endpoint` and wait for its answer;
        `KVTransferError` if none comes within `timeout_s` or it refused the blocks."""
        missing = [name for name in HEADER_FIELDS if name not in header]
        if missing:
            raise ValueError(f"KV transfer header lacks {missing}")
        socket = self._socket(endpoint)
        socket.send_multipart([b"", json.dumps(header).encode(), payload], copy=False)
        if not socket.poll(int(timeout_s * 1000)):
            self._drop(endpoint)  # a late answer must not be read as the next one's
            raise KVTransferError(f"no answer from {endpoint} within {timeout_s} s")
        _, answer = socket.recv_multipart()
        reply = json.loads(answer)
        if reply.get("request_id") != header["request_id"] or not reply.get("ok"):
            raise KVTransferRefused(f"{endpoint} refused the blocks: {reply.get('error')}")

    def close(self) -> None:
        for endpoint in list(self._sockets):
            self._drop(endpoint)

    def _socket(self, endpoint: str) -> zmq.Socket:
        if endpoint not in self._sockets:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(endpoint)
            self._sockets[endpoint] = socket
        return self._sockets[endpoint]

    def _drop(self, endpoint: str) -> None:
        self._sockets.pop(endpoint).close(linger=0)


class KVReceiver:
    def __init__(self, endpoint: str, context: zmq.Context | None = None) -> None:
        """Bind at `endpoint` (e.g. "tcp://0.0.0.0:5600"; port 0 or "*" picks a free one:
        `self.endpoint` says which)."""
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("tcp://") and endpoint.rsplit(":", 1)[1] in ("0", "*"):
            port = self._socket.bind_to_random_port(endpoint.rsplit(":", 1)[0])
            self.endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"
        else:
            self._socket.bind(endpoint)
            self.endpoint = endpoint

    def serve_one(self, timeout_s: float, accept: Callable[[KVTransfer], None]) -> bool:
        """Wait at most `timeout_s` for a transfer and hand it to `accept` (which puts the
        blocks into the pool, or raises to refuse them); then answer the sender. False if
        none came."""
        if not self._socket.poll(int(timeout_s * 1000)):
            return False
        identity, _, header_frame, payload = self._socket.recv_multipart(copy=False)
        header = json.loads(header_frame.bytes)
        reply: dict[str, Any] = {"request_id": header.get("request_id"), "ok": True}
        try:
            accept(KVTransfer(header, payload.buffer))
        except Exception as exc:  # refused: the sender ends or retries the hand-off
            reply.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        self._socket.send_multipart([identity, b"", json.dumps(reply).encode()])
        return True

    def close(self) -> None:
        self._socket.close(linger=0)
