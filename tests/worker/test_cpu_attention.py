"""The CPU attention kernels (worker/runner/cpu_attention.py), decode and prompt, against the
torch paths they stand in for, and the torch paths taking over wherever a kernel cannot run."""

from __future__ import annotations

import pytest
import torch

from worker.runner import cpu_attention, paged_attention
from worker.runner.cpu_kernels import amx_matmuls_available
from worker.runner.paged_attention import PrefillSpan, StepMetadata, attend, decode_group, pool_rows

needs_kernel = pytest.mark.skipif(
    cpu_attention.load() is None, reason="no C compiler here: the kernel cannot be built"
)


def _case(dtype, *, heads, kv_heads, head_dim, block_size, lengths, num_blocks=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (1, kv_heads, num_blocks, block_size, head_dim)
    k_pool = torch.randn(shape, generator=generator).to(dtype)
    v_pool = torch.randn(shape, generator=generator).to(dtype)
    lengths = torch.tensor(lengths)
    max_blocks = -(-int(lengths.max()) // block_size)
    tables = torch.stack(
        [torch.randperm(num_blocks, generator=generator)[:max_blocks] for _ in lengths]
    )
    q = torch.randn(heads, len(lengths), head_dim, generator=generator).to(dtype)
    return q, k_pool, v_pool, decode_group(0, tables, lengths)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),
        (4, 4, 128, 16),
        (8, 2, 32, 8),
        (6, 1, 48, 5),
        # blocks of odd size (a pair of keys across two blocks), 16 queries a KV head, the
        # largest head
        (6, 2, 64, 5),
        (16, 1, 64, 16),
        (2, 1, 256, 16),
        # the values pass's query counts: 4 then the 2 left (6 a KV head), and 2 of 2 at a
        # head of 128
        (12, 2, 64, 16),
        (8, 4, 128, 16),
    ],
)
def test_the_kernel_attends_as_the_torch_path_does(dtype, heads, kv_heads, head_dim, block_size):
    # Rows of one key, a partial last block, whole blocks, and one much longer than the rest.
    lengths = [1, block_size - 1, 3 * block_size, 7 * block_size + 2, 40]
    q, k_pool, v_pool, group = _case(
        dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        lengths=lengths,
    )  # fmt: skip
    expected = paged_attention._decode(q, k_pool[0], v_pool[0], group, None)
    assert cpu_attention.supports(q, k_pool[0])
    got = cpu_attention.paged_decode(
        q.transpose(0, 1), k_pool[0], v_pool[0], group.tables, group.lengths, head_dim**-0.5
    )
    assert got.shape == expected.shape and got.dtype == dtype
    # fp32: the same sums in another order; bf16: the torch path rounds its scores to bf16
    # where the kernel keeps fp32 (and its weights, as the kernel does on CPUs with
    # AVX512-BF16), so they differ by a rounding step or two of the outputs (which are at
    # most a few units).
    tolerance = 1e-5 if dtype == torch.float32 else 2**-5
    assert (got.float() - expected.float()).abs().max().item() <= tolerance


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_of_very_different_lengths_each_attend_as_the_torch_path_does(dtype):
    """A batch the threads share out by keys (`units_of`): runs of whole items that end
    where the keys balance, not the item count, each asking for its next items ahead. One
    long row among many short ones puts the boundary mid-batch; every row's output must be
    its own, none left unwritten."""
    lengths = [700, *[1 + 13 * i % 90 for i in range(30)], 333, 2]
    q, k_pool, v_pool, group = _case(
        dtype, heads=9, kv_heads=3, head_dim=64, block_size=16, lengths=lengths, num_blocks=256,
    )  # fmt: skip
    expected = paged_attention._decode(q, k_pool[0], v_pool[0], group, None)
    got = cpu_attention.paged_decode(
        q.transpose(0, 1), k_pool[0], v_pool[0], group.tables, group.lengths, 64**-0.5
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2**-5
    assert (got.float() - expected.float()).abs().max().item() <= tolerance


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 1, 128, 16), (6, 2, 64, 5), (16, 1, 64, 16), (2, 1, 32, 8)],
)
@pytest.mark.parametrize(
    "lengths",
    [
        [262],  # the keys in parts, each a multiple of 16 long but the last
        [1000, 77],  # two rows: the short one's first parts empty
        [2000],  # more parts than threads
        [40],  # too few keys to split
    ],
)
def test_few_long_rows_split_their_keys_and_attend_as_the_torch_path_does(
    heads, kv_heads, head_dim, block_size, lengths
):
    """One or two sequences have too few (sequence, KV head) pairs to keep the threads busy:
    the bf16 kernel splits their keys in parts and merges the parts' softmaxes. The queries
    scaled up, so that a few keys take most of the weight and a merge that weighed the parts
    wrongly would show.

    Measured against the exact result (fp64 from the same bf16 inputs), not the torch path:
    with a softmax this sharp the torch path's scores, rounded to bf16, put it up to 2^-5
    from the exact result itself (at one thread, where the keys are not split, the kernel
    and the torch path were 0.033 apart while the kernel was within 0.009 of the exact
    result). The kernel keeps its scores in fp32: it must be nearer the exact result than
    the torch path, and within 2^-6 of it, however many threads split the keys."""
    q, k_pool, v_pool, group = _case(
        torch.bfloat16, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        block_size=block_size, lengths=lengths, num_blocks=512,
    )  # fmt: skip
    q = (q.float() * 3).to(torch.bfloat16)
    exact = paged_attention._decode(q.double(), k_pool[0].double(), v_pool[0].double(), group, None)
    torch_path = paged_attention._decode(q, k_pool[0], v_pool[0], group, None)
    got = cpu_attention.paged_decode(
        q.transpose(0, 1), k_pool[0], v_pool[0], group.tables, group.lengths, head_dim**-0.5
    )
    kernel_error = (got.double() - exact).abs().max().item()
    torch_error = (torch_path.double() - exact).abs().max().item()
    assert kernel_error <= min(torch_error, 2**-6)


