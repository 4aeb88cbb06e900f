"""The worker's intake rule (`plan_pull`, pure) and its reads of real Redis streams."""

from __future__ import annotations

import uuid
from collections import Counter

from shared import keys
from shared.auto_pipeline import AutoPipelinedRedis
from tests.factories import make_request
from worker.intake import Intake, plan_pull


class _Engine:
    """What the intake asks of an engine, set by hand."""

    def __init__(self, num_free=0, waiting=None, soon=()):
        self.num_free, self.waiting, self.soon = num_free, Counter(waiting or {}), set(soon)

    def num_free_slots(self) -> int:
        return self.num_free

    def num_waiting_by_tenant(self) -> Counter:
        return self.waiting

    def starting_soon(self, tenants) -> set[str]:
        return self.soon & set(tenants)


def test_free_places_are_shared_by_the_streams_of_tenants_with_less_than_their_share():
    engine = _Engine(waiting={"b": 2, "c": 4})
    plan = plan_pull(12, ["a", "b", "c"], engine)
    assert plan == {"a": 4, "b": 4}  # shares of 4: one read; c has its share waiting


def test_with_the_batch_full_only_heads_that_would_start_soon_are_read():
    engine = _Engine(waiting={"busy": 1}, soon={"light", "busy"})
    assert plan_pull(0, ["flood", "light", "busy"], engine) == {"light": 1}


def test_fifo_reads_its_room_from_every_stream_and_nothing_when_full():
    engine = _Engine(waiting={"a": 9}, soon={"a", "b"})
    assert plan_pull(4, ["a", "b"], engine, is_fair=False) == {"a": 4, "b": 4}
    assert plan_pull(0, ["a", "b"], engine, is_fair=False) == {}


async def _enqueue(aredis, model: str, tenant: str, n: int) -> None:
    await aredis.sadd(keys.model_tenants(model), tenant)
    for i in range(n):
        request = make_request(i, [1, 2, 3], 4, tenant_id=tenant)
        await aredis.xadd(keys.tenant_stream(model, tenant), request.to_fields())


async def test_a_full_worker_takes_the_head_of_a_tenant_that_would_start_soon(aredis):
    model = f"m-{uuid.uuid4().hex[:8]}"
    await _enqueue(aredis, model, "flood", 5)
    await _enqueue(aredis, model, "light", 5)
    entries = await Intake(aredis, model, "w1").pull(_Engine(soon={"light"}), None)
    assert [e.request.tenant_id for e in entries] == ["light"]


async def test_a_busy_worker_fills_its_room_from_its_preferred_tenants_first(aredis):
    model = f"m-{uuid.uuid4().hex[:8]}"
    await _enqueue(aredis, model, "a", 10)
    await _enqueue(aredis, model, "b", 10)
    intake = Intake(aredis, model, "w1", preferred_tenants=frozenset({"b"}))
    entries = await intake.pull(_Engine(num_free=4, soon={"a", "b"}), None)
    # b's requests take the room; a's, next in line, comes as a head.
    assert sorted(e.request.tenant_id for e in entries) == ["a", "b", "b", "b", "b"]


