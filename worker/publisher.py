"""Send a step's outputs to the clients: token events over pub/sub, then the final event.

A finished request is first recorded in SQL, then its final event is published, then its
stream entry is acknowledged: a client that reads its usage right after `[DONE]` finds it,
and an entry is never acknowledged before its record is durable.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from sqlalchemy.engine import Engine

from shared import keys
from shared.protocol import ErrorEvent, FinalEvent, TokenEvent, Usage, encode_event
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
        self._finishing: set[asyncio.Task] = set()

    def track(self, entry: StreamEntry) -> None:
        self.inflight[entry.request.request_id] = InFlight(entry)

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
                task = asyncio.create_task(self._finish(flight, output))
                self._finishing.add(task)
                task.add_done_callback(self._finishing.discard)

    async def drain(self) -> None:
        """Wait for finished requests still being recorded."""
        if self._finishing:
            await asyncio.gather(*self._finishing, return_exceptions=True)

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
        await self._redis.publish(
            keys.request_channel(request.request_id),
            encode_event(self._final_event(flight, output)),
        )
        if is_recorded:
            await self._intake.ack(flight.entry)

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
