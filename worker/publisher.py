"""Send a step's outputs to the clients: token events, then the final event, through the
request's journal (`shared/journal.py`: appended and published in one script).

A finished request first claims its end in the journal, then its usage is handed to the
control process (an arq job in Redis, `shared/usage_jobs.py`, committed to the ledger there),
then its tenant's admission is settled, then its final event is appended, then its stream
entry is acknowledged: an entry is never acknowledged before its usage is durable in Redis
(the job) and, from there, in SQL. A client reading its usage right after `[DONE]` may wait
for the control process (typically well under a second). If the journal refuses an event,
someone else is serving or has ended the request (a second delivery, or a reclaim after this worker
was taken for dead): the request is *orphaned* here: its sequence is aborted, nothing more
is published, recorded or acknowledged for it.

Every one of those writes, and each step's token events, is retried while the broker is
unreachable (`shared/redis_conn.retrying`; each is idempotent), for up to `broker_retry_s`:
meanwhile the batch waits, since at most one step's outputs are ahead of their publish.

The admission limits (`shared/quota.py`) are kept here too: a pulled request stops counting
as queued, a finished one (for any reason) stops counting as in flight and gets back the
unused part of its token reservation. Those updates never block a step, and a Redis error
in them is logged: an unsettled slot expires on its own.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys, quota, usage, usage_jobs
from shared.journal import Journal
from shared.protocol import ErrorEvent, FinalEvent, QueuedRequest, TokenEvent, Usage
from shared.redis_conn import BROKER_ERRORS, retrying
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
        retry_s: float = 60.0,
    ) -> None:
        self._redis = redis
        self._intake = intake
        self._journal = journal
        self._worker_id = worker_id
        self._retry_s = retry_s  # how long a write waits for an unreachable broker
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
            events = [
                (o.request_id, TokenEvent(seq=self.inflight[o.request_id].next_seq(),
                                          text=o.text, num_tokens=o.num_new_tokens))
                for o in tokens
            ]  # fmt: skip
            # While the broker is away the next step waits here (one step at most is ahead).
            appended = await retrying(
                lambda: self._append(events), within_s=self._retry_s, what="a step's tokens"
            )
            for (request_id, _), is_appended in zip(events, appended, strict=True):
                if not is_appended:
                    self._orphan(request_id)
        for output in outputs:
            if output.is_finished and self._is_live(output):
                self._spawn(self._finish(self.inflight.pop(output.request_id), output))
            elif output.is_finished:
                self.inflight.pop(output.request_id, None)

    async def _append(self, events: list[tuple[str, TokenEvent]]) -> list[int]:
        """Append a step's token events in one round trip (idempotent: `Journal`)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id, event in events:
                await self._journal.append_in(pipe, request_id, event)
            return await pipe.execute()

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
        request_id = flight.entry.request.request_id
        try:
            await self._end(flight, output)
        except BROKER_ERRORS:
            # The entry stays pending, unrefreshed: once the heartbeat timeout passes, a
            # worker reclaims it and ends the request, recording its usage.
            log.exception("request %s not ended here: the broker stayed unreachable", request_id)

    async def _end(self, flight: InFlight, output: SequenceOutput) -> None:
        """Claim the end, record the usage, settle, append the final event, acknowledge; each
        step retried while the broker is unreachable (each is idempotent)."""
        request = flight.entry.request
        request_id, me = request.request_id, self._worker_id

        async def retried(call, what: str):
            return await retrying(call, within_s=self._retry_s, what=f"{what} of {request_id}")

        if not await retried(lambda: self._journal.claim_end(request_id, me), "the end"):
            log.warning("request %s was ended elsewhere", request_id)
            return
        assert output.finish_reason is not None  # only finished outputs are ended
        event = usage.usage_event(
            request,
            finish_reason=output.finish_reason,
            num_output_tokens=output.num_output_tokens,
            num_computed_tokens=output.num_computed_tokens,
            output_text=await retried(lambda: self._output_text(request, output), "the text"),
        )
        try:
            # The control process commits the job to the ledger before dropping it.
            await retried(lambda: usage_jobs.enqueue_usage(self._redis, event), "the usage")
        except BROKER_ERRORS:
            # Give the end back, so that recovery can record it (see `_finish`).
            await self._journal.release_end(request_id, me)
            raise
        # Before the final event: a client that sends its next request on `[DONE]` must find
        # the in-flight slot free and the unused tokens back.
        await self._settle(request, output)
        if output.error is not None and output.error.code == "model_error":
            await self._dead_letter(request, output)
        final = self._final_event(output)
        keeps_content = bool(request.content_retention_days)  # None or 0: never stored
        await retried(
            lambda: self._journal.append_end(request_id, me, final, keeps_content=keeps_content),
            "the final event",
        )
        await retried(lambda: self._intake.ack(flight.entry), "the acknowledgement")

    async def _output_text(self, request: QueuedRequest, output: SequenceOutput) -> str | None:
        """The whole output, only for a tenant that keeps it: the journal's token events and
        the final delta."""
        if request.content_retention_days is None:
            return None
        events = await self._journal.read_after(request.request_id, -1)
        return "".join(e.text for e in events if isinstance(e, TokenEvent)) + output.text

    async def _dead_letter(self, request: QueuedRequest, output: SequenceOutput) -> None:
        fields = dead_letter_fields(request, output)
        try:
            await self._redis.xadd(
                keys.dead_letter(request.model),
                fields,  # type: ignore[arg-type]  # redis-py: `fields` is an invariant Dict (redis-py#2917)
                maxlen=DEAD_LETTER_MAXLEN,
                approximate=True,
            )
        except (RedisError, OSError):
            log.exception("could not dead-letter %s", request.request_id)

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


def dead_letter_fields(request: QueuedRequest, output: SequenceOutput) -> dict[str, str]:
    """A dead letter: who, what failed and how big it was, for every tenant; the request
    itself (`body`: its prompt token ids, its stop strings), so that an operator can replay
    the poison, only for a tenant that keeps content. The stream is capped by length, not
    time, so a never-store tenant's prompt would otherwise outlive every promise."""
    error = output.error
    fields = {
        "request_id": request.request_id,
        "tenant_id": request.tenant_id,
        "model": request.model,
        "deployment_id": str(request.deployment_id),
        "kind": request.kind,
        "arrival_ts": str(request.arrival_ts),
        "code": error.code if error is not None else "",
        "error": error.message if error is not None else "",
        "num_prompt_tokens": str(output.num_prompt_tokens),
        "num_output_tokens": str(output.num_output_tokens),
        "num_computed_tokens": str(output.num_computed_tokens),
        "sampling": request.sampling.model_dump_json(exclude={"stop"}),
    }
    if request.content_retention_days:  # None or 0: never stored
        fields |= request.to_fields()
    return fields
