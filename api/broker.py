"""The API's side of Redis: subscribe to a request's channel, then enqueue it on its tenant's stream.

Subscribing first is what makes the hand-off safe: pub/sub delivers only to listeners
present at PUBLISH time, so the confirmation of SUBSCRIBE is awaited before XADD; no
token can be published before someone listens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from shared import keys
from shared.protocol import (
    ErrorEvent,
    FinalEvent,
    QueuedRequest,
    TokenEvent,
    decode_event,
    encode_cancel,
)

SUBSCRIBE_TIMEOUT_S = 5.0


@dataclass
class Subscription:
    """A request's event channel, subscribed before the request was enqueued."""

    request: QueuedRequest
    pubsub: PubSub
    redis: aioredis.Redis
    is_finished: bool = False

    async def events(self) -> AsyncIterator[TokenEvent | FinalEvent | ErrorEvent]:
        """Token events, then exactly one final or error event."""
        async for message in self.pubsub.listen():
            if message["type"] != "message":
                continue
            event = decode_event(message["data"])
            if not isinstance(event, TokenEvent):
                self.is_finished = True
            yield event
            if self.is_finished:
                return

    async def cancel(self) -> None:
        """Tell the worker serving the model that the client went away."""
        await self.redis.publish(
            keys.cancel_channel(self.request.model), encode_cancel(self.request.request_id)
        )

    async def close(self) -> None:
        # Shielded: this runs while a disconnected stream is being cancelled.
        with anyio.CancelScope(shield=True):
            if not self.is_finished:
                await self.cancel()
            await self.pubsub.aclose()


async def submit(redis: aioredis.Redis, request: QueuedRequest) -> Subscription:
    pubsub = redis.pubsub()
    try:
        await pubsub.subscribe(keys.request_channel(request.request_id))
        confirmation = await pubsub.get_message(timeout=SUBSCRIBE_TIMEOUT_S)
        if confirmation is None or confirmation["type"] != "subscribe":
            raise RuntimeError("no SUBSCRIBE confirmation from Redis")
        async with redis.pipeline(transaction=True) as pipe:
            pipe.sadd(keys.model_tenants(request.model), request.tenant_id)
            pipe.xadd(keys.tenant_stream(request.model, request.tenant_id), request.to_fields())
            await pipe.execute()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await pubsub.aclose()
        raise
    return Subscription(request=request, pubsub=pubsub, redis=redis)
