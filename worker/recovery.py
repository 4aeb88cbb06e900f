"""A worker's part in crash recovery: keep its own entries claimed, reclaim dead workers'.

Every heartbeat, a worker resets the idle time of the entries it holds (`XCLAIM` to itself),
so an entry stays idle longer than the heartbeat timeout only when its worker has stopped.
`XAUTOCLAIM` over the model's tenant streams then takes such entries, and for each:

- the journal says the request has ended (its worker died between ending it and
  acknowledging the entry): acknowledge it;
- its end was claimed and never completed (its worker died in between): the end is taken
  over and completed here, with `worker_lost`;
- the request had started (its journal holds events): it cannot be continued elsewhere
  without repeating or losing tokens the client has seen, so it ends with `worker_lost`,
  its delivered tokens recorded once (`shared/ending.py`);
- it had not started: it is served here, like a new entry.

An entry can also be idle because the broker was away (its worker could not refresh it):
one of this worker's own is left alone, and one whose owner still heartbeats goes back
to it. Right after a broker restart nothing is reclaimed for two heartbeat timeouts: the
heartbeat keys may all be gone while the workers reconnect (`recovery.is_broker_settled`).
"""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from shared import keys, recovery, stream_queue
from shared.ending import Ending, end_request, failed
from shared.journal import Journal
from shared.protocol import ErrorCode
from worker.intake import Intake, StreamEntry

MAX_RECLAIMED_PER_STREAM = 16
WORKER_LOST: Ending = failed(
    ErrorCode.WORKER_LOST, "The worker generating this request stopped; it was not completed."
)


class Reclaimer:
    def __init__(
        self,
        redis: aioredis.Redis,
        intake: Intake,
        journal: Journal,
        worker_id: str,
        timeout_s: float,
        is_own: Callable[[str], bool],
    ) -> None:
        self._redis = redis
        self._intake = intake
        self._journal = journal
        self._worker_id = worker_id
        self._timeout_ms = int(timeout_s * 1000)
        self._is_own = is_own

    async def _is_alive(self, worker_id: str) -> bool:
        return bool(await self._redis.exists(keys.worker_heartbeat(worker_id)))

    async def keep_claimed(self, entries: list[StreamEntry]) -> None:
        if entries:
            await self._intake.keep_claimed(entries)

    async def reclaim(self) -> list[StreamEntry]:
        """Dead workers' entries: the ones to serve here (not started); the rest are settled."""
        if not await recovery.is_broker_settled(self._redis, self._timeout_ms / 1000):
            return []  # the broker just restarted: every entry looks idle, owners re-beat
        to_serve = []
        for entry in await self._intake.claim_idle(self._timeout_ms, MAX_RECLAIMED_PER_STREAM):
            request_id = entry.request.request_id
            if self._is_own(request_id):
                continue  # ours all along: its idle time grew while the broker was away
            owner = (await self._journal.meta(request_id)).get("owner")
            if owner and owner != self._worker_id and await self._is_alive(owner):
                await self._intake.give_to(entry, owner)  # idle, not dead (a broker outage)
                continue
            if await self._journal.is_ended(request_id):
                await stream_queue.ack(self._redis, entry.stream, entry.entry_id)
            elif await self._journal.is_done(request_id) or (
                await self._journal.last_seq(request_id) >= 0
            ):
                # Started, or its end claimed by its dead worker and never completed.
                await end_request(
                    self._redis,
                    self._journal,
                    entry.request,
                    (entry.stream, entry.entry_id),
                    WORKER_LOST,
                    claimer=self._worker_id,
                    take_over_after_s=self._timeout_ms / 1000,
                )
            else:
                to_serve.append(entry)
        return to_serve