class _Recording(AutoPipelinedRedis):
    """Names the commands of each pipeline it sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pipelines: list[list[str]] = []

    async def _run(self, batch):
        self.pipelines.append([str(args[0]) for args, _, _ in batch])
        await super()._run(batch)


async def test_a_busy_pull_reads_the_tenant_set_and_the_streams_in_one_round_trip(
    aredis, redis_server
):
    model = f"m-{uuid.uuid4().hex[:8]}"
    await _enqueue(aredis, model, "a", 10)
    client = _Recording.from_url(redis_server.url)
    intake, engine = Intake(client, model, "w1"), _Engine(num_free=2, soon={"a", "b"})
    assert len(await intake.pull(engine, None)) == 2  # the first pull learns the tenants
    client.pipelines.clear()
    entries = await intake.pull(engine, None)
    assert [e.request.tenant_id for e in entries] == ["a", "a"]
    reads = [sent for sent in client.pipelines if {"SMEMBERS", "XREADGROUP"} & set(sent)]
    assert reads == [["SMEMBERS", "XREADGROUP"]]  # one round trip, not one each
    # A tenant new since the latest pull is read in the same pull, after the set shows it.
    await _enqueue(aredis, model, "b", 10)
    entries = await intake.pull(engine, None)
    assert sorted(e.request.tenant_id for e in entries) == ["a", "a", "b"]
    await client.aclose()


async def test_an_idle_worker_takes_its_room_from_every_stream(aredis):
    model = f"m-{uuid.uuid4().hex[:8]}"
    await _enqueue(aredis, model, "a", 10)
    await _enqueue(aredis, model, "b", 10)
    intake = Intake(aredis, model, "w1")
    entries = await intake.pull(_Engine(num_free=6), 50)
    assert sorted(e.request.tenant_id for e in entries) == ["a"] * 3 + ["b"] * 3
    other = f"m-{uuid.uuid4().hex[:8]}"
    await _enqueue(aredis, other, "a", 0)  # a stream with nothing on it
    assert await Intake(aredis, other, "w1").pull(_Engine(num_free=6), 50) == []


def _unique(tenant: str, i: int = 0):
    request = make_request(i, [1, 2, 3], 4, tenant_id=tenant)
    return request.model_copy(update={"request_id": uuid.uuid4().hex})


async def _put(aredis, model: str, request) -> str:
    await aredis.sadd(keys.model_tenants(model), request.tenant_id)
    entry_id = await aredis.xadd(keys.tenant_stream(model, request.tenant_id), request.to_fields())
    return entry_id.decode()


async def test_a_malformed_entry_is_dropped_and_the_rest_is_served(aredis):
    model = f"m-{uuid.uuid4().hex[:8]}"
    good = _unique("a")
    await aredis.sadd(keys.model_tenants(model), "a")
    stream = keys.tenant_stream(model, "a")
    await aredis.xadd(stream, {"body": '{"request_id": "no rest"}'})
    await _put(aredis, model, good)
    entries = await Intake(aredis, model, "w1").pull(_Engine(num_free=4), 50)
    assert [e.request.request_id for e in entries] == [good.request_id]
    assert await aredis.xlen(stream) == 1  # the malformed one acknowledged and deleted


async def test_an_entry_of_a_request_that_already_ended_is_acknowledged_not_served(aredis):
    # Delivered again after it ended (handed back or reclaimed in a race): not served twice.
    model = f"m-{uuid.uuid4().hex[:8]}"
    ended, fresh = _unique("a", 0), _unique("a", 1)
    await aredis.set(keys.request_done(ended.request_id), "worker-0", ex=60)
    for request in (ended, fresh):
        await _put(aredis, model, request)
    entries = await Intake(aredis, model, "w1").pull(_Engine(num_free=4), 50)
    assert [e.request.request_id for e in entries] == [fresh.request_id]
    assert await aredis.xlen(keys.tenant_stream(model, "a")) == 1


async def test_handed_back_entries_go_to_the_tail_for_any_worker(aredis):
    model = f"m-{uuid.uuid4().hex[:8]}"
    request = _unique("a")
    old_id = await _put(aredis, model, request)
    w1, w2 = Intake(aredis, model, "w1"), Intake(aredis, model, "w2")
    (entry,) = await w1.pull(_Engine(num_free=1), 50)
    assert await w2.pull(_Engine(num_free=1), 50) == []  # w1 holds it
    await w1.hand_back([entry])
    (again,) = await w2.pull(_Engine(num_free=1), 50)
    assert again.request.request_id == request.request_id and again.entry_id != old_id
    assert await aredis.hget(keys.request_meta(request.request_id), "entry_id") == (
        again.entry_id.encode()
    )
    pending = await aredis.xpending(keys.tenant_stream(model, "a"), keys.WORKER_GROUP)
    assert pending["pending"] == 1 and pending["consumers"] == [{"name": b"w2", "pending": 1}]


async def test_entries_left_idle_by_a_stopped_worker_are_claimed(aredis):
    model = f"m-{uuid.uuid4().hex[:8]}"
    request = _unique("a")
    await _put(aredis, model, request)
    dead, alive = Intake(aredis, model, "dead"), Intake(aredis, model, "alive")
    await dead.pull(_Engine(num_free=1), 50)
    assert await alive.claim_idle(min_idle_ms=60_000, max_count=16) == []  # not idle yet
    (claimed,) = await alive.claim_idle(min_idle_ms=0, max_count=16)
    assert claimed.request.request_id == request.request_id


async def test_a_stream_deleted_under_the_worker_is_read_again_once_it_comes_back(aredis):
    # Its consumer group went with it: XREADGROUP answers NOGROUP, which stopped the worker.
    model = f"m-{uuid.uuid4().hex[:8]}"
    await _put(aredis, model, _unique("a"))
    intake = Intake(aredis, model, "w1")
    assert len(await intake.pull(_Engine(num_free=4), 50)) == 1
    await aredis.delete(keys.tenant_stream(model, "a"))
    await aredis.xadd(keys.tenant_stream(model, "a"), _unique("a").to_fields())  # no group
    assert await intake.pull(_Engine(num_free=4), 50) == []
    assert await intake.claim_idle(min_idle_ms=0, max_count=16) == []
    (entry,) = await intake.pull(_Engine(num_free=4), 50)  # the group is there again
    assert entry.request.tenant_id == "a"
