"""Decode steps through static, padded buffers (`worker/runner/decode_graphs.py`): on the CPU,
the path a GPU replays as CUDA graphs, checked token for token against the eager step and
`generate`, across batch and context buckets, with padding rows and block tables of
different lengths."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from shared.protocol import SamplingParams
from tests import tiny_model
from tests.factories import serve
from tests.reference import greedy_alone
from worker.engine import ContinuousBatchingEngine
from worker.fair_queue import FairQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import TenantAwarePreemption
from worker.runner.decode_graphs import DecodeGraphs, GraphBuckets
from worker.runner.model_runner import ModelRunner
from worker.scheduler import Scheduler, SchedulerConfig
from worker.step_batch import ChunkInput, StepBatch

# Small buckets, so that prompts of a few dozen tokens cross them: contexts of 8, 16, 32
# and 64 tokens at 4 tokens a block.
SMALL = GraphBuckets(batch_sizes=(1, 2, 4), context_blocks=(2, 4, 8, 16))
BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def loaded(request):
    return tiny_model.attentive(request.param)


def test_default_buckets_reach_max_num_seqs_and_the_longest_context():
    buckets = GraphBuckets.default(max_num_seqs=64, block_size=16, max_context_tokens=8192)
    assert buckets.batch_sizes == (1, 2, 4, 8, 16, 32, 48, 64)
    assert buckets.context_blocks == (16, 32, 64, 128, 256, 512)
    odd = GraphBuckets.default(max_num_seqs=100, block_size=16, max_context_tokens=1000)
    assert odd.batch_sizes[-2:] == (96, 100)
    assert odd.context_blocks == (16, 32, 63)  # 1,000 tokens: the pool's or model's limit
    huge = GraphBuckets.default(max_num_seqs=4096, block_size=16, max_context_tokens=1 << 17)
    assert huge.batch_sizes[-1] == 512 and huge.context_blocks[-1] == 512


def test_pick_takes_the_smallest_bucket_that_holds_the_step():
    assert SMALL.pick(3, 5) == (4, 8)
    assert SMALL.pick(1, 1) == (1, 2)
    assert SMALL.pick(4, 16) == (4, 16)
    assert SMALL.pick(5, 2) is None  # more decodes than the largest bucket: eager
    assert SMALL.pick(2, 17) is None  # a longer context than the largest bucket: eager
    assert SMALL.all()[0] == (4, 16)  # largest first: it sizes the graphs' memory pool


def _engine(loaded, graphs: str, num_blocks: int = 14):
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        KVCacheManager(num_blocks, BLOCK_SIZE, prefix_caching=True),
        FairQueue(quantum_tokens=8),
        TenantAwarePreemption(),
    )
    runner = ModelRunner(
        loaded, num_blocks, BLOCK_SIZE, "own", graphs=graphs, max_num_seqs=4, graph_buckets=SMALL
    )
    return ContinuousBatchingEngine(scheduler, runner), runner


# The fifth waits for a place in the batch (four at most), and ends alone with a short context.
PROMPTS = [list(range(1000, 1030)), [7, 7, 7, 7, 7, 7], list(range(2000, 2045, 3)), [42], [5, 6]]


def test_greedy_through_the_padded_path_equals_eager_and_generate(loaded, monkeypatch):
    steps = []  # (decodes, blocks each decode's context takes, bucket) of each replay
    run = DecodeGraphs.run

    def recording_run(self, decodes, bucket):
        tables = [-(-chunk.end // BLOCK_SIZE) for chunk in decodes]
        steps.append((len(decodes), tables, bucket))
        return run(self, decodes, bucket)

    monkeypatch.setattr(DecodeGraphs, "run", recording_run)
    engine, runner = _engine(loaded, "on")
    outputs = serve(engine, PROMPTS, 12)
    eager_outputs = serve(_engine(loaded, "off")[0], PROMPTS, 12)
    for output, eager, prompt in zip(outputs, eager_outputs, PROMPTS, strict=True):
        assert output == eager == greedy_alone(loaded, prompt, 12)
    assert runner.num_graph_replays == len(steps) > 10
    assert engine.scheduler.num_preemptions > 0  # recomputed prompts too
    assert any(bucket[0] > num_decodes for num_decodes, _, bucket in steps)  # padding rows
    assert len({bucket[0] for _, _, bucket in steps}) >= 2  # batch buckets crossed
    assert len({bucket[1] for _, _, bucket in steps}) >= 3  # context buckets crossed
    assert any(len(set(tables)) > 1 for _, tables, _ in steps)  # tables of unequal length


def _prefill_then_decodes(runners, prompts: list[list[int]]) -> list[ChunkInput]:
    """Prefill `prompts` (eager: a step with prompt chunks) in every runner; the decode
    chunks that follow, one per prompt, each with blocks for its next two tokens."""
    prefills, decodes, next_block = [], [], 0
    for i, prompt in enumerate(prompts):
        num_blocks = -(-(len(prompt) + 2) // BLOCK_SIZE)
        blocks = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        prefills.append(ChunkInput(f"r{i}", prompt, 0, blocks, GREEDY))
        decodes.append((f"r{i}", len(prompt), blocks))
    sampled = [runner.execute(StepBatch([], prefills)) for runner in runners]
    assert all(tokens == sampled[0] for tokens in sampled)
    return [
        ChunkInput(request_id, [token], start, blocks, GREEDY)
        for (request_id, start, blocks), token in zip(decodes, sampled[0], strict=True)
    ]


def test_padding_rows_write_only_the_scratch_block(loaded):
    num_blocks = 32
    static = ModelRunner(loaded, num_blocks, BLOCK_SIZE, "own", graphs="on", graph_buckets=SMALL)
    eager = ModelRunner(loaded, num_blocks, BLOCK_SIZE, "own", graphs="off")
    # Three decodes (bucket 4: one padding row) with contexts of 6, 22 and 11 tokens.
    prompts = [list(range(300, 305)), list(range(400, 421)), list(range(500, 510))]
    decodes = _prefill_then_decodes([static, eager], prompts)
    assert static.execute(StepBatch(decodes, [])) == eager.execute(StepBatch(decodes, []))
    assert static.num_graph_replays == 1
    assert static._k_pool.shape[2] == num_blocks + 1 == eager._k_pool.shape[2] + 1
    for static_pool, eager_pool in (
        (static._k_pool, eager._k_pool),
        (static._v_pool, eager._v_pool),
    ):
        torch.testing.assert_close(static_pool[:, :, :num_blocks], eager_pool)
        assert static_pool[:, :, num_blocks].abs().sum() > 0  # the padding row's key and value


def test_mixed_and_oversized_steps_run_eager(loaded):
    static = ModelRunner(loaded, 64, BLOCK_SIZE, "own", graphs="on", graph_buckets=SMALL)
    eager = ModelRunner(loaded, 64, BLOCK_SIZE, "own", graphs="off")
    prompts = [list(range(100 * i, 100 * i + 3 + i)) for i in range(1, 7)]
    decodes = _prefill_then_decodes([static, eager], prompts)
    prompt = ChunkInput("p", list(range(900, 910)), 0, [60, 61, 62], GREEDY)
    for batch in (StepBatch(decodes[:2], [prompt]), StepBatch(decodes[2:], [])):  # mixed; 4
        assert static.execute(batch) == eager.execute(batch)
    assert static.num_graph_replays == 1
    more = [
        ChunkInput(c.request_id, [c.token_ids[0] + 1], c.end, c.block_ids, GREEDY) for c in decodes
    ]
    assert static.execute(StepBatch(more[:5], [])) == eager.execute(StepBatch(more[:5], []))
    assert static.num_graph_replays == 1  # five decodes: more than the largest bucket


def test_the_cpu_default_takes_no_graphs(loaded):
    runner = ModelRunner(loaded, 16, BLOCK_SIZE)
    assert runner._graphs is None and runner._k_pool.shape[2] == 16
    assert ModelRunner(loaded, 16, BLOCK_SIZE, graphs="off")._graphs is None
    with pytest.raises(ValueError, match="own forward"):
        ModelRunner(loaded, 16, BLOCK_SIZE, "hf", graphs="on")
    with pytest.raises(ValueError, match="graphs must be"):
        ModelRunner(loaded, 16, BLOCK_SIZE, graphs="yes")


def test_a_dropped_runner_frees_its_pool_at_once(loaded):
    # Benchmarks build engine after engine in one process: on a GPU a pool kept alive until
    # the next garbage collection would leave the next engine's pool short of memory.
    static = ModelRunner(loaded, 16, BLOCK_SIZE, "own", graphs="on", graph_buckets=SMALL)
    decodes = _prefill_then_decodes([static], [[1, 2, 3], [4, 5]])
    static.execute(StepBatch(decodes, []))
    assert static.num_graph_replays == 1
    pool = weakref.ref(static._k_pool)
    gc.disable()
    try:
        del static
        assert pool() is None
    finally:
        gc.enable()


def test_capture_all_takes_every_bucket_and_leaves_the_collector_as_it_was(loaded):
    runner = ModelRunner(loaded, 32, BLOCK_SIZE, "own", graphs="on", graph_buckets=SMALL)
    graphs = runner._graphs
    assert graphs is not None and graphs.num_captured == 0  # on the CPU: on first use
    graphs.capture_all()
    assert graphs.num_captured == len(SMALL.all()) == 12
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("graphs", ["on", "off"])
def test_warm_up_runs_each_chunk_size_then_requests_are_served_as_before(
    loaded, graphs, monkeypatch
):
    shapes = []  # (decodes, prompt chunk lengths) of each warm-up step
    execute = ModelRunner.execute

    def recording_execute(self, batch):
        shapes.append((len(batch.decodes), [len(c.token_ids) for c in batch.prefills]))
        return execute(self, batch)

    engine, runner = _engine(loaded, graphs)
    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    assert runner.warm_up(max_num_batched_tokens=16, max_num_decodes=4) > 0
    monkeypatch.undo()
    assert shapes == [(0, [1]), (0, [2]), (0, [4]), (0, [8]), (0, [16]), (4, [12])]
    # Its keys are left in blocks the requests then take: each writes before it reads.
    outputs = serve(engine, PROMPTS, 12)
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        assert output == greedy_alone(loaded, prompt, 12)
