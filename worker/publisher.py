"""Send a step's outputs to the clients: token events over pub/sub, then the final event.

A finished request is first recorded in SQL, then its tenant's admission is settled, then
its final event is published, then its stream entry is acknowledged: a client that reads
its usage right after `[DONE]` finds it, and an entry is never acknowledged before its
record is durable. The admission limits (`shared/quota.py`) are kept here too: a pulled
request stops counting as queued, a finished one (for any reason) stops counting as in
flight and gets back the unused part of its token reservation. Those updates never block
a step, and a Redis error in them is logged: an unsettled slot expires on its own.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from sqlalchemy.engine import Engine

from shared import keys, quota
from shared.protocol import (
    ErrorEvent,
    FinalEvent,
    QueuedRequest,
    TokenEvent,
    Usage,
    encode_event,
)
from worker import usage
from worker.intake import Intake, StreamEntry
from worker.sequence import SequenceOutput

log = logging.getLogger("llmfleet.worker")


@dataclass(slots=True)
class InFlight:
    entry: StreamEntry
    num_events: int = 0

    def next_seq(self) -> int:
        self.num_events += 1
        return self.num_events - 1


class Publisher:
    def __init__(self, redis: aioredis.Redis, db: Engine, intake: Intake) -> None:
        self._redis = redis
        self._db = db
        self._intake = intake
        self.inflight: dict[str, InFlight] = {}
        self._tasks: set[asyncio.Task] = set()  # finishing requests, quota updates

    def track(self, entry: StreamEntry) -> None:
        self.inflight[entry.request.request_id] = InFlight(entry)
        self._spawn(self._mark_started(entry.request))

    async def publish(self, outputs: list[SequenceOutput]) -> None:
        tokens = [o for o in outputs if not o.is_finished and o.text]
        if tokens:
            async with self._redis.pipeline(transaction=False) as pipe:
                for output in tokens:
                    flight = self.inflight[output.request_id]
                    event = TokenEvent(
                        seq=flight.next_seq(), text=output.text, num_tokens=output.num_new_tokens
                    )
                    pipe.publish(keys.request_channel(output.request_id), encode_event(event))
                await pipe.execute()
        for output in outputs:
            if output.is_finished:
                flight = self.inflight.pop(output.request_id)
                self._spawn(self._finish(flight, output))

    async def drain(self) -> None:
        """Wait for finished requests still being recorded (and quota updates in flight)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _finish(self, flight: InFlight, output: SequenceOutput) -> None:
        request = flight.entry.request
        try:
            await asyncio.to_thread(usage.record, self._db, request, output)
        except Exception:
            # Not acknowledged: the entry stays pending and its usage is retried on reclaim.
            log.exception("usage record failed for %s", request.request_id)
            is_recorded = False
        else:
            is_recorded = True
        # Before the final event: a client that sends its next request on `[DONE]` must find
        # the in-flight slot free and the unused tokens back.
        await self._settle(request, output)
        await self._redis.publish(
            keys.request_channel(request.request_id),
            encode_event(self._final_event(flight, output)),
        )
        if is_recorded:
            await self._intake.ack(flight.entry)

    async def _mark_started(self, request: QueuedRequest) -> None:
        try:
            await quota.mark_started(self._redis, request)
        except (RedisError, OSError):
            log.exception("could not mark %s started in its tenant's queue", request.request_id)

    async def _settle(self, request: QueuedRequest, output: SequenceOutput) -> None:
        num_used_tokens = output.num_prompt_tokens + output.num_output_tokens
        try:
            await quota.settle(self._redis, request, num_used_tokens)
        except (RedisError, OSError):
            log.exception("could not settle the admission of %s", request.request_id)

    @staticmethod
    def _final_event(flight: InFlight, output: SequenceOutput) -> FinalEvent | ErrorEvent:
        if output.error is not None:
            return ErrorEvent(
                seq=flight.next_seq(), code=output.error.code, message=output.error.message
            )
        return FinalEvent(
            seq=flight.next_seq(),
            text=output.text,
            finish_reason=output.finish_reason,
            usage=Usage(
                prompt_tokens=output.num_prompt_tokens,
                completion_tokens=output.num_output_tokens,
            ),
        )
