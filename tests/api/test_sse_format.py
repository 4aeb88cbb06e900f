"""Worker events -> OpenAI SSE chunks: every stream ends with [DONE], errors included."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from api.broker import Interruption
from api.sse_response import _StallWatch
from api.streaming import ChunkFormat, sse_events
from shared.protocol import ErrorEvent, FinalEvent, TokenEvent, Usage


class FakeSubscription:
    """Hands out `events`; then, if given, is interrupted (`api/broker.py` `Subscription`)."""

    def __init__(self, events, interruption: Interruption | None = None):
        self._events = events
        self._interruption = interruption
        self.info = SimpleNamespace(request_id="cmpl-1")
        self.next_seq = 0
        self.is_finished = False
        self.interruption: Interruption | None = None
        self.is_closed = False

    async def events(self, keepalive_s=None):
        for event in self._events:
            self.next_seq = event.seq + 1
            self.is_finished = not isinstance(event, TokenEvent)
            yield event
        self.interruption = self._interruption

    async def close(self):
        self.is_closed = True


def _fmt(is_chat: bool, include_usage: bool = True) -> ChunkFormat:
    return ChunkFormat("cmpl-1", "m", is_chat=is_chat, include_usage=include_usage, created=0)


async def _collect(events, fmt, interruption=None) -> tuple[list, FakeSubscription]:
    """The data of every SSE event the stream writes, in order."""
    sub = FakeSubscription(events, interruption)
    writes = [write async for write in sse_events(sub, fmt)]
    # Only the last write ends the response.
    assert [is_last for _, is_last in writes] == [False] * (len(writes) - 1) + [True]
    written = b"".join(body for body, _ in writes).decode()
    data = [
        line.removeprefix("data: ")
        for event in written.split("\r\n\r\n")
        for line in event.split("\r\n")
        if line.startswith("data: ")
    ]
    return [d if d == "[DONE]" else json.loads(d) for d in data], sub


async def test_error_event_then_done():
    events = [
        TokenEvent(seq=0, text="Hi", num_tokens=1),
        ErrorEvent(seq=1, code="model_error", message="it broke"),
    ]
    out, sub = await _collect(events, _fmt(is_chat=False))
    assert out[0]["choices"][0]["text"] == "Hi"
    assert out[1] == {
        "error": {
            "message": "it broke",
            "type": "server_error",
            "param": None,
            "code": "model_error",
        }
    }
    assert out[2] == "[DONE]" and len(out) == 3
    assert sub.is_closed


async def test_chat_final_without_text_has_empty_delta_and_finish_reason():
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    events = [
        TokenEvent(seq=0, text="Yo", num_tokens=1),
        FinalEvent(seq=1, finish_reason="stop", usage=usage),
    ]
    out, _ = await _collect(events, _fmt(is_chat=True))
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Yo"}
    assert out[1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert out[2]["choices"] == [] and out[2]["usage"]["total_tokens"] == 5
    assert out[3] == "[DONE]"


async def test_a_stream_whose_only_event_is_final_still_carries_the_role():
    usage = Usage(prompt_tokens=3, completion_tokens=1)
    out, _ = await _collect(
        [FinalEvent(seq=0, finish_reason="stop", usage=usage)], _fmt(True, False)
    )
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "usage" not in out[0] and out[-1] == "[DONE]"


async def test_the_last_sse_event_of_each_worker_event_carries_its_seq_as_id():
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    events = [
        TokenEvent(seq=0, text="a", num_tokens=1),
        TokenEvent(seq=1, text="b", num_tokens=1),
        FinalEvent(seq=2, text="c", finish_reason="length", usage=usage),
    ]
    sub = FakeSubscription(events)
    writes = [body.decode() async for body, _ in sse_events(sub, _fmt(is_chat=False))]
    sse = [e for write in writes for e in write.split("\r\n\r\n") if e]
    ids = [next((f[4:] for f in e.split("\r\n") if f.startswith("id: ")), None) for e in sse]
    # the final event makes two chunks (text, usage): only the second carries its id
    assert ids == ["0", "1", None, "2", None]
    assert sse[-1] == "data: [DONE]"
    # one write per token event; the final event's chunks and [DONE] in one
    assert len(writes) == 3


async def test_an_interrupted_stream_says_where_to_resume_then_done():
    events = [TokenEvent(seq=0, text="Hi", num_tokens=1), TokenEvent(seq=1, text="!", num_tokens=1)]
    out, sub = await _collect(events, _fmt(is_chat=False), Interruption.API_SHUTDOWN)
    assert [c["choices"][0]["text"] for c in out[:2]] == ["Hi", "!"]
    error = out[2]["error"]
    assert error["code"] == "api_shutdown" and error["type"] == "server_error"
    assert error["request_id"] == "cmpl-1" and error["last_event_id"] == "1"
    assert "GET /v1/requests/cmpl-1/events" in error["message"]
    assert out[3] == "[DONE]" and len(out) == 4
    assert sub.is_closed


async def test_a_stream_interrupted_before_its_first_event_resumes_from_the_start():
    out, _ = await _collect([], _fmt(is_chat=True), Interruption.API_SHUTDOWN)
    assert out[0]["error"]["last_event_id"] is None
    assert out[1] == "[DONE]" and len(out) == 2


async def test_a_send_its_client_does_not_take_stalls_the_stream_once_and_still_goes_out():
    """`_StallWatch`: a send still waiting after the timeout calls `on_stall` once; the
    message is then sent all the same, and so is every later one, however slow."""
    sent: list[dict] = []
    drained = asyncio.Event()
    num_stalls = 0

    async def send(message):
        if message["body"] == b"slow":
            await drained.wait()  # a socket that does not drain until the client reads
        sent.append(message)

    async def on_stall():
        nonlocal num_stalls
        num_stalls += 1
        drained.set()  # the client reads again, later

    watched = _StallWatch(send, timeout_s=0.05, on_stall=on_stall)
    await watched({"body": b"fast"})
    await watched({"body": b"slow"})
    await watched({"body": b"after"})
    assert [m["body"] for m in sent] == [b"fast", b"slow", b"after"]
    assert num_stalls == 1 and watched.is_stalled


class _FailingSubscription(FakeSubscription):
    """Hands out its events, then fails (the broker away for too long, or a fault of ours)."""

    async def events(self, keepalive_s=None):
        async for event in super().events():
            yield event
        raise ConnectionError("the broker is gone")


async def test_a_stream_that_fails_ends_with_an_error_event_then_done():
    sub = _FailingSubscription([TokenEvent(seq=0, text="Hi", num_tokens=1)])
    writes = [write async for write in sse_events(sub, _fmt(is_chat=False))]
    assert writes[-1][1] and not writes[0][1]
    last = writes[-1][0].decode()
    assert '"code": "stream_failed"' in last and '"last_event_id": "0"' in last
    assert last.endswith("data: [DONE]\r\n\r\n")
    assert sub.is_closed


async def test_a_stream_whose_client_left_writes_no_error_event():
    events = [TokenEvent(seq=0, text="Hi", num_tokens=1)]
    out, sub = await _collect(events, _fmt(is_chat=False), Interruption.CLIENT_GONE)
    assert [c if c == "[DONE]" else c["choices"][0]["text"] for c in out] == ["Hi", "[DONE]"]
    assert sub.is_closed