@needs_kernel
def test_a_step_uses_the_kernel_for_decodes_and_the_result_does_not_move(monkeypatch):
    q, k_pool, v_pool, group = _case(
        torch.float32, heads=9, kv_heads=3, head_dim=64, block_size=16, lengths=[5, 70, 33]
    )
    step = StepMetadata(torch.zeros(0, dtype=torch.long), [group], [])
    calls = []
    kernel = cpu_attention.paged_decode
    monkeypatch.setattr(
        cpu_attention, "paged_decode", lambda *a: calls.append(1) or kernel(*a)
    )  # fmt: skip
    with_kernel = attend(q, k_pool[0], v_pool[0], step)
    assert calls  # the kernel took the decodes
    monkeypatch.setattr(cpu_attention, "supports", lambda *a: False)
    without = attend(q, k_pool[0], v_pool[0], step)
    assert len(calls) == 1
    assert torch.allclose(with_kernel, without, atol=1e-5)


def test_shapes_the_kernel_does_not_have_take_the_torch_path():
    q, k_pool, _, _ = _case(
        torch.float32, heads=4, kv_heads=2, head_dim=20, block_size=4, lengths=[3]
    )
    assert not cpu_attention.supports(q, k_pool[0])  # a head dimension not a multiple of 16
    assert not cpu_attention.supports(q.to(torch.float16), k_pool[0].to(torch.float16))


def test_without_a_compiler_or_when_turned_off_the_torch_path_runs(monkeypatch, tmp_path):
    q, k_pool, v_pool, group = _case(
        torch.float32, heads=9, kv_heads=3, head_dim=64, block_size=16, lengths=[5, 20]
    )
    step = StepMetadata(torch.zeros(0, dtype=torch.long), [group], [])
    expected = paged_attention._decode(q, k_pool[0], v_pool[0], group, None)
    monkeypatch.setenv("LLMFLEET_KERNEL_CACHE", str(tmp_path))  # nothing built there yet
    for env in ({"CC": str(tmp_path / "no-such-compiler")}, {"LLMFLEET_CPU_ATTENTION_KERNEL": "0"}):
        cpu_attention.load.cache_clear()
        try:
            with monkeypatch.context() as patch:
                for name, value in env.items():
                    patch.setenv(name, value)
                assert cpu_attention.load() is None
                assert not cpu_attention.supports(q, k_pool[0])
                assert torch.equal(attend(q, k_pool[0], v_pool[0], step), expected)
        finally:
            cpu_attention.load.cache_clear()


