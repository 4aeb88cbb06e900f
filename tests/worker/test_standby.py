"""A dedicated worker's standby (worker/service.py, worker/role.py), the worker run in this
process against a Redis of the test's own: on standby it pulls nothing and holds no engine;
the role `active` has it serving within a second; the role `standby` drains it (running
requests finish, waiting ones go back to their stream) and frees its engine; SIGTERM ends
any state. The same through the platform's processes: tests/e2e/test_standby_worker.py."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.journal import Journal
from shared.protocol import FinishReason
from shared.redis_conn import text
from shared.tables import ModelDeployment
from tests.helpers import enqueue_request
from worker import role
from worker.config import EngineConfig
from worker.engine import ContinuousBatchingEngine
from worker.service import Worker, WorkerConfig

STATE_TIMEOUT_S = 10.0
MAX_ACTIVATION_S = 1.0


@dataclass
class Running:
    worker: Worker
    task: asyncio.Task
    client: aioredis.Redis
    deployment: ModelDeployment

    async def heartbeat(self) -> dict[str, str]:
        raw = await self.client.hgetall(keys.worker_heartbeat(self.worker.worker_id))
        return {text(k): text(v) for k, v in raw.items()}

    async def wait_state(self, state: str) -> dict[str, str]:
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while time.monotonic() < deadline:
            assert not self.task.done(), self.task.exception()
            if (beat := await self.heartbeat()).get("state") == state:
                return beat
            await asyncio.sleep(0.02)
        raise AssertionError(f"not {state} in {STATE_TIMEOUT_S} s: {await self.heartbeat()}")

    async def set_role(self, wanted: str) -> None:
        await self.client.hset(keys.AUTOSCALE_ROLES, self.worker.worker_id, wanted)

    async def is_ready_capacity(self) -> bool:
        name, worker_id = self.deployment.name, self.worker.worker_id
        ready = await self.client.zscore(keys.ready_workers(name), worker_id)
        capacity = await self.client.zscore(keys.model_capacity(name), worker_id)
        return ready is not None and capacity is not None

    async def enqueue(self, i: int, prompt: list[int], max_tokens: int) -> str:
        """A request on its tenant's stream, as the API leaves it; its id."""
        return await enqueue_request(self.client, self.deployment, i, prompt, max_tokens)

    @property
    def stream(self) -> str:
        return keys.tenant_stream(self.deployment.name, "t")

    async def num_pulled(self) -> int:
        """Entries of the stream some worker took (pending)."""
        if not await self.client.xinfo_groups(self.stream):
            return 0
        return (await self.client.xpending(self.stream, keys.WORKER_GROUP))["pending"]

    async def wait_ended(self, request_id: str) -> list:
        """The request's events once its final one is in the journal."""
        journal = Journal(self.client, ttl_s=60)
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while time.monotonic() < deadline:
            if await journal.is_ended(request_id):
                return await journal.read_after(request_id, -1)
            await asyncio.sleep(0.02)
        raise AssertionError(f"{request_id} did not end")


@pytest.fixture
async def start(own_redis, settings, tiny_model_dir) -> AsyncIterator:
    """Factory: a worker of a deployment of its own, running in this process."""
    client = aioredis.Redis.from_url(own_redis.url)
    worker_settings = settings.model_copy(
        update={"redis_url_env": own_redis.url, "worker_heartbeat_s": 0.5}
    )
    started: list[Running] = []

    def factory(engine: EngineConfig, *, standby: bool = True, dtype: str = "float32"):
        deployment = ModelDeployment(
            model_id=f"standby-{uuid.uuid4().hex[:6]}",
            version="1",
            source=str(tiny_model_dir),
            max_context_tokens=256,
        )
        config = WorkerConfig(engine, "cpu", dtype, metrics_port=0, standby=standby)
        worker = Worker(worker_settings, deployment, config)
        running = Running(worker, asyncio.create_task(worker.run()), client, deployment)
        started.append(running)
        return running

    yield factory
    for running in started:
        running.worker.stop()
        await asyncio.wait_for(running.task, STATE_TIMEOUT_S)
    await client.aclose()
    gc.unfreeze()  # the workers froze this process's heap (`shared/heap.py`)


def _num_live(kind: type) -> int:
    gc.unfreeze()  # frozen objects are not in `gc.get_objects`
    gc.collect()
    return sum(issubclass(type(o), kind) for o in gc.get_objects())


