"""Send a step's outputs to the clients: token events, then the final event, through the
request's journal (`shared/journal.py`: appended and published in one script).

A finished request first claims its end in the journal, then its usage is handed to the
control process (an arq job in Redis, `shared/control.py`, committed to the ledger there),
then its tenant's admission is settled, then its final event is appended, then its stream
entry is acknowledged: an entry is never acknowledged before its usage is durable in Redis
(the job) and, from there, in SQL. A client reading its usage right after `[DONE]` may wait
for the control process (typically well under a second). If the journal refuses an event,
someone else is serving or has ended the request (a second delivery, or a reclaim after this worker
was taken for dead): the request is *orphaned* here: its sequence is aborted, nothing more
is published, recorded or acknowledged for it.

The admission limits (`shared/quota.py`) are kept here too: a pulled request stops counting
as queued, a finished one (for any reason) stops counting as in flight and gets back the
unused part of its token reservation. Those updates never block a step, and a Redis error
in them is logged: an unsettled slot expires on its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import control, keys, quota, usage
from shared.journal import Journal
from shared.protocol import ErrorEvent, FinalEvent, QueuedRequest, TokenEvent, Usage
from worker.intake import Intake, StreamEntry
from worker.sequence import SequenceOutput

log = logging.getLogger("llmfleet.worker")

DEAD_LETTER_MAXLEN = 1000


@dataclass(slots=True)
class InFlight:
    entry: StreamEntry
    num_events: int = 0
    is_orphaned: bool = False

    def next_seq(self) -> int:
        self.num_events += 1
        return self.num_events - 1

    @property
    def is_started(self) -> bool:
        return self.num_events > 0


class Publisher:
    def __init__(
        self,
        redis: aioredis.Redis,
        intake: Intake,
        journal: Journal,
        worker_id: str,
        usage_retry_s: float = 60.0,
    ) -> None:
        self._redis = redis
        self._intake = intake
        self._journal = journal
        self._worker_id = worker_id
        self._usage_retry_s = usage_retry_s
        self.inflight: dict[str, InFlight] = {}
        self.orphans: set[str] = set()  # to abort at the next step
        self._tasks: set[asyncio.Task] = set()  # finishing requests, quota updates
        # Publishes run one at a time, in call order: a request's events keep their order
        # (the journal refuses a `seq` below its last) even when the worker loop publishes
        # a step's outputs while the next step computes.
        self._last_publish: asyncio.Task | None = None

    def track(self, entry: StreamEntry) -> None:
        self.inflight[entry.request.request_id] = InFlight(entry)
        self._spawn(self._mark_started(entry.request))

    def publish(self, outputs: list[SequenceOutput]) -> asyncio.Task:
        """Publish a step's outputs after everything published before (await the task)."""
        task = asyncio.ensure_future(self._publish_after(self._last_publish, outputs))
        self._last_publish = task
        return task

    async def _publish_after(self, previous: asyncio.Task | None, outputs) -> None:
        if previous is not None and not previous.done():
            await asyncio.wait([previous])  # its error, if any, is its own caller's
        await self._publish(outputs)

    async def _publish(self, outputs: list[SequenceOutput]) -> None:
        tokens = [o for o in outputs if not o.is_finished and o.text and self._is_live(o)]
        if tokens:
            async with self._redis.pipeline(transaction=False) as pipe:
                for output in tokens:
                    flight = self.inflight[output.request_id]
                    event = TokenEvent(
                        seq=flight.next_seq(), text=output.text, num_tokens=output.num_new_tokens
                    )
                    await self._journal.append_in(pipe, output.request_id, event)
                appended = await pipe.execute()
            for output, is_appended in zip(tokens, appended, strict=True):
                if not is_appended:
                    self._orphan(output.request_id)
        for output in outputs:
            if output.is_finished and self._is_live(output):
                self._spawn(self._finish(self.inflight.pop(output.request_id), output))
            elif output.is_finished:
                self.inflight.pop(output.request_id, None)

    def _is_live(self, output: SequenceOutput) -> bool:
        flight = self.inflight.get(output.request_id)
        return flight is not None and not flight.is_orphaned

    def forget(self, request_ids: list[str]) -> list[StreamEntry]:
        """Stop tracking requests handed to another worker; their entries."""
        return [self.inflight.pop(rid).entry for rid in request_ids if rid in self.inflight]

    def _orphan(self, request_id: str) -> None:
        log.warning("request %s is served or ended elsewhere: dropping it here", request_id)
        self.inflight[request_id].is_orphaned = True
        self.orphans.add(request_id)

    def take_orphans(self) -> set[str]:
        orphans, self.orphans = self.orphans, set()
        return orphans

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
        if not await self._journal.claim_end(request.request_id, self._worker_id):
            log.warning("request %s was ended elsewhere", request.request_id)
            return
        if not await self._record_usage(request, output):
            # Give the end back and leave the entry pending, unrefreshed: once the heartbeat
            # timeout passes, a worker reclaims it and ends the request, recording its usage.
            await self._journal.release_end(request.request_id, self._worker_id)
            return
        # Before the final event: a client that sends its next request on `[DONE]` must find
        # the in-flight slot free and the unused tokens back.
        await self._settle(request, output)
        if output.error is not None and output.error.code == "model_error":
            await self._dead_letter(request, output)
        await self._journal.append_end(
            request.request_id, self._worker_id, self._final_event(output)
        )
        await self._intake.ack(flight.entry)

    async def _record_usage(self, request: QueuedRequest, output: SequenceOutput) -> bool:
        """Hand the usage to the control process (an arq job it commits to the ledger before
        dropping), retrying with backoff while Redis is unavailable (the client waits for
        its final event meanwhile); False if it never came back."""
        event = usage.usage_event(
            request,
            finish_reason=output.finish_reason,
            num_output_tokens=output.num_output_tokens,
            num_computed_tokens=output.num_computed_tokens,
            output_text=await self._output_text(request, output),
        )
        delay_s, deadline_s = 0.1, time.monotonic() + self._usage_retry_s
        while True:
            try:
                await control.enqueue_usage(self._redis, event)
                return True
            except (RedisError, OSError):
                if time.monotonic() + delay_s > deadline_s:
                    log.exception("usage of %s not handed over", request.request_id)
                    return False
                log.warning("usage of %s not handed over yet; retrying", request.request_id)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, 5.0)

    async def _output_text(self, request: QueuedRequest, output: SequenceOutput) -> str | None:
        """The whole output, only for a tenant that keeps it: the journal's token events and
        the final delta."""
        if request.content_retention_days is None:
            return None
        events = await self._journal.read_after(request.request_id, -1)
        return "".join(e.text for e in events if isinstance(e, TokenEvent)) + output.text

    async def _dead_letter(self, request: QueuedRequest, output: SequenceOutput) -> None:
        fields = {**request.to_fields(), "error": output.error.message}
        await self._redis.xadd(
            keys.dead_letter(request.model), fields, maxlen=DEAD_LETTER_MAXLEN, approximate=True
        )

    async def _mark_started(self, request: QueuedRequest) -> None:
        try:
            await quota.mark_started(self._redis, request)
            await self._journal.set_owner(request.request_id, self._worker_id)
        except (RedisError, OSError):
            log.exception("could not mark %s started in its tenant's queue", request.request_id)

    async def _settle(self, request: QueuedRequest, output: SequenceOutput) -> None:
        num_used_tokens = output.num_prompt_tokens + output.num_output_tokens
        try:
            await quota.settle(self._redis, request, num_used_tokens)
        except (RedisError, OSError):
            log.exception("could not settle the admission of %s", request.request_id)

    @staticmethod
    def _final_event(output: SequenceOutput) -> FinalEvent | ErrorEvent:
        # `seq` is set by the journal: the one after the last event appended.
        if output.error is not None:
            return ErrorEvent(seq=0, code=output.error.code, message=output.error.message)
        return FinalEvent(
            seq=0,
            text=output.text,
            finish_reason=output.finish_reason,
            usage=Usage(
                prompt_tokens=output.num_prompt_tokens,
                completion_tokens=output.num_output_tokens,
            ),
        )
