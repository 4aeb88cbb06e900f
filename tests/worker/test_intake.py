"""The worker's intake rule (`plan_pull`, pure) and its reads of real Redis streams."""

from __future__ import annotations

import uuid
from collections import Counter

from shared import keys
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
