"""Our own Llama-family forward (`worker/runner/llama.py`) gives `generate`'s tokens, token
for token, on models whose tokens depend on attention and positions, with chunked prefill,
decodes of different lengths in one step, and preemption."""

from __future__ import annotations

import pytest

from tests import tiny_model
from tests.factories import CharDecoder, make_request, make_sequence_for
from tests.reference import greedy_alone
from worker.engine import ContinuousBatchingEngine
from worker.fair_queue import FairQueue
from worker.kv_cache import KVCacheManager
from worker.preemption import TenantAwarePreemption
from worker.runner import llama
from worker.runner.llama import LlamaForward
from worker.runner.model_runner import ModelRunner
from worker.scheduler import Scheduler, SchedulerConfig


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-32d"])
def loaded(request):
    """Heads of 16 dimensions, or of 32 ("-32d"): the CPU's fused layer ops then run."""
    if request.param == "llama-32d":
        return tiny_model.attentive("llama", num_heads=2, num_kv_heads=1)
    return tiny_model.attentive(request.param)


def _engine(loaded, forward: str, num_blocks: int = 14, block_size: int = 4):
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        KVCacheManager(num_blocks, block_size, prefix_caching=True),
        FairQueue(quantum_tokens=8),
        TenantAwarePreemption(),
    )
    runner = ModelRunner(loaded, num_blocks, block_size, forward)
    return ContinuousBatchingEngine(scheduler, runner)


PROMPTS = [list(range(1000, 1030)), [7, 7, 7, 7, 7, 7], list(range(2000, 2045, 3)), [42]]


@pytest.mark.parametrize("forward", ["own", "hf"])
def test_greedy_equals_generate_alone(loaded, forward):
    engine = _engine(loaded, forward)
    assert (engine._runner._forward is not None) == (forward == "own")
    outputs = _serve_together(engine, PROMPTS, 12)
    assert engine.scheduler.num_preemptions > 0  # 14 blocks of 4: not all four at once
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        assert output == greedy_alone(loaded, prompt, 12)


def _serve_together(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """All prompts in one engine, a tenant each, to the end; their output tokens."""
    seqs = []
    for i, prompt in enumerate(prompts):
        request = make_request(i, prompt, max_tokens, tenant_id=f"t{i}")
        seq = make_sequence_for(request, CharDecoder())
        assert engine.add(seq) is None
        seqs.append(seq)
    while engine.has_work():
        engine.step()
    return [seq.output_token_ids for seq in seqs]


def test_the_tokens_depend_on_the_order_of_the_context(loaded):
    # Else the test above could not tell a wrong attention from a right one.
    assert greedy_alone(loaded, [1000, 2000, 3000, 4000], 6) != greedy_alone(
        loaded, [3000, 1000, 2000, 4000], 6
    )


def test_auto_picks_the_own_forward_for_the_llama_family(loaded, tiny_loaded):
    assert LlamaForward.supports(loaded.model)
    assert ModelRunner(tiny_loaded, 8, 4)._forward is not None
    assert ModelRunner(tiny_loaded, 8, 4, "hf")._forward is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_rope_table_is_the_rotary_modules_output_bit_for_bit(monkeypatch, dtype):
    """A row of the table is what HF's rotary module gives for that position alone, at the
    positions a step has, and a step past the table's end calls the module."""
    import torch

    loaded = tiny_model.attentive("llama")  # max_position_embeddings 2048
    loaded.model.to(getattr(torch, dtype))
    monkeypatch.setattr(llama, "ROPE_TABLE_POSITIONS", 1024)
    forward = LlamaForward(loaded.model)
    assert forward._rope_table is not None and forward._rope_table[0].shape[0] == 1024
    calls = []
    rotary = forward.rotary
    forward.rotary = lambda x, positions: calls.append(positions) or rotary(x, positions)
    for positions in ([0], [1023], [5, 900, 17, 1000, 3], list(range(300, 364))):
        at = torch.tensor(positions)
        expected_cos, expected_sin = rotary(forward.embed, at[None])
        cos, sin = forward._rope(at)
        assert torch.equal(cos, expected_cos[0]) and torch.equal(sin, expected_sin[0])
    assert calls == []  # all from the table
    past = torch.tensor([1000, 1024, 1500])
    cos, _ = forward._rope(past)
    assert len(calls) == 1 and torch.equal(cos, rotary(forward.embed, past[None])[0][0])


def test_no_rope_table_where_the_frequencies_follow_the_length():
    loaded = tiny_model.attentive("llama")
    loaded.model.model.rotary_emb.rope_type = "dynamic"
    assert LlamaForward(loaded.model)._rope_table is None


@pytest.fixture(scope="module")
def real_model_dirs(tmp_path_factory):
    """The default model as shipped (GGUF) and exported to a plain HF directory."""
    from bench.export_hf import export
    from shared import model_source

    exported = export(model_source.DEFAULT_MODEL_ID, tmp_path_factory.mktemp("smollm2-hf"))
    return {"gguf": model_source.DEFAULT_MODEL_ID, "hf-directory": str(exported)}


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["gguf", "hf-directory"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_model_greedy_equals_generate(real_model_dirs, weights, dtype):
    from shared import model_source
    from worker.runner import loader

    source = model_source.resolve(real_model_dirs[weights])
    loaded_model = loader.load(source, "cpu", dtype)
    tokenizer = model_source.load_tokenizer(source)
    engine = _engine(loaded_model, "auto", num_blocks=64, block_size=16)
    assert engine._runner._forward is not None
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at a temperature of",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ]
    prompts = [tokenizer.encode(text) for text in texts]
    outputs = _serve_together(engine, prompts, 16)
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output == greedy_alone(loaded_model, prompt, 16)
