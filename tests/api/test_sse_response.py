"""The SSE response of a stream (`api/sse_response.py`), as an ASGI server drives it: what it
writes, that its last write ends the body, and what a client leaving or a HEAD does to the
request."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from api.broker import KEEPALIVE, Interruption
from api.sse_response import SubscriptionStream
from api.streaming import ChunkFormat
from shared.protocol import FinalEvent, TokenEvent, Usage


class ScriptedSubscription:
    """Hands out `script` (events and `KEEPALIVE`s), then waits until interrupted, as a
    request's subscription waits for its next event; records how it was closed."""

    def __init__(self, script):
        self._script = script
        self.info = SimpleNamespace(request_id="cmpl-1")
        self.next_seq = 0
        self.is_finished = False
        self.interruption: Interruption | None = None
        self.closes: list[bool] = []  # cancel_if_unfinished of each close
        self._interrupted = asyncio.Event()

    async def events(self, keepalive_s=None):
        for item in self._script:
            if item is not KEEPALIVE:
                self.next_seq = item.seq + 1
                self.is_finished = not isinstance(item, TokenEvent)
            yield item
            if self.is_finished:
                return
        await self._interrupted.wait()

    def interrupt(self, reason):
        self.interruption = self.interruption or reason
        self._interrupted.set()

    async def close(self, *, cancel_if_unfinished=True):
        self.closes.append(cancel_if_unfinished)

    @property
    def cancelled(self) -> bool:
        """Closed in a way that cancels its request (its first close decides, as
        `Subscription.close` is idempotent): unfinished, not by a shutdown."""
        return (
            not self.is_finished
            and self.interruption is not Interruption.API_SHUTDOWN
            and bool(self.closes)
            and self.closes[0]
        )


def _response(subscription, keepalive_s=15.0) -> SubscriptionStream:
    fmt = ChunkFormat("cmpl-1", "m", is_chat=False, include_usage=False, created=0)
    return SubscriptionStream(
        subscription,  # type: ignore[arg-type]
        fmt,
        send_timeout_s=30,
        keepalive_s=keepalive_s,
        headers={"X-Request-Id": "cmpl-1"},
    )


async def _serve(response, *, method="POST", disconnect: asyncio.Event | None = None):
    sent: list[dict] = []
    disconnect = disconnect or asyncio.Event()

    async def receive():
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await asyncio.wait_for(response({"type": "http", "method": method}, receive, send), 5)
    return sent


def _final(seq: int) -> FinalEvent:
    usage = Usage(prompt_tokens=1, completion_tokens=seq + 1)
    return FinalEvent(seq=seq, text="!", finish_reason="stop", usage=usage)


async def test_one_write_per_event_and_the_last_one_ends_the_body():
    script = [TokenEvent(seq=0, text="a", num_tokens=1), KEEPALIVE, _final(1)]
    subscription = ScriptedSubscription(script)
    sent = await _serve(_response(subscription))
    start, *bodies = sent
    assert start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert (b"x-request-id", b"cmpl-1") in start["headers"]
    assert [b["more_body"] for b in bodies] == [True, True, False]
    assert bodies[1]["body"] == b": ping\r\n\r\n"
    assert bodies[2]["body"].endswith(b"data: [DONE]\r\n\r\n")
    assert not subscription.cancelled


async def test_a_client_that_leaves_cancels_its_request():
    subscription = ScriptedSubscription([TokenEvent(seq=0, text="a", num_tokens=1)])
    disconnect = asyncio.Event()
    serving = asyncio.ensure_future(_serve(_response(subscription), disconnect=disconnect))
    await asyncio.sleep(0.05)
    assert not serving.done()  # waiting for the next event
    disconnect.set()
    await serving
    assert subscription.interruption is Interruption.CLIENT_GONE
    assert subscription.cancelled


async def test_head_writes_the_headers_and_leaves_the_request_running():
    subscription = ScriptedSubscription([TokenEvent(seq=0, text="a", num_tokens=1)])
    sent = await _serve(_response(subscription), method="HEAD")
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert subscription.closes and not subscription.closes[0]
    assert not subscription.cancelled
