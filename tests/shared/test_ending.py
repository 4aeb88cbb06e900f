"""The one ending (shared/ending.py) against the test Redis: whoever ends a request, and
however many try at once, it ends once, with one usage job, one terminal event and its
stream entry gone."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from arq.constants import job_key_prefix
from redis.exceptions import ConnectionError as RedisConnectionError

from shared import ending, keys, recovery, usage_jobs
from shared.ending import Ending, end_request, failed
from shared.journal import Journal
from shared.protocol import ErrorCode, FinalEvent, QueuedRequest, TokenEvent, Usage
from tests.factories import make_request

QUEUE = f"llmfleet:ending-test-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def journal(aredis) -> Journal:
    return Journal(aredis, ttl_s=60)


async def _queued(aredis, *, retention_days: int | None = None) -> tuple[QueuedRequest, tuple]:
    """A request on its tenant's stream, taken by a worker (pending in the group)."""
    request = make_request(0, [5, 6, 7], 8, tenant_id=f"t-{uuid.uuid4().hex[:6]}")
    request = request.model_copy(
        update={"request_id": uuid.uuid4().hex, "content_retention_days": retention_days}
    )
    stream = keys.tenant_stream(request.deployment_name, request.tenant_id)
    await aredis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    entry_id = await aredis.xadd(stream, request.to_fields())
    await aredis.xreadgroup(keys.WORKER_GROUP, "worker-1", {stream: ">"})
    return request, (stream, entry_id.decode())


async def _job_args(aredis, request_id: str) -> dict:
    job = await aredis.get(job_key_prefix + usage_jobs.usage_job_id(request_id))
    assert job is not None
    (event,) = usage_jobs.loads(job)["a"]
    return event


async def _delivered(journal: Journal, request_id: str, texts: list[str]) -> None:
    for seq, text in enumerate(texts):
        assert await journal.append(request_id, TokenEvent(seq=seq, text=text, num_tokens=1))


async def test_two_enders_at_once_end_it_once(aredis, journal):
    # A worker reclaiming the entry and the API replica streaming it both find the worker
    # dead: one ends it, the other does nothing.
    request, entry = await _queued(aredis)
    await _delivered(journal, request.request_id, ["Hel", "lo"])
    lost = failed(ErrorCode.WORKER_LOST, "gone")
    results = await asyncio.gather(
        *(
            end_request(aredis, journal, request, entry, lost, claimer=who, usage_queue=QUEUE)
            for who in ("worker-2", "api-7")
        )
    )
    assert sorted(results) == [False, True]
    events = await journal.read_after(request.request_id, -1)
    assert [e.type for e in events] == ["token", "token", "error"]
    assert events[-1].code is ErrorCode.WORKER_LOST
    assert await aredis.zcard(QUEUE) >= 1
    usage = await _job_args(aredis, request.request_id)
    # Lost: billed what was delivered; computed the prompt and those.
    assert (usage["output_tokens"], usage["computed_tokens"]) == (2, 5)
    assert usage["finish_reason"] == "error" and usage["output_text"] is None
    stream = entry[0]
    assert await aredis.xrange(stream) == []
    assert (await aredis.xpending(stream, keys.WORKER_GROUP))["pending"] == 0


async def test_a_finished_request_is_billed_the_engines_counts(aredis, journal):
    request, entry = await _queued(aredis, retention_days=7)
    await _delivered(journal, request.request_id, ["a", "b", "c"])
    final = FinalEvent(
        seq=0, text="d", finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=4)
    )
    done = Ending(final, num_output_tokens=4, num_computed_tokens=19)  # 19: with a recompute
    assert await end_request(aredis, journal, request, entry, done, claimer="w", usage_queue=QUEUE)
    usage = await _job_args(aredis, request.request_id)
    assert (usage["output_tokens"], usage["computed_tokens"]) == (4, 19)
    assert usage["finish_reason"] == "length"
    assert usage["output_text"] == "abcd"  # kept content: the journal's text and the last delta
    last = (await journal.read_after(request.request_id, -1))[-1]
    assert last.type == "final" and last.seq == 3


