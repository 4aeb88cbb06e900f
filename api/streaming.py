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
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import anyio
from sse_starlette import EventSourceResponse
from sse_starlette.event import ServerSentEvent
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from api.broker import Interruption, Subscription
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


async def sse_events(subscription: Subscription, fmt: ChunkFormat) -> AsyncIterator[bytes]:
    """SSE events for sse-starlette, encoded; always ends with `[DONE]`, after an error event
    if one came. What one worker event makes goes out in one write, and the last event's
    with `[DONE]` (a final event with usage is three SSE events: one write, not three).

    The last SSE event made from each worker event carries its `seq` as `id:`, so a client
    that reconnects with `Last-Event-ID` resumes right after it (`GET
    /v1/requests/{id}/events`)."""
    is_first = subscription.next_seq == 0
    last = b""
    try:
        async for event in subscription.events():
            chunks = _chunks(event, fmt, is_first=is_first)
            is_first = is_first and not chunks
            encoded = _encoded(chunks, event.seq)
            if isinstance(event, TokenEvent):
                if encoded:
                    yield encoded
                continue
            last = encoded
            break
        # Its events are over: it listens no more, whatever the last writes below take.
        await subscription.close()
        if not subscription.is_finished and subscription.interruption is not None:
            last += _encoded([_interruption_json(subscription)], None)
        yield last + DONE
    finally:
        await subscription.close()


DONE = ServerSentEvent(data="[DONE]").encode()


def _encoded(chunks: list[dict], seq: int | None) -> bytes:
    """The chunks as SSE events, the last one with `id: seq`."""
    return b"".join(
        ServerSentEvent(
            data=json.dumps(chunk),
            id=str(seq) if i == len(chunks) - 1 and seq is not None else None,
        ).encode()
        for i, chunk in enumerate(chunks)
    )


class SubscriptionStream(EventSourceResponse):
    """The SSE response of one subscription, which it closes however the response ends:
    `sse_events` closes it too, but only once it has started, and a client that leaves at
    once can end the response before the generator ever runs (an async generator never
    started runs no `finally`: the subscription stayed open and the request ran to its
    end). `holding`, if given, is entered for the response's whole life (a resume stream's
    slot). A send its client does not take within `send_timeout_s` stalls the stream
    (`_StallWatch`)."""

    def __init__(
        self,
        subscription: Subscription,
        fmt: ChunkFormat,
        *,
        send_timeout_s: float,
        holding: AbstractAsyncContextManager | None = None,
        **kwargs,
    ) -> None:
        super().__init__(sse_events(subscription, fmt), **kwargs)
        self.subscription = subscription
        self.send_timeout_s = send_timeout_s
        self.holding = holding

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watched = _StallWatch(send, self.send_timeout_s, self._stalled)
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self.subscription.close)
            if self.holding is not None:
                await stack.enter_async_context(self.holding)
            await super().__call__(scope, receive, watched)

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
            with anyio.move_on_after(self.timeout_s) as scope:
                await self.send(message)
            if not scope.cancelled_caught:
                return
            self.is_stalled = True
            await self.on_stall()
        await self.send(message)


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
    reason = subscription.interruption
    last_event_id = subscription.next_seq - 1
    return {
        "error": {
            "message": _interruption_message(subscription),
            "type": "server_error",
            "param": None,
            "code": reason,
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