async def test_a_standby_worker_pulls_nothing_and_serves_once_active(start):
    num_engines = _num_live(ContinuousBatchingEngine)
    running = start(EngineConfig(max_num_seqs=4, num_kv_blocks=16, block_size=16))
    beat = await running.wait_state("standby")
    assert "kv_cache_blocks" not in beat and "max_num_seqs" not in beat  # no engine
    assert (beat["num_served_tokens"], beat["num_finished_requests"]) == ("0", "0")
    assert not await running.is_ready_capacity()
    assert _num_live(ContinuousBatchingEngine) == num_engines
    request_id = await running.enqueue(0, [5, 6, 7, 8], 6)
    await asyncio.sleep(5 * role.ROLE_POLL_S)
    assert await running.num_pulled() == 0 and await running.client.xlen(running.stream) == 1

    activated_at_s = time.monotonic()
    await running.set_role(role.ACTIVE)
    beat = await running.wait_state("ready")
    assert time.monotonic() - activated_at_s < MAX_ACTIVATION_S
    assert 0 < float(beat["activation_s"]) < MAX_ACTIVATION_S
    assert beat["kv_cache_blocks"] == "16" and await running.is_ready_capacity()
    events = await running.wait_ended(request_id)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert events[-1].usage.completion_tokens == 6
    await asyncio.sleep(0.6)  # a heartbeat after the end
    beat = await running.heartbeat()
    assert (beat["num_served_tokens"], beat["num_finished_requests"]) == (str(4 + 6), "1")


async def test_the_role_standby_drains_the_worker_and_frees_its_engine(start):
    num_engines = _num_live(ContinuousBatchingEngine)
    running = start(EngineConfig(max_num_seqs=4, num_kv_blocks=16, block_size=16), standby=False)
    await running.wait_state("ready")  # no role: the one it started with
    assert _num_live(ContinuousBatchingEngine) == num_engines + 1
    await running.set_role(role.STANDBY)
    beat = await running.wait_state("standby")
    assert "kv_cache_blocks" not in beat and not await running.is_ready_capacity()
    assert "activation_s" not in beat  # it started serving: no activation yet
    assert _num_live(ContinuousBatchingEngine) == num_engines  # engine and KV pool gone
    request_id = await running.enqueue(0, [5, 6, 7], 3)
    await asyncio.sleep(5 * role.ROLE_POLL_S)
    assert await running.num_pulled() == 0
    await running.set_role(role.ACTIVE)  # a second engine, over the same weights
    assert (await running.wait_ended(request_id))[-1].usage.completion_tokens == 3
    assert (await running.heartbeat())["state"] == "ready"


async def test_running_requests_finish_and_waiting_ones_go_back_on_the_way_to_standby(start):
    # Two blocks of 16 tokens: the first request (17 + 15 tokens) holds both, the second
    # waits for a block in the worker, not started: the drain hands it back to its stream.
    engine = EngineConfig(
        engine="echo", echo_tokens_per_s=20, max_num_seqs=2, num_kv_blocks=2, block_size=16
    )
    running = start(engine, standby=False)
    await running.wait_state("ready")
    prompt = list(range(5, 22))
    first = await running.enqueue(0, prompt, 15)
    second = await running.enqueue(1, prompt, 15)
    await asyncio.sleep(0.3)  # both pulled, the first running
    assert await running.num_pulled() == 2
    await running.set_role(role.STANDBY)
    await running.wait_state("draining")
    events = await running.wait_ended(first)
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert events[-1].usage.completion_tokens == 15
    await running.wait_state("standby")
    assert await running.num_pulled() == 0 and await running.client.xlen(running.stream) == 1
    assert not await Journal(running.client, ttl_s=60).is_ended(second)
    await running.set_role(role.ACTIVE)
    assert (await running.wait_ended(second))[-1].usage.completion_tokens == 15


async def test_sigterm_ends_a_standby_worker_at_once(start):
    running = start(EngineConfig(engine="echo"))
    await running.wait_state("standby")
    stopped_at_s = time.monotonic()
    running.worker.stop()
    await asyncio.wait_for(running.task, STATE_TIMEOUT_S)
    assert time.monotonic() - stopped_at_s < 1.0
    assert not await running.client.exists(keys.worker_heartbeat(running.worker.worker_id))
