"""Worker events -> OpenAI responses: SSE chunks for `stream: true`, one JSON body otherwise.

The worker's final event carries the last text delta together with the finish reason, so
the last content chunk has `finish_reason` without holding any chunk back.

A stream this process interrupts (`api/broker.py` `Interruption`) ends with an error event
of its own, between two events, then `[DONE]`:

- `api_shutdown` (`api/shutdown.py`): the request runs on; the event names it and the last
  event delivered, for `GET /v1/requests/{id}/events` on another replica;
- `stream_stalled`: the client took nothing for `stream_send_timeout_s` (its socket did not
  drain). Its request is cancelled at once, as for a client that left, and the error event
  and `[DONE]` follow whatever the socket still holds, should the client ever read.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
from sse_starlette.event import ServerSentEvent
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from api.broker import Interruption, Keepalive, Subscription
from api.errors import APIError
from shared.protocol import ErrorCode, ErrorEvent, FinalEvent, TokenEvent, Usage

log = logging.getLogger("llmfleet.api")


@dataclass(frozen=True, slots=True)
class ChunkFormat:
    """Shapes one request's chunks: `text_completion` or `chat.completion.chunk`."""

    request_id: str
    model: str
    is_chat: bool
    include_usage: bool
    created: int

    def content(self, text: str, finish_reason: str | None, *, is_first: bool) -> dict:
        if self.is_chat:
            delta: dict = {"role": "assistant", "content": text} if is_first else {"content": text}
            if finish_reason is not None and not text and not is_first:
                delta = {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._chunk([choice], usage=None)

    def usage(self, usage: Usage) -> dict:
        return self._chunk([], usage=_usage_json(usage))

    def _chunk(self, choices: list[dict], usage: dict | None) -> dict:
        chunk: dict[str, object] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage
        return chunk


def chunk_format(subscription: Subscription, model: str, include_usage: bool) -> ChunkFormat:
    info = subscription.info
    return ChunkFormat(
        request_id=info.request_id,
        model=model,
        is_chat=info.kind == "chat",
        include_usage=include_usage,
        created=info.created,
    )


async def sse_events(
    subscription: Subscription, fmt: ChunkFormat, *, keepalive_s: float | None = None
) -> AsyncIterator[tuple[bytes, bool]]:
    """The stream's writes, each with whether it is the last: SSE events, encoded, always
    ending with `[DONE]`, after an error event if one came. What one worker event makes goes
    out in one write, and the last event's with `[DONE]` (a final event with usage is three
    SSE events: one write, not three). With `keepalive_s`, a comment line whenever nothing
    was written for that long.

    The last SSE event made from each worker event carries its `seq` as `id:`, so a client
    that reconnects with `Last-Event-ID` resumes right after it (`GET
    /v1/requests/{id}/events`). A stream that fails (the broker away for longer than a stream
    waits, or a fault of ours) ends with a `stream_failed` error event, then `[DONE]`."""
    is_first = subscription.next_seq == 0
    last = b""
    try:
        try:
            async for event in subscription.events(keepalive_s):
                if isinstance(event, Keepalive):
                    yield PING, False
                    continue
                chunks = _chunks(event, fmt, is_first=is_first)
                is_first = is_first and not chunks
                encoded = _encoded(chunks, event.seq)
                if isinstance(event, TokenEvent):
                    if encoded:
                        yield encoded, False
                    continue
                last = encoded
                break
        except Exception as exc:
            log.exception("the stream of %s failed", subscription.info.request_id)
            last = _encoded([_failure_json(subscription, exc)], None)
        # Its events are over: it listens no more, whatever the last writes below take.
        await subscription.close()
        interruption = subscription.interruption
        if not subscription.is_finished and interruption not in (None, Interruption.CLIENT_GONE):
            last += _encoded([_interruption_json(subscription)], None)
        yield last + DONE, True
    finally:
        await subscription.close()


DONE = ServerSentEvent(data="[DONE]").encode()
PING = ServerSentEvent(comment="ping").encode()


def _encoded(chunks: list[dict], seq: int | None) -> bytes:
    """The chunks as SSE events, the last one with `id: seq`."""
    return b"".join(
        ServerSentEvent(
            data=json.dumps(chunk),
            id=str(seq) if i == len(chunks) - 1 and seq is not None else None,
        ).encode()
        for i, chunk in enumerate(chunks)
    )


def _chunks(
    event: TokenEvent | FinalEvent | ErrorEvent, fmt: ChunkFormat, *, is_first: bool
) -> list[dict]:
    if isinstance(event, ErrorEvent):
        return [_error_json(event)]
    chunks = []
    finish_reason = event.finish_reason if isinstance(event, FinalEvent) else None
    if event.text or finish_reason is not None:
        chunks.append(fmt.content(event.text, finish_reason, is_first=is_first))
    if isinstance(event, FinalEvent) and fmt.include_usage:
        chunks.append(fmt.usage(event.usage))
    return chunks


async def collect(subscription: Subscription, fmt: ChunkFormat) -> dict:
    """The whole answer as one completion body, for `stream: false`."""
    parts: list[str] = []
    try:
        async for event in subscription.events():
            if isinstance(event, Keepalive):
                continue
            if isinstance(event, ErrorEvent):
                status, error_type = _error_status(event)
                raise APIError(status, event.message, type=error_type, code=event.code)
            parts.append(event.text)
            if isinstance(event, FinalEvent):
                return _completion_body(fmt, "".join(parts), event)
    finally:
        await subscription.close()
    if subscription.interruption is Interruption.API_SHUTDOWN:
        raise APIError(
            503,
            _interruption_message(subscription),
            type="server_error",
            code=Interruption.API_SHUTDOWN,
            headers={"X-Request-Id": subscription.info.request_id},
        )
    raise APIError(500, "The request ended without a result.", type="server_error")


async def collect_while_connected(
    subscription: Subscription, fmt: ChunkFormat, receive: Receive
) -> dict:
    """`collect`, given up as soon as the client disconnects (raises `ClientDisconnect`):
    the subscription is then closed unfinished, which cancels the request exactly as when
    a streaming client leaves, so it is billed for what was computed and delivered."""
    with anyio.CancelScope() as scope:
        watcher = asyncio.create_task(_cancel_on_disconnect(receive, scope))
        try:
            return await collect(subscription, fmt)
        finally:
            watcher.cancel()
    raise ClientDisconnect()


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    # The body was read whole before the request was admitted, so the next message the
    # server has for this request is its disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


def _completion_body(fmt: ChunkFormat, text: str, final: FinalEvent) -> dict:
    if fmt.is_chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": final.finish_reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": final.finish_reason}
    return {
        "id": fmt.request_id,
        "object": "chat.completion" if fmt.is_chat else "text_completion",
        "created": fmt.created,
        "model": fmt.model,
        "choices": [choice],
        "usage": _usage_json(final.usage),
    }


