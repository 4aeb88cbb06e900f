"""Prefill/decode disaggregation across worker processes' parts (worker/handoff.py,
worker/service.py), the workers run in this process against a Redis of the test's own: a
prefill worker computes each prompt and first token and hands the sequence, its KV sent over
ZeroMQ, to a decode worker, which streams the rest; the text is what one worker alone
streams and the usage is exact. A decode worker that does not answer in time loses the
offer (withdrawn in Redis) and the prefill worker decodes the sequence itself."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis
import zmq

from shared import keys
from shared.handoff import HandOffs
from shared.journal import Journal
from shared.protocol import FinalEvent, FinishReason, TokenEvent, encode_cancel
from shared.redis_conn import text
from shared.settings import Settings
from shared.tables import ModelDeployment
from tests.helpers import enqueue_request
from worker import handoff
from worker.config import EngineConfig
from worker.kv_link import KVSender, KVTransferRefused
from worker.service import Worker, WorkerConfig

TIMEOUT_S = 20.0
ENGINE = EngineConfig(max_num_seqs=8, num_kv_blocks=64, block_size=4, max_num_batched_tokens=64)
PROMPTS = [list(range(1000, 1000 + n)) for n in (5, 17, 30, 9, 23, 12)]
MAX_TOKENS = 12


@dataclass
class Fleet:
    client: aioredis.Redis
    deployment: ModelDeployment
    settings: Settings
    workers: dict[str, tuple[Worker, asyncio.Task]] = field(default_factory=dict)

    def start(self, name: str, role: str, *, step_delay_s: float = 0.0) -> Worker:
        config = WorkerConfig(
            ENGINE, "cpu", "float32", metrics_port=0, role=role, fault_step_delay_s=step_delay_s
        )
        worker = Worker(self.settings, self.deployment, config)
        self.workers[name] = (worker, asyncio.create_task(worker.run()))
        return worker

    async def wait_ready(self, name: str) -> None:
        worker, task = self.workers[name]
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            assert not task.done(), task.exception()
            state = await self.client.hget(keys.worker_heartbeat(worker.worker_id), "state")
            if state == b"ready":
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{name} not ready")

    async def wait_decoder_listed(self, worker: Worker) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        zset = keys.decode_workers(self.deployment.name)
        while not await self.client.zscore(zset, worker.worker_id):
            assert time.monotonic() < deadline, "the decode worker is not listed"
            await asyncio.sleep(0.02)
        await asyncio.sleep(2 * handoff.DECODERS_REFRESH_S)  # the prefill worker read it

    async def start_pair(self, *, decode_step_delay_s: float = 0.0) -> tuple[Worker, Worker]:
        """A decode worker, then a prefill worker (two loads at once in one process race in
        transformers), once the prefill worker knows the decode worker."""
        decoder = self.start("decode", handoff.ROLE_DECODE, step_delay_s=decode_step_delay_s)
        await self.wait_ready("decode")
        prefiller = self.start("prefill", handoff.ROLE_PREFILL)
        await self.wait_ready("prefill")
        await self.wait_decoder_listed(decoder)
        return prefiller, decoder

    async def enqueue(self, i: int, prompt: list[int], max_tokens: int = MAX_TOKENS) -> str:
        return await enqueue_request(self.client, self.deployment, i, prompt, max_tokens)

    async def served(self, request_ids: list[str]) -> list[tuple[str, FinalEvent]]:
        """Each request's streamed text and final event, once all have ended."""
        journal = Journal(self.client, ttl_s=60)
        deadline = time.monotonic() + TIMEOUT_S
        for request_id in request_ids:
            while not await journal.is_ended(request_id):
                assert time.monotonic() < deadline, f"{request_id} did not end"
                await asyncio.sleep(0.02)
        results = []
        for request_id in request_ids:
            events = await journal.read_after(request_id, -1)
            assert [e.seq for e in events] == list(range(len(events)))  # none lost or twice
            *tokens, final = events
            assert isinstance(final, FinalEvent) and all(isinstance(t, TokenEvent) for t in tokens)
            results.append(("".join(t.text for t in tokens), final))
        return results

    async def num_pending(self) -> int:
        stream = keys.tenant_stream(self.deployment.name, "t")
        return (await self.client.xpending(stream, keys.WORKER_GROUP))["pending"]


@pytest.fixture
async def fleet(own_redis, settings, tiny_model_dir) -> AsyncIterator:
    """Factory: the workers of a deployment of its own, running in this process."""
    client = aioredis.Redis.from_url(own_redis.url)
    worker_settings = settings.model_copy(
        update={"redis_url_env": own_redis.url, "worker_heartbeat_s": 0.2}
    )
    fleets: list[Fleet] = []

    def factory() -> Fleet:
        deployment = ModelDeployment(
            model_id=f"disagg-{uuid.uuid4().hex[:6]}",
            version="1",
            source=str(tiny_model_dir),
            max_context_tokens=256,
        )
        made = Fleet(client, deployment, worker_settings)
        fleets.append(made)
        return made

    yield factory
    for made in fleets:
        for worker, task in made.workers.values():
            worker.stop()
            await asyncio.wait_for(task, TIMEOUT_S)
    await client.aclose()
    gc.unfreeze()  # the workers froze this process's heap (`shared/heap.py`)


async def _served_whole(fleet) -> list[tuple[str, FinalEvent]]:
    """The prompts served by one worker alone: what disaggregation must stream too."""
    alone = fleet()
    alone.start("both", handoff.ROLE_BOTH)
    await alone.wait_ready("both")
    return await alone.served([await alone.enqueue(i, p) for i, p in enumerate(PROMPTS)])


