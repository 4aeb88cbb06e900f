"""The SSE response of a stream: a subscription's events as `text/event-stream`, written by
the request's own task, while one small task watches for its client leaving.

Not sse-starlette's `EventSourceResponse`. That runs four tasks per stream in a task group
(the body, a keepalive ping, a watch on the server's exit flag, a watch on the client), with
a cancel scope around every write: 247 us of CPU per stream of three events against 67 for
this one, formatting the events' JSON included (`python -m bench.sse_overhead`,
bench/results/sse-overhead-cpu-session16.json). Together with pipelining the API's Redis
commands (`shared/auto_pipeline.py`) that took the API's CPU per request from 1.2-1.4 ms to
0.76 (docs/benchmarks.md). What those tasks did is done here, or already by the stream:

- keepalive: a comment line once nothing was written for `stream_keepalive_s`, from the
  subscription's own wake-ups (`Subscription.events(keepalive_s)`), so by the one task that
  writes: no lock between writers;
- the server's exit: this process's shutdown interrupts every stream itself, each ending
  with an error event and `[DONE]` (`api/shutdown.py`);
- the client leaving: the watcher interrupts the subscription (`Interruption.CLIENT_GONE`),
  whose close then cancels the request (`api/broker.py`);
- a write its client does not take: `_StallWatch`.

The events themselves are still encoded by sse-starlette's `ServerSentEvent`
(`api/streaming.py`). The last write carries the chunked body's end with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from api.broker import Interruption, Subscription
from api.streaming import ChunkFormat, sse_events

log = logging.getLogger("llmfleet.api")

_HEADERS = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"connection", b"keep-alive"),
    # nginx would otherwise buffer the stream's events.
    (b"x-accel-buffering", b"no"),
)


class SubscriptionStream(Response):
    """The SSE response of one subscription, which it closes however the response ends
    (`sse_events` closes it too, but only once it has started: a response ended before
    would leave it open and its request running). `holding`, if given, is entered for the
    response's whole life (a resume stream's slot). A write its client does not take within
    `send_timeout_s` stalls the stream (`_StallWatch`); with `keepalive_s`, a comment line
    goes out whenever nothing else did for that long. A `Response` by type only: its own
    `__call__` writes it."""

    media_type = "text/event-stream"

    def __init__(
        self,
        subscription: Subscription,
        fmt: ChunkFormat,
        *,
        send_timeout_s: float,
        keepalive_s: float | None,
        headers: Mapping[str, str],
        holding: AbstractAsyncContextManager | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.subscription = subscription
        self.fmt = fmt
        self.send_timeout_s = send_timeout_s
        self.keepalive_s = keepalive_s or None
        self.holding = holding
        self.raw_headers = [
            *_HEADERS,
            *(
                (name.lower().encode("latin-1"), value.encode("latin-1"))
                for name, value in headers.items()
            ),
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self.subscription.close)
            if self.holding is not None:
                await stack.enter_async_context(self.holding)
            start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
            if scope["method"] == "HEAD":
                # Headers only; the request goes on (nobody left it).
                await self.subscription.close(cancel_if_unfinished=False)
                await send(start)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            watcher = asyncio.create_task(self._watch(receive))
            try:
                await self._write(_StallWatch(send, self.send_timeout_s, self._stalled), start)
            finally:
                watcher.cancel()

    async def _write(self, send: Send, start: Message) -> None:
        await send(start)
        writes = sse_events(self.subscription, self.fmt, keepalive_s=self.keepalive_s)
        async for body, is_last in writes:
            await send({"type": "http.response.body", "body": body, "more_body": not is_last})

    async def _watch(self, receive: Receive) -> None:
        # The body was read whole before the stream began: the next message is the disconnect.
        while (await receive())["type"] != "http.disconnect":
            pass
        self.subscription.interrupt(Interruption.CLIENT_GONE)

    async def _stalled(self) -> None:
        """Its client takes nothing: cancel the request now (the worker stops, the usage
        counts what was computed), and end the stream at its next event's boundary."""
        log.info(
            "stream of %s stalled: its client took nothing for %.0f s; cancelling it",
            self.subscription.info.request_id,
            self.send_timeout_s,
        )
        self.subscription.interrupt(Interruption.STREAM_STALLED)
        await self.subscription.close()


@dataclass
class _StallWatch:
    """`send`, watched: the first message not taken within `timeout_s` (uvicorn waits for
    the socket to drain before it writes anything, so nothing of it is written yet) calls
    `on_stall`, and is then sent all the same, however long that takes, as is everything
    after it: no event is cut or lost, and the stream's last events wait for the client."""

    send: Send
    timeout_s: float
    on_stall: Callable[[], Awaitable[None]]
    is_stalled: bool = False

    async def __call__(self, message: Message) -> None:
        if not self.is_stalled:
            timeout = asyncio.timeout(self.timeout_s)
            try:
                async with timeout:
                    await self.send(message)
                return
            except TimeoutError:
                if not timeout.expired():
                    raise
            self.is_stalled = True
            await self.on_stall()
        await self.send(message)
