"""A worker's heartbeat (worker/heartbeat.py), written to the test Redis and read back as the
fleet snapshot reads it (`shared.fleet.WorkerState`)."""

from __future__ import annotations

import dataclasses
import time
import uuid

from shared import keys
from shared.fleet import WorkerState, read_workers
from shared.tables import ModelDeployment
from worker.engine import EngineStats
from worker.heartbeat import Beat, write

TIMEOUT_S = 6.0


def _beat(state: str, stats: EngineStats | None, **totals) -> Beat:
    deployment = ModelDeployment(
        id=7, model_id=f"beat-{uuid.uuid4().hex[:6]}", version="2", source="x",
        max_context_tokens=64,
    )  # fmt: skip
    totals = {"num_served_tokens": 0, "num_finished_requests": 0, "activation_s": None} | totals
    return Beat(
        f"w-{uuid.uuid4().hex[:6]}", deployment, state, "continuous", "dedicated", (), 100.0,
        load_times_s={"m": 2.5}, stats=stats, **totals,
    )  # fmt: skip


def test_a_standby_worker_says_its_totals_and_no_engine():
    beat = _beat("standby", None, num_served_tokens=1234, num_finished_requests=9,
                 activation_s=0.31234)  # fmt: skip
    fields = beat.fields(now_s=200.0)
    assert fields["state"] == "standby" and fields["deployment_id"] == 7
    assert "kv_cache_blocks" not in fields and "max_num_seqs" not in fields
    assert beat.capacity_tokens is None
    worker = WorkerState.from_heartbeat(
        beat.worker_id, {k: str(v) for k, v in fields.items()}, 201.0
    )
    assert (worker.state, worker.version, worker.heartbeat_age_s) == ("standby", "2", 1.0)
    assert (worker.num_served_tokens, worker.num_finished_requests) == (1234, 9)
    assert worker.activation_s == 0.3123
    assert worker.kv_cache_usage is None and worker.max_num_seqs is None
    assert dict(worker.load_s) == {"m": 2.5}


def test_older_heartbeats_read_as_no_totals_and_no_activation():
    worker = WorkerState.from_heartbeat("w", {"model": "m", "state": "ready"}, 0.0)
    assert (worker.num_served_tokens, worker.num_finished_requests) == (0, 0)
    assert worker.activation_s is None


async def test_only_a_ready_worker_is_ready_capacity(aredis):
    stats = EngineStats(1, 0, 4, max_num_tokens_per_sequence=512, kv_cache_usage=0.25,
                        kv_cache_blocks=32)  # fmt: skip
    ready = _beat("ready", stats, num_served_tokens=40)
    name, worker_id = ready.deployment.name, ready.worker_id
    await write(aredis, ready, TIMEOUT_S, time.time())
    assert await aredis.zscore(keys.ready_workers(name), worker_id) is not None
    assert await aredis.zscore(keys.model_capacity(name), worker_id) == 512
    [worker] = [w for w in await read_workers(aredis, time.time()) if w.worker_id == worker_id]
    assert (worker.state, worker.num_served_tokens, worker.kv_cache_usage) == ("ready", 40, 0.25)

    draining = dataclasses.replace(ready, state="draining")
    await write(aredis, draining, TIMEOUT_S, time.time())
    assert await aredis.zscore(keys.ready_workers(name), worker_id) is None
    assert await aredis.zscore(keys.model_capacity(name), worker_id) == 512  # still holds it

    standby = dataclasses.replace(ready, state="standby", stats=None)
    await write(aredis, standby, TIMEOUT_S, time.time())
    assert await aredis.zscore(keys.ready_workers(name), worker_id) is None
    assert await aredis.zscore(keys.model_capacity(name), worker_id) is None  # no KV cache
    assert await aredis.ttl(keys.worker_heartbeat(worker_id)) > 0
    await aredis.delete(keys.worker_heartbeat(worker_id))