def _usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


# Errors a worker finds in the request itself (worker/runner/guard.py), which the API's
# schema should have refused: the client's fault, so 400; every other end is the server's.
REQUEST_ERROR_CODES = frozenset({ErrorCode.INVALID_SAMPLING_PARAMS, ErrorCode.INVALID_PROMPT})


def _error_status(event: ErrorEvent) -> tuple[int, str]:
    if event.code in REQUEST_ERROR_CODES:
        return 400, "invalid_request_error"
    return 500, "server_error"


def _interruption_json(subscription: Subscription) -> dict:
    """The error event of a stream this process interrupted, with what a resume needs."""
    return _stream_error_json(
        subscription, str(subscription.interruption), _interruption_message(subscription)
    )


def _failure_json(subscription: Subscription, exc: Exception) -> dict:
    request_id = subscription.info.request_id
    message = f"The stream of request {request_id} failed ({type(exc).__name__})."
    return _stream_error_json(subscription, "stream_failed", message)


def _stream_error_json(subscription: Subscription, code: str, message: str) -> dict:
    """An error event that this process writes itself: the request and the last event
    delivered, for `GET /v1/requests/{id}/events`."""
    last_event_id = subscription.next_seq - 1
    return {
        "error": {
            "message": message,
            "type": "server_error",
            "param": None,
            "code": code,
            "request_id": subscription.info.request_id,
            "last_event_id": str(last_event_id) if last_event_id >= 0 else None,
        }
    }


def _interruption_message(subscription: Subscription) -> str:
    request_id = subscription.info.request_id
    if subscription.interruption is Interruption.STREAM_STALLED:
        return (
            f"The stream of request {request_id} was ended: its client took nothing for too "
            "long. The request was cancelled."
        )
    resume = f"GET /v1/requests/{request_id}/events"
    if subscription.next_seq > 0:
        resume += f" with Last-Event-ID: {subscription.next_seq - 1}"
    return (
        f"This API replica is shutting down. Request {request_id} goes on: resume it on "
        f"another replica with {resume}."
    )


def _error_json(event: ErrorEvent) -> dict:
    return {
        "error": {
            "message": event.message,
            "type": _error_status(event)[1],
            "param": None,
            "code": event.code,
        }
    }
