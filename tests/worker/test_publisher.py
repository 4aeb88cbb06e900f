"""The publisher (worker/publisher.py) against the test Redis: a request's tokens and its end
reach its journal in order, its entry goes once its usage is handed over, and a request
someone else ended is orphaned here, never written to again."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from arq.constants import job_key_prefix

from shared import keys, usage_jobs
from shared.journal import Journal
from shared.protocol import ErrorCode, FinishReason
from tests.factories import make_request
from worker.intake import Intake
from worker.publisher import Publisher
from worker.sequence import ErrorInfo, SequenceOutput

QUEUE = f"llmfleet:publisher-test-{uuid.uuid4().hex[:6]}"


@pytest.fixture
async def served(aredis):
    """A publisher, and the entry it serves (pulled from its tenant's stream)."""
    model = f"m-{uuid.uuid4().hex[:8]}"
    request = make_request(0, [5, 6, 7], 4, tenant_id="a")
    request = request.model_copy(update={"request_id": uuid.uuid4().hex, "model": model})
    await aredis.sadd(keys.model_tenants(model), "a")
    await aredis.xadd(keys.tenant_stream(model, "a"), request.to_fields())
    intake = Intake(aredis, model, "w1")

    class Room:
        def num_free_slots(self):
            return 1

        def num_waiting_by_tenant(self):
            return Counter()

        def starting_soon(self, tenants):
            return set()

    (entry,) = await intake.pull(Room(), 50)
    journal = Journal(aredis, ttl_s=60)
    publisher = Publisher(aredis, intake, journal, "w1", retry_s=1.0, usage_queue=QUEUE)
    publisher.track(entry)
    return publisher, journal, entry


def _token(request_id: str, text: str, num_output: int) -> SequenceOutput:
    return SequenceOutput(request_id, text, 1, None, 3, num_output)


async def test_tokens_then_the_final_event_and_the_entry_goes(served, aredis):
    publisher, journal, entry = served
    rid = entry.request.request_id
    await publisher.publish([_token(rid, "He", 1)])
    await publisher.publish([_token(rid, "ll", 2)])
    final = SequenceOutput(rid, "o", 1, FinishReason.LENGTH, 3, 3, num_computed_tokens=6)
    await publisher.publish([final])
    await publisher.drain()
    events = await journal.read_after(rid, -1)
    assert [(e.type, e.seq) for e in events] == [("token", 0), ("token", 1), ("final", 2)]
    assert events[-1].finish_reason is FinishReason.LENGTH and events[-1].text == "o"
    assert events[-1].usage.completion_tokens == 3
    assert await aredis.xlen(entry.stream) == 0  # acknowledged and deleted
    job = usage_jobs.loads(await aredis.get(job_key_prefix + usage_jobs.usage_job_id(rid)))
    assert job["a"][0]["computed_tokens"] == 6
    assert rid not in publisher.inflight


async def test_an_error_ends_the_stream_with_its_code(served):
    publisher, journal, entry = served
    rid = entry.request.request_id
    refused = SequenceOutput(rid, "", 0, FinishReason.ERROR, 3, 0)
    refused.error = ErrorInfo(ErrorCode.KV_CACHE_CAPACITY, "too long")
    await publisher.publish([refused])
    await publisher.drain()
    (event,) = await journal.read_after(rid, -1)
    assert event.type == "error" and event.code is ErrorCode.KV_CACHE_CAPACITY


async def test_a_request_ended_elsewhere_is_orphaned_and_not_written_again(served, aredis):
    # A reclaim after this worker was taken for dead ended it: this worker drops it.
    publisher, journal, entry = served
    rid = entry.request.request_id
    await publisher.publish([_token(rid, "a", 1)])
    assert await journal.claim_end(rid, "worker-2")
    await publisher.publish([_token(rid, "b", 2)])
    assert publisher.take_orphans() == {rid}
    await publisher.publish([_token(rid, "c", 3)])  # the step before the abort took effect
    assert [e.text for e in await journal.read_after(rid, -1)] == ["a"]
    assert await aredis.xlen(entry.stream) == 1  # not this worker's to acknowledge


async def test_tokens_are_appended_after_redis_lost_its_scripts(served, aredis):
    """A restarted Redis holds no scripts: the step's appends go by SHA1 alone, so the
    publisher loads the script and sends them again, once each."""
    publisher, journal, entry = served
    rid = entry.request.request_id
    await publisher.publish([_token(rid, "He", 1)])
    await aredis.script_flush()
    await publisher.publish([_token(rid, "ll", 2)])
    events = await journal.read_after(rid, -1)
    assert [(e.type, e.seq, e.text) for e in events] == [("token", 0, "He"), ("token", 1, "ll")]
