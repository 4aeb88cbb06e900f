"""`python -m bench.decode_attention`: decode attention from memory, layer after layer."""

from __future__ import annotations

import statistics

import pytest
import torch

from bench import decode_attention, kernel_run
from worker.runner import cpu_attention, cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="the CPU attention kernel needs a C compiler"
)


def test_each_step_times_every_layers_call_and_counts_its_keys_and_values():
    case = decode_attention.measure_case(rows=3, context=40, steps=2, layers=2)
    assert case["layers"] == 2 and len(case["attention_ms"]) == 2
    assert min(case["attention_ms"]) > 0
    # 3 sequences x 2 layers x 40 keys x 3 KV heads x 64 dims, keys and values, bf16
    assert case["kv_bytes"] == 3 * 2 * 40 * 3 * 64 * 2 * 2
    assert case["kv_gb_per_s"] == pytest.approx(
        case["kv_bytes"] / (case["median_attention_ms"] / 1e3) / 1e9
    )
    # GB/s, as named: a plain read of this machine is between 1 and 10,000 of them
    assert len(case["plain_read_gb_per_s"]) == 2
    assert all(1 < rate < 10_000 for rate in case["plain_read_gb_per_s"])


def test_fp32_pools_count_four_bytes_a_value_and_the_kernel_reads_them_as_fp32(monkeypatch):
    calls = []
    library = cpu_kernels.load()

    class Recording:
        def paged_decode(self, *args):
            calls.append(args)
            return library.paged_decode(*args)

    monkeypatch.setattr(cpu_kernels, "load", lambda: Recording())
    case = decode_attention.measure_case(rows=2, context=40, steps=1, layers=1, dtype=torch.float32)
    assert case["dtype"] == "float32"
    assert case["kv_bytes"] == 2 * 1 * 40 * 3 * 64 * 2 * 4
    assert calls and all(args[13] == 0 for args in calls)  # is_bf16: no


def test_a_failing_call_is_not_timed_as_a_fast_one(monkeypatch):
    """The kernel's status is checked: a call it refuses (-2: shapes it does not take) fails
    the case instead of timing nothing."""
    monkeypatch.setattr(decode_attention, "HEADS", 8)  # not a multiple of the 3 KV heads
    with pytest.raises(RuntimeError, match="paged_decode failed"):
        decode_attention.measure_case(rows=1, context=16, steps=1, layers=1)


def test_each_sequence_attends_to_blocks_of_its_own_holding_its_own_keys():
    """The bench's tables give no block to two sequences, and its pools hold distinct data:
    two sequences with the same query get different outputs from the kernel."""
    tables = decode_attention._tables(rows=4, blocks=3)
    owned = [set(row.tolist()) for row in tables]
    assert all(len(blocks) == 3 for blocks in owned)
    assert len(set().union(*owned)) == 4 * 3  # none shared
    keys, values = decode_attention._pools(1, 4 * 3)
    lengths = torch.full((4,), 40, dtype=torch.int32)
    q = torch.randn(1, decode_attention.HEADS, decode_attention.DIM).to(torch.bfloat16)
    out = cpu_attention.paged_decode(
        q.expand(4, -1, -1), keys[0], values[0], tables, lengths, 0.125
    )
    assert all(not torch.equal(out[0], out[r]) for r in range(1, 4))


def test_scattered_tables_give_each_sequence_blocks_of_its_own_out_of_order():
    """`--scattered`: every block of the pool is some sequence's, none two sequences', and a
    sequence's blocks are not one run (as a server's are once sequences have come and gone)."""
    tables = decode_attention._tables(rows=8, blocks=16, scattered=True)
    flat = tables.flatten().tolist()
    assert sorted(flat) == list(range(8 * 16))
    runs = [row.tolist() == list(range(row[0], row[0] + 16)) for row in tables]
    assert not any(runs)
    assert torch.equal(tables, decode_attention._tables(rows=8, blocks=16, scattered=True))


def test_a_baseline_build_takes_every_step_beside_this_one():
    """`--baseline`: both builds time every step (in turns), and the speedup is the median of
    the baseline's step time over this build's, step by step."""
    baseline = kernel_run.with_signatures(cpu_kernels.load()._name)  # this build, as a .so path
    case = decode_attention.measure_case(rows=2, context=40, steps=3, layers=2, baseline=baseline)
    assert len(case["attention_ms"]) == len(case["baseline"]["attention_ms"]) == 3
    ratios = [
        b / a for a, b in zip(case["attention_ms"], case["baseline"]["attention_ms"], strict=True)
    ]
    assert case["speedup_median"] == pytest.approx(statistics.median(ratios))
    assert case["baseline"]["kv_gb_per_s"] == pytest.approx(
        case["kv_bytes"] / (case["baseline"]["median_attention_ms"] / 1e3) / 1e9
    )
