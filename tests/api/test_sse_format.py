"""Worker events -> OpenAI SSE chunks: every stream ends with [DONE], errors included."""

from __future__ import annotations

import json

from api.streaming import ChunkFormat, sse_events
from shared.protocol import ErrorEvent, FinalEvent, TokenEvent, Usage


class FakeSubscription:
    next_seq = 0

    def __init__(self, events):
        self._events = events
        self.is_closed = False

    async def events(self):
        for event in self._events:
            yield event

    async def close(self):
        self.is_closed = True


def _fmt(is_chat: bool, include_usage: bool = True) -> ChunkFormat:
    return ChunkFormat("cmpl-1", "m", is_chat=is_chat, include_usage=include_usage, created=0)


async def _collect(events, fmt) -> tuple[list, FakeSubscription]:
    sub = FakeSubscription(events)
    out = [e["data"] async for e in sse_events(sub, fmt)]
    return [d if d == "[DONE]" else json.loads(d) for d in out], sub


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
    out = [e async for e in sse_events(sub, _fmt(is_chat=False))]
    # the final event makes two chunks (text, usage): only the second carries its id
    assert [e.get("id") for e in out] == ["0", "1", None, "2", None]
    assert out[-1]["data"] == "[DONE]"
