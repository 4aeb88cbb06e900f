"""`python -m bench.kv_transfer`: the real model's KV for a prompt, prefilled, exported and
sent to another process, which acknowledges it once the blocks are in its pool."""

from __future__ import annotations

from bench import kv_transfer


def test_the_benchmark_moves_every_block_of_the_prompt_and_times_it():
    result = kv_transfer.measure(num_tokens=40, repeat=2, dtype="float32")
    layout = result["layout"]
    blocks = -(-40 // kv_transfer.BLOCK_SIZE)
    assert layout["dtype"] == "float32" and layout["num_layers"] == 30
    assert all(run["bytes"] == blocks * 2 * 30 * 3 * 16 * 64 * 4 for run in result["runs"])
    assert all(run["prefill_s"] > 0 and run["send_s"] > 0 for run in result["runs"])
    assert result["transfer_fraction_of_prefill"] > 0