def _prefill_case(*, heads, kv_heads, head_dim, block_size, start, tokens, num_blocks=64, seed=0):
    """One sequence's chunk of `tokens` at `start`, its block table a shuffle of the pool."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, kv_heads, num_blocks, block_size, head_dim)
    k_pool = torch.randn(shape, generator=generator).to(torch.bfloat16)
    v_pool = torch.randn(shape, generator=generator).to(torch.bfloat16)
    end = start + tokens
    blocks = torch.randperm(num_blocks, generator=generator)[: -(-end // block_size)]
    q = torch.randn(heads, tokens, head_dim, generator=generator).to(torch.bfloat16)
    mask = None
    if start:  # as the runner's `_chunk_mask`
        mask = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None])[None, None]
    rows = pool_rows(blocks, kv_heads, num_blocks)
    span = PrefillSpan(0, tokens, rows, end, mask, blocks.to(torch.int32))
    return q, k_pool, v_pool, span


needs_prefill_kernel = pytest.mark.skipif(
    not cpu_attention.has_prefill_kernel(),
    reason="the prompt kernel needs a CPU with AVX512-BF16 and a C compiler",
)


@needs_prefill_kernel
@pytest.mark.parametrize(
    "amx",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.skipif(
                not amx_matmuls_available(), reason="AMX tiles: an Intel CPU with AMX-BF16"
            ),
        ),
    ],
)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 32, 8), (6, 1, 96, 5)],
)
@pytest.mark.parametrize(
    ("start", "tokens"),
    # one token; a chunk within a tile; one over a tile's edge after a partial block; a
    # whole prompt over many tiles; a later chunk over earlier keys
    [(0, 1), (0, 7), (3, 17), (0, 130), (150, 40)],
)
def test_the_prompt_kernel_attends_as_sdpa_does(
    monkeypatch, amx, heads, kv_heads, head_dim, block_size, start, tokens
):
    """In AMX tiles (`amx`) or with AVX512-BF16's dot products."""
    monkeypatch.setenv("LLMFLEET_CPU_AMX", "1" if amx else "0")
    q, k_pool, v_pool, span = _prefill_case(
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
        start=start, tokens=tokens,
    )  # fmt: skip
    expected = paged_attention._prefill(q, k_pool[0], v_pool[0], span, None)
    exact = paged_attention._prefill(q.float(), k_pool[0].float(), v_pool[0].float(), span, None)
    got = cpu_attention.paged_prefill(
        q.transpose(0, 1), k_pool[0], v_pool[0], span.table, start, head_dim**-0.5
    )
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # Both round the weights to bf16 before the values: within a rounding step or two of
    # outputs of at most a few units, of each other and of the same sums in fp32.
    assert (got.float() - expected.float()).abs().max().item() <= 2**-5
    assert (got.float() - exact).abs().max().item() <= 2**-5
    # causal: a query's output does not depend on the keys after it
    later = span.num_context - 1
    k_moved, v_moved = k_pool.clone(), v_pool.clone()
    block, offset = span.table[later // block_size].item(), later % block_size
    k_moved[0, :, block, offset] += 10
    v_moved[0, :, block, offset] += 10
    moved = cpu_attention.paged_prefill(
        q.transpose(0, 1), k_moved[0], v_moved[0], span.table, start, head_dim**-0.5
    )
    assert torch.equal(moved[:-1], got[:-1])
    assert not torch.equal(moved[-1], got[-1])


@needs_prefill_kernel
@pytest.mark.parametrize("amx", [False, True])
def test_a_steps_prompt_chunks_in_one_call_are_each_chunk_alone(monkeypatch, amx):
    """Every chunk of a step in one call (`paged_prefill_spans`, as `attend` takes them):
    chunks of their own sequences in one pool, of different lengths and starts, one after
    the other in the step's rows behind two decodes, and q read in place from a wider tensor
    (the forward's fused QKV output, rows 960 wide): each chunk's rows are `paged_prefill`'s
    of it alone, bit for bit, and the decodes' rows are left as they were."""
    if amx and not amx_matmuls_available():
        pytest.skip("AMX tiles: an Intel CPU with AMX-BF16")
    monkeypatch.setenv("LLMFLEET_CPU_AMX", "1" if amx else "0")
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 96
    generator = torch.Generator().manual_seed(3)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    k_pool = torch.randn(shape, generator=generator).to(torch.bfloat16)
    v_pool = torch.randn(shape, generator=generator).to(torch.bfloat16)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    chunks, row = [], 2  # (first row, length, start, table)
    for start, tokens in [(0, 1), (0, 37), (20, 16), (150, 70), (0, 130)]:
        table = torch.tensor([free.pop() for _ in range(-(-(start + tokens) // block_size))])
        chunks.append((row, tokens, start, table.to(torch.int32)))
        row += tokens
    qkv = torch.randn(row, 960, generator=generator).to(torch.bfloat16)
    q = qkv[:, : heads * head_dim].view(row, heads, head_dim)  # rows 960 apart
    out = torch.full((row, heads, head_dim), 7.0, dtype=torch.bfloat16)
    spans = cpu_attention.PromptSpans.of(chunks)
    cpu_attention.paged_prefill_spans(q, k_pool, v_pool, spans, out, head_dim**-0.5)
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))
    for first, tokens, start, table in chunks:
        alone = cpu_attention.paged_prefill(
            q[first : first + tokens], k_pool, v_pool, table, start, head_dim**-0.5
        )
        assert torch.equal(out[first : first + tokens], alone)


def _counted_prompt_step(monkeypatch):
    """A one-chunk prompt step, and the list that the prompt kernel's calls append to."""
    q, k_pool, v_pool, span = _prefill_case(
        heads=9, kv_heads=3, head_dim=64, block_size=16, start=20, tokens=30
    )
    calls = []
    kernel = cpu_attention.paged_prefill_spans
    monkeypatch.setattr(
        cpu_attention, "paged_prefill_spans", lambda *a: calls.append(1) or kernel(*a)
    )  # fmt: skip
    step = StepMetadata(torch.zeros(0, dtype=torch.long), [], [span])
    return q, k_pool, v_pool, span, step, calls


@needs_prefill_kernel
def test_a_step_uses_the_prompt_kernel_only_for_bf16_chunks_with_a_table(monkeypatch):
    monkeypatch.setattr(cpu_attention, "has_amx", lambda: False)
    q, k_pool, v_pool, span, step, calls = _counted_prompt_step(monkeypatch)
    with_kernel = attend(q, k_pool[0], v_pool[0], step)
    assert len(calls) == 1
    expected = paged_attention._prefill(q, k_pool[0], v_pool[0], span, None)
    assert (with_kernel.float() - expected.float()).abs().max().item() <= 2**-5
    # fp32, or a chunk without a table (a GPU's), takes SDPA
    attend(q.float(), k_pool[0].float(), v_pool[0].float(), step)
    span.table = None
    assert torch.equal(attend(q, k_pool[0], v_pool[0], step), expected)
    assert len(calls) == 1


@needs_kernel
def test_loading_the_kernel_leaves_the_process_float_modes_alone():
    """A library built with -ffast-math would turn on flush-to-zero for the whole process
    when loaded: a denormal such as the temperature 5e-324 would then read as 0."""
    assert cpu_attention.load() is not None
    tiny = float("5e-324")
    assert tiny * 1.0 > 0
    assert torch.tensor([tiny], dtype=torch.float64).mul(1.0).item() > 0


@needs_prefill_kernel
def test_on_a_cpu_with_amx_prompt_chunks_take_the_kernel_in_tiles_or_sdpa(monkeypatch):
    """There the kernel computes in AMX tiles, where they are on; with them off
    (`LLMFLEET_CPU_AMX=0`) SDPA, which multiplies in AMX tiles itself, is faster than the
    kernel's dot products."""
    q, k_pool, v_pool, span, step, calls = _counted_prompt_step(monkeypatch)
    monkeypatch.setattr(cpu_attention, "has_amx", lambda: True)
    monkeypatch.setenv("LLMFLEET_CPU_AMX", "0")
    expected = paged_attention._prefill(q, k_pool[0], v_pool[0], span, None)
    assert torch.equal(attend(q, k_pool[0], v_pool[0], step), expected) and not calls
    monkeypatch.delenv("LLMFLEET_CPU_AMX")
    attend(q, k_pool[0], v_pool[0], step)
    assert len(calls) == int(amx_matmuls_available())
    monkeypatch.setattr(cpu_attention, "has_amx", lambda: False)
    attend(q, k_pool[0], v_pool[0], step)
    assert len(calls) == 1 + int(amx_matmuls_available())
