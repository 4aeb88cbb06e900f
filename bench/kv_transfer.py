"""The KV hand-off's cost against the prefill it follows (issue 22's target: a 2,048-token
sequence's KV moved in at most 10% of its prefill time on loopback).

One process prefills a prompt with the real model through the runner, in chunks of the
worker's default token budget, as a prefill worker would; it then exports the sequence's
blocks (`ModelRunner.export_kv`) and sends them over ZeroMQ on loopback (`worker/kv_link.py`)
to a second process, which puts them into a pool of the same layout (`kv_blocks.write_blocks`)
before it answers. Timed: the prefill, the export, and the send until the answer (the
transfer and the receiver's import). Each repeat uses fresh blocks.

    python -m bench.kv_transfer --tokens 2048 --repeat 5 --json bench/results/kv-transfer-cpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from shared import model_source
from shared.protocol import SamplingParams
from worker.config import EngineConfig
from worker.kv_link import KVReceiver, KVSender, KVTransfer
from worker.runner import loader
from worker.runner.kv_blocks import KVLayout, write_blocks
from worker.runner.model_runner import ModelRunner
from worker.step_batch import ChunkInput, StepBatch

BLOCK_SIZE = 16


def _receive(layout_dict: dict, num_blocks: int, count: int, endpoint_out) -> None:
    """The receiving worker: a pool of the sender's layout; `count` transfers into it."""
    layout = KVLayout.from_dict(layout_dict)
    shape = (layout.num_layers, layout.num_kv_heads, num_blocks, layout.block_size, layout.head_dim)
    k_pool = torch.zeros(shape, dtype=getattr(torch, layout.dtype))
    v_pool = torch.zeros_like(k_pool)
    receiver = KVReceiver("tcp://127.0.0.1:0")
    endpoint_out.send(receiver.endpoint)

    def accept(transfer: KVTransfer) -> None:
        blocks = list(range(transfer.header["num_blocks"]))
        write_blocks(
            k_pool, v_pool, blocks, KVLayout.from_dict(transfer.header["layout"]), transfer.payload
        )

    for _ in range(count):
        receiver.serve_one(60.0, accept)
    receiver.close()


def measure(num_tokens: int, repeat: int, dtype: str) -> dict:
    source = model_source.resolve(model_source.DEFAULT_MODEL_ID)
    loaded = loader.load(source, "cpu", dtype)
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    runner = ModelRunner(loaded, 2 * num_blocks, BLOCK_SIZE)
    budget = EngineConfig().max_num_batched_tokens
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    parent, child = multiprocessing.get_context("spawn").Pipe()
    receiver = multiprocessing.get_context("spawn").Process(
        target=_receive, args=(runner.kv_layout.as_dict(), num_blocks, repeat, child)
    )
    receiver.start()
    endpoint = parent.recv()
    sender = KVSender()
    runs = []
    for index in range(repeat):
        blocks = list(range((index % 2) * num_blocks, (index % 2 + 1) * num_blocks))
        prompt = [1000 + (index * 7919 + i) % 40000 for i in range(num_tokens)]
        started = time.perf_counter()
        for start in range(0, num_tokens, budget):
            end = min(start + budget, num_tokens)
            sampling = greedy if end == num_tokens else None
            runner.execute(
                StepBatch([], [ChunkInput("p", prompt[start:end], start, blocks, sampling)])
            )
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        payload = runner.export_kv(blocks)
        export_s = time.perf_counter() - started
        header = {"request_id": f"r{index}", "layout": runner.kv_layout.as_dict(),
                  "num_tokens": num_tokens, "num_blocks": num_blocks}  # fmt: skip
        started = time.perf_counter()
        sender.send(endpoint, header, payload, timeout_s=60.0)
        send_s = time.perf_counter() - started
        runs.append({"prefill_s": prefill_s, "export_s": export_s, "send_s": send_s,
                     "bytes": len(payload)})  # fmt: skip
    sender.close()
    receiver.join(timeout=60)
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    moved_s = medians["export_s"] + medians["send_s"]
    return {
        "created_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "arguments": {
            "tokens": num_tokens,
            "repeat": repeat,
            "dtype": dtype,
            "block_size": BLOCK_SIZE,
            "prefill_chunk_tokens": budget,
        },
        "layout": runner.kv_layout.as_dict(),
        "runs": runs,
        "median": medians,
        "transfer_fraction_of_prefill": moved_s / medians["prefill_s"],
        "throughput_gb_per_s": medians["bytes"] / medians["send_s"] / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args.tokens, args.repeat, args.dtype)
    median = result["median"]
    print(f"{args.tokens} tokens, {median['bytes'] / 1e6:.1f} MB of KV: prefill "
          f"{median['prefill_s'] * 1e3:.1f} ms, export {median['export_s'] * 1e3:.1f} ms, "
          f"send until acknowledged {median['send_s'] * 1e3:.1f} ms "
          f"({result['throughput_gb_per_s']:.2f} GB/s); moved in "
          f"{result['transfer_fraction_of_prefill']:.1%} of the prefill time (target <= 10%)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
