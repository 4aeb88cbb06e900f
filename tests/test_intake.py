"""The worker's intake rule (`plan_pull`, pure) and its reads of real Redis streams."""

from __future__ import annotations

import uuid

from shared import keys
from tests.factories import make_request
from worker.intake import Intake, plan_pull


def _never(tenant: str) -> bool:
    return False


def test_free_places_are_spread_over_the_tenants_streams():
    count, tenants = plan_pull(6, ["a", "b", "c"], {"b": 2}, _never)
    assert (count, tenants) == (2, ["a", "c"])  # b already has its share waiting


def test_with_the_batch_full_only_heads_that_would_start_soon_are_read():
    def soon(tenant: str) -> bool:
        return tenant in ("light", "busy")

    count, tenants = plan_pull(0, ["flood", "light", "busy"], {"busy": 1}, soon)
    assert (count, tenants) == (1, ["light"])  # one each; busy has one waiting already


def test_fifo_reads_its_room_from_every_stream_and_nothing_when_full():
    assert plan_pull(4, ["a", "b"], {"a": 9}, _never, is_fair=False) == (4, ["a", "b"])
    assert plan_pull(0, ["a", "b"], {}, lambda t: True, is_fair=False) == (0, [])


async def _enqueue(aredis, model: str, tenant: str, n: int) -> None:
    await aredis.sadd(keys.model_tenants(model), tenant)
    for i in range(n):
        request = make_request(i, [1, 2, 3], 4, tenant_id=tenant)
        await aredis.xadd(keys.tenant_stream(model, tenant), request.to_fields())


async def test_a_full_worker_takes_the_head_of_a_tenant_that_would_start_soon(aredis):
    model = f"m-{uuid.uuid4().hex[:8]}"
    await _enqueue(aredis, model, "flood", 5)
    await _enqueue(aredis, model, "light", 5)
    intake = Intake(aredis, model, "w1")
    entries = await intake.pull(0, None, {}, lambda tenant: tenant == "light")
    assert [e.request.tenant_id for e in entries] == ["light"]


async def test_a_busy_worker_fills_its_room_from_its_preferred_tenants_first(aredis):
    model = f"m-{uuid.uuid4().hex[:8]}"
    await _enqueue(aredis, model, "a", 10)
    await _enqueue(aredis, model, "b", 10)
    intake = Intake(aredis, model, "w1", preferred_tenants=frozenset({"b"}))
    entries = await intake.pull(4, None, {}, lambda tenant: True)
    # b's requests take the room; a's next in line comes as a head.
    assert sorted(e.request.tenant_id for e in entries) == ["a", "b", "b", "b", "b"]
    idle = Intake(aredis, model, "w2", preferred_tenants=frozenset({"b"}))
    entries = await idle.pull(4, 10, {}, lambda tenant: True)  # idle: room for everyone
    assert sorted(e.request.tenant_id for e in entries) == ["a", "a", "b", "b"]