async def test_a_usage_that_cannot_be_handed_over_gives_the_end_back(aredis, journal, monkeypatch):
    request, entry = await _queued(aredis)

    async def unreachable(*args, **kwargs):
        raise RedisConnectionError("the broker went away")

    monkeypatch.setattr(ending.usage_jobs, "enqueue_usage", unreachable)
    lost = failed(ErrorCode.WORKER_LOST, "gone")
    assert not await end_request(aredis, journal, request, entry, lost, claimer="w1")
    assert not await journal.is_done(request.request_id)
    monkeypatch.undo()
    # Whoever tries next ends it: the entry stayed pending.
    assert await end_request(aredis, journal, request, entry, lost, claimer="w2", usage_queue=QUEUE)
    assert (await journal.read_after(request.request_id, -1))[-1].code is ErrorCode.WORKER_LOST


TAKE_OVER_AFTER_S = 0.2  # the heartbeat timeout


async def _claimed_by_a_stopped_worker(aredis, journal, *, age_s: float):
    """A request the dead `worker-gone` started, whose end it claimed `age_s` ago and never
    completed (killed between `claim_end` and the last event)."""
    while not await recovery.is_broker_settled(aredis, TAKE_OVER_AFTER_S):
        await asyncio.sleep(0.1)  # a test Redis just started: a heartbeat may not be due
    request, entry = await _queued(aredis)
    await _delivered(journal, request.request_id, ["Hel", "lo"])
    assert await journal.claim_end(request.request_id, "worker-gone")
    await aredis.expire(keys.request_done(request.request_id), int(journal.ttl_s - age_s))
    return request, entry


async def test_an_end_claimed_by_a_worker_that_stopped_is_taken_over(aredis, journal):
    # Before, the claim stayed with the dead worker: the reclaimer acknowledged the entry as
    # ended, every other ender found it "ended elsewhere", and the stream hung.
    request, entry = await _claimed_by_a_stopped_worker(aredis, journal, age_s=2)
    lost = failed(ErrorCode.WORKER_LOST, "gone")
    assert not await end_request(aredis, journal, request, entry, lost, claimer="api-7")
    assert await end_request(
        aredis, journal, request, entry, lost, claimer="api-7", usage_queue=QUEUE,
        take_over_after_s=TAKE_OVER_AFTER_S,
    )  # fmt: skip
    events = await journal.read_after(request.request_id, -1)
    assert [e.type for e in events] == ["token", "token", "error"]
    assert (await _job_args(aredis, request.request_id))["output_tokens"] == 2
    assert await aredis.xrange(entry[0]) == []
    # Completed now: nobody takes it over again.
    assert not await end_request(
        aredis,
        journal,
        request,
        entry,
        lost,
        claimer="worker-3",
        take_over_after_s=TAKE_OVER_AFTER_S,
    )
    assert len(await journal.read_after(request.request_id, -1)) == 3


async def test_a_live_or_recent_claim_is_not_taken_over(aredis, journal):
    lost = failed(ErrorCode.WORKER_LOST, "gone")
    recent, entry = await _claimed_by_a_stopped_worker(aredis, journal, age_s=0)
    assert not await end_request(
        aredis, journal, recent, entry, lost, claimer="api-7", take_over_after_s=TAKE_OVER_AFTER_S
    )
    alive, entry = await _claimed_by_a_stopped_worker(aredis, journal, age_s=5)
    await aredis.set(keys.worker_heartbeat("worker-gone"), "1", ex=5)  # it beats after all
    try:
        assert not await end_request(
            aredis,
            journal,
            alive,
            entry,
            lost,
            claimer="api-7",
            take_over_after_s=TAKE_OVER_AFTER_S,
        )
    finally:
        await aredis.delete(keys.worker_heartbeat("worker-gone"))
    for request in (recent, alive):
        assert [e.type for e in await journal.read_after(request.request_id, -1)] == ["token"] * 2
