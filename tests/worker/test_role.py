"""A worker's role as the autoscaler wants it (worker/role.py)."""

from __future__ import annotations

import uuid

from shared import keys
from worker import role


def test_an_entry_names_the_role_and_none_keeps_the_one_it_started_with():
    assert role.role_of("active", role.STANDBY) == role.ACTIVE
    assert role.role_of("standby", role.ACTIVE) == role.STANDBY
    assert role.role_of(None, role.STANDBY) == role.STANDBY
    assert role.role_of(None, role.ACTIVE) == role.ACTIVE
    assert role.role_of("asleep", role.ACTIVE) == role.ACTIVE  # not a role: as if none


async def test_a_worker_reads_its_own_entry(aredis):
    worker_id = f"w-{uuid.uuid4().hex[:6]}"
    assert await role.read_entry(aredis, worker_id) is None
    await aredis.hset(keys.AUTOSCALE_ROLES, mapping={worker_id: "standby", "other": "active"})
    try:
        assert await role.read_entry(aredis, worker_id) == "standby"
    finally:
        await aredis.hdel(keys.AUTOSCALE_ROLES, worker_id, "other")