def _check_usage(results: list[tuple[str, FinalEvent]]) -> None:
    for (_, final), prompt in zip(results, PROMPTS, strict=True):
        assert final.finish_reason is FinishReason.LENGTH
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
            len(prompt),
            MAX_TOKENS,
        )


async def test_the_decode_worker_streams_the_rest_of_what_the_prefill_worker_started(fleet):
    expected = await _served_whole(fleet)
    disaggregated = fleet()
    prefiller, decoder = await disaggregated.start_pair()
    beat = await disaggregated.client.hgetall(keys.worker_heartbeat(decoder.worker_id))
    assert beat[b"role"] == b"decode" and beat[b"kv_endpoint"].startswith(b"tcp://")

    request_ids = [await disaggregated.enqueue(i, p) for i, p in enumerate(PROMPTS)]
    results = await disaggregated.served(request_ids)
    assert [t for t, _ in results] == [t for t, _ in expected]
    _check_usage(results)
    handoffs = HandOffs(disaggregated.client, ttl_s=60)
    for request_id in request_ids:
        state = await handoffs.state(request_id)
        assert state is not None and state.state == "accepted"
        assert (state.sender, state.receiver) == (prefiller.worker_id, decoder.worker_id)
        owner = await disaggregated.client.hget(keys.request_meta(request_id), "owner")
        assert text(owner) == decoder.worker_id
    assert await disaggregated.num_pending() == 0  # every entry acknowledged, by the decoder


async def test_without_a_decode_worker_the_prefill_worker_serves_requests_whole(fleet):
    expected = await _served_whole(fleet)
    alone = fleet()
    alone.start("prefill", handoff.ROLE_PREFILL)
    await alone.wait_ready("prefill")
    request_ids = [await alone.enqueue(i, p) for i, p in enumerate(PROMPTS)]
    results = await alone.served(request_ids)
    assert [t for t, _ in results] == [t for t, _ in expected]
    _check_usage(results)
    assert all([await HandOffs(alone.client, 60).state(r) is None for r in request_ids])


async def test_an_offer_nobody_answers_is_withdrawn_and_decoded_by_the_prefill_worker(
    fleet, monkeypatch
):
    monkeypatch.setattr(handoff, "ANSWER_TIMEOUT_S", 0.3)
    expected = await _served_whole(fleet)
    silent = fleet()
    # A decode worker that is listed with room but never answers (hung, or its link cut).
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    await silent.client.hset(
        keys.worker_heartbeat("hung"), mapping={"kv_endpoint": f"tcp://127.0.0.1:{port}"}
    )
    await silent.client.zadd(keys.decode_workers(silent.deployment.name), {"hung": 1000})
    prefiller = silent.start("prefill", handoff.ROLE_PREFILL)
    await silent.wait_ready("prefill")
    await asyncio.sleep(2 * handoff.DECODERS_REFRESH_S)
    request_ids = [await silent.enqueue(i, p) for i, p in enumerate(PROMPTS[:3])]
    results = await silent.served(request_ids)
    socket.close(linger=0)
    assert [t for t, _ in results] == [t for t, _ in expected[:3]]
    for request_id in request_ids:
        state = await HandOffs(silent.client, 60).state(request_id)
        assert state is not None and (state.state, state.receiver) == ("withdrawn", "hung")
        owner = await silent.client.hget(keys.request_meta(request_id), "owner")
        assert text(owner) == prefiller.worker_id
    assert await silent.num_pending() == 0


async def test_a_cancel_ends_the_request_on_the_decode_worker_and_frees_its_blocks(fleet):
    pair = fleet()
    _, decoder = await pair.start_pair(decode_step_delay_s=0.05)
    request_id = await pair.enqueue(0, PROMPTS[1], max_tokens=200)
    journal = Journal(pair.client, ttl_s=60)
    deadline = time.monotonic() + TIMEOUT_S
    while await journal.last_seq(request_id) < 4:  # streaming from the decode worker
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    await pair.client.publish(
        keys.cancel_channel(pair.deployment.model_id), encode_cancel(request_id)
    )
    ((_, final),) = await pair.served([request_id])
    assert final.finish_reason is FinishReason.CANCELLED
    delivered = await journal.read_after(request_id, -1)
    assert (
        5
        <= final.usage.completion_tokens
        == sum(e.num_tokens for e in delivered if isinstance(e, TokenEvent))
        < 200
    )
    await asyncio.sleep(0.5)  # a heartbeat after the end
    beat = await pair.client.hgetall(keys.worker_heartbeat(decoder.worker_id))
    assert float(beat[b"kv_cache_usage"]) == 0.0 and beat[b"num_running"] == b"0"
    assert await pair.num_pending() == 0


def test_a_transfer_the_loop_does_not_take_in_time_is_refused_and_then_skipped(monkeypatch):
    monkeypatch.setattr(handoff, "ANSWER_TIMEOUT_S", 0.2)
    receiver = handoff.Receiver("tcp://127.0.0.1:0", wake=lambda: None)
    sender = KVSender()
    header = {"request_id": "r", "layout": {}, "num_tokens": 4, "num_blocks": 1}
    try:
        with pytest.raises(KVTransferRefused, match="did not take it in time"):
            sender.send(receiver.endpoint, header, b"\0" * 64, timeout_s=5.0)
        (arrival,) = receiver.take()
        assert not arrival.verdict.set_running_or_notify_cancel()  # the loop skips it
    finally:
        sender.close()
        receiver.close()
