"""The record of the processes `llmfleet up` supervises, through a real Redis, as the fleet
snapshot (`llmfleet status`, `/dashboard`) reads it."""

from __future__ import annotations

import json

from shared import fleet, keys, supervised
from shared.supervised import ProcessState


async def test_the_record_reaches_the_fleet_snapshot_and_expires(rdb, aredis):
    states = [
        ProcessState("worker-0", "running", 41, 2, "signal SIGKILL", 1000.0, metrics_port=9300),
        ProcessState("api", "restarting", None, 1, "exit 1", None),
    ]
    try:
        supervised.write(rdb, states, ttl_s=10)
        assert 0 < rdb.ttl(keys.SUPERVISED_PROCESSES) <= 10
        snapshot = await fleet.read_fleet(aredis, [])
        assert snapshot.processes == sorted(states, key=lambda s: s.name)
        supervised.write(rdb, states[1:], ttl_s=10)  # worker-0 stopped on purpose
        assert (await fleet.read_fleet(aredis, [])).processes == states[1:]
    finally:
        supervised.forget(rdb)
    assert (await fleet.read_fleet(aredis, [])).processes == []


def test_a_record_with_fields_this_version_does_not_know_still_reads():
    value = json.dumps({"name": "control", "state": "running", "pid": 7, "num_restarts": 0,
                        "last_exit": None, "up_since_ts": 5.0, "cpu_s": 3})  # fmt: skip
    assert ProcessState.from_json(value) == ProcessState("control", "running", 7, 0, None, 5.0)
