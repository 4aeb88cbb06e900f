"""A fake server for the bench's clients: an ASGI app under uvicorn, over real loopback HTTP."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette

SERVER_START_TIMEOUT_S = 10.0


@contextmanager
def serving(app: Starlette) -> Iterator[str]:
    """Run `app` under uvicorn in a thread on a free loopback port; yield its base URL."""
    # Binding here and handing uvicorn the socket avoids a race for the port.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline_s = time.monotonic() + SERVER_START_TIMEOUT_S
    while not server.started and thread.is_alive() and time.monotonic() < deadline_s:
        time.sleep(0.01)
    try:
        assert server.started, "fake server did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(SERVER_START_TIMEOUT_S)
        sock.close()
