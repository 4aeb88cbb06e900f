"""Send a step's outputs to the clients: token events, then the final event, through the
request's journal (`shared/journal.py`: appended and published in one script).

A finished request is ended by `shared/ending.py`: claim the end, hand the usage to the
control process, settle the admission, append the final event, acknowledge the entry. A
client reading its usage right after `[DONE]` may wait for the control process (typically
well under a second). If the journal refuses an event, someone else is serving or has
ended the request (a second delivery, or a reclaim after this worker was taken for dead):
the request is *orphaned* here: its sequence is aborted, nothing more is published,
recorded or acknowledged for it.

Every one of those writes, and each step's token events, is retried while the broker is
unreachable (`shared/redis_conn.retrying`; each is idempotent), for up to `broker_retry_s`:
meanwhile the batch waits, since at most one step's outputs are ahead of their publish.

A pulled request stops counting as queued in its tenant's admission (`shared/quota.py`)
here; that update never blocks a step, and a Redis error in it is logged.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from shared import keys, quota
from shared.ending import Ending, end_request
from shared.journal import Journal
from shared.protocol import ErrorCode, ErrorEvent, FinalEvent, QueuedRequest, TokenEvent, Usage
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
        usage_queue: str = keys.CONTROL_QUEUE,  # the control process's arq queue
    ) -> None:
        self._redis = redis
        self._intake = intake
        self._journal = journal
        self._worker_id = worker_id
        self._retry_s = retry_s  # how long a write waits for an unreachable broker
        self._usage_queue = usage_queue
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
        try:
            return await self._append_once(events)
        except NoScriptError:  # Redis restarted since the script was loaded
            await self._journal.load_append_script()
            return await self._append_once(events)

    async def _append_once(self, events: list[tuple[str, TokenEvent]]) -> list[int]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id, event in events:
                self._journal.append_in(pipe, request_id, event)
            return await pipe.execute()

    def _is_live(self, output: SequenceOutput) -> bool:
        flight = self.inflight.get(output.request_id)
        return flight is not None and not flight.is_orphaned

    async def adopt(self, entry: StreamEntry, num_events: int) -> None:
        """Track a request a prefill worker handed over (`worker/handoff.py`): its journal
        holds `num_events` events already. This worker is recorded as its owner before the
        prefill worker lets it go: crash recovery gives an idle entry back to its owner if
        that one is alive, and the prefill worker will not keep it."""
        await self._journal.set_owner(entry.request.request_id, self._worker_id)
        self.inflight[entry.request.request_id] = InFlight(entry, num_events)

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
        """End the request (`shared/ending.py`), its usage the engine's counts."""
        entry = flight.entry
        ending = Ending(
            self._last_event(output),
            num_output_tokens=output.num_output_tokens,
            num_computed_tokens=output.num_computed_tokens,
        )
        try:
            is_ended = await end_request(
                self._redis,
                self._journal,
                entry.request,
                (entry.stream, entry.entry_id),
                ending,
                claimer=self._worker_id,
                retry_s=self._retry_s,
                usage_queue=self._usage_queue,
            )
        except BROKER_ERRORS:
            # The entry stays pending, unrefreshed: once the heartbeat timeout passes, a
            # worker reclaims it and acknowledges it (the end is claimed).
            log.exception("request %s not ended here: the broker stayed unreachable",
                          entry.request.request_id)  # fmt: skip
            return
        if is_ended and output.error is not None and output.error.code is ErrorCode.MODEL_ERROR:
            await self._dead_letter(entry.request, output)

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

    @staticmethod
    def _last_event(output: SequenceOutput) -> FinalEvent | ErrorEvent:
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
