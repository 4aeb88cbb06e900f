"""Whole decode steps of one sequence (or `--batch` of them), taken in turns by different
paths through the same engine, in one process: where a host's memory changes its rate from
second to second (docs/benchmarks.md: 29 to 59 GB/s within a minute on an AMD EPYC host),
runs of the roofline a minute apart compare two memories as much as two builds; here each
round times every side back to back, in a rotating order, and the figures are per side over
the same rounds, with the plain read of the roofline's probe between them.

The sides (the real model, bf16, greedy):
- `lists`: the runner as it is: a decode-only step from the scheduler's lists into one C
  call that also reads the RoPE table and takes the argmax (`ModelRunner._decode_at`);
- `tensors`: the same C kernels called through tensors (`DecodeLayers.step`; the runner's
  path before session 34);
- `baseline` (with `--baseline`): the tensors' path with another build's kernels (its
  `decode_step`; a build of an earlier commit, made by a worktree of it as in
  `bench/few_rows_stream.py`).

    python -m bench.decode_sides --context 256 --rounds 20 --json bench/results/decode-sides-cpu.json
    python -m bench.decode_sides --baseline /tmp/base-kernels/*.so --json ...
    python -m bench.decode_sides --batch 4 --baseline /tmp/base-kernels/*.so --json ...

The sequence decodes on through the rounds (each side's steps add to its context), so the
context grows by `rounds x sides x steps` tokens over a run: every side sees the same
growth, a round apart at most.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import kernel_run, report, roofline
from shared import heap, model_source
from shared.protocol import QueuedRequest, SamplingParams
from worker.config import EngineConfig
from worker.model_engine import build_engine
from worker.runner import loader
from worker.sequence import Sequence


def _engine(source: str, context: int, max_tokens: int, batch: int = 1):
    """An engine decoding `batch` sequences of `context` prompt tokens each (the first
    returned: the others keep pace with it)."""
    resolved = model_source.resolve(source)
    loaded = loader.load(resolved, "auto", "bfloat16")
    decoder = model_source.load_tokenizer(resolved)
    heap.freeze_long_lived()  # as a worker does once its model is loaded
    engine = build_engine(
        loaded, EngineConfig(max_num_seqs=batch, max_num_batched_tokens=batch * max(256, context))
    )
    seqs = []
    for i in range(batch):
        request = QueuedRequest(
            request_id=f"sides-{i}", tenant_id="bench", model="bench", deployment_id=0,
            kind="completion",
            prompt_token_ids=[1000 + (i * 7 + j) % 19000 for j in range(context)],
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            arrival_ts=float(i),
        )  # fmt: skip
        seqs.append(Sequence.from_request(request, decoder, frozenset()))
        engine.add(seqs[-1])
    while any(seq.num_output_tokens == 0 for seq in seqs):
        engine.step()  # the prompts, in as many steps as the scheduler chunks them into
    return engine, seqs[0]


def measure(
    context: int,
    rounds: int,
    steps: int,
    baseline: str | None,
    source: str = model_source.DEFAULT_MODEL_ID,
    batch: int = 1,
) -> dict:
    names = ["lists", "tensors", *(["baseline"] if baseline else [])]
    max_tokens = rounds * len(names) * steps + 64
    engine, seq = _engine(source, context, max_tokens, batch)
    runner = engine._runner
    forward = runner._forward
    if forward is None or forward.decode_layers is None:
        raise RuntimeError("the decode layers need a C compiler and a CPU with AVX512-BF16")
    decode_layers = forward.decode_layers
    libraries = {"lists": decode_layers._library, "tensors": decode_layers._library}
    if baseline:
        libraries["baseline"] = kernel_run.with_signatures(baseline)
    decode_at = runner._decode_at

    def use(name: str) -> None:
        decode_layers._library = libraries[name]
        runner._decode_at = decode_at if name == "lists" else lambda decodes: None

    for name in names:  # warm-up: each side's first steps
        use(name)
        for _ in range(3):
            engine.step()
    probe = roofline.BandwidthProbe()
    times: dict[str, list[float]] = {name: [] for name in names}
    plain: list[float] = []
    start_tokens = seq.num_tokens
    for index in range(rounds):
        plain.append(probe.read())
        for name in names[index % len(names) :] + names[: index % len(names)]:
            use(name)
            started = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times[name].append((time.perf_counter() - started) / steps)
    use("lists")
    weight_bytes = sum(p.numel() * p.element_size() for p in runner._model.parameters())
    result: dict = {
        "batch": batch,
        "context_tokens": [start_tokens, seq.num_tokens],
        "rounds": rounds,
        "steps_per_round": steps,
        "weight_bytes": weight_bytes,
        "plain_read_gb_per_s": [probe.bytes / t / 1e9 for t in plain],
        "sides": {},
    }
    for name in names:
        result["sides"][name] = {
            "step_ms": [t * 1e3 for t in times[name]],
            "median_step_ms": statistics.median(times[name]) * 1e3,
            # the weights' bytes over the step, against the round's plain read
            "weights_of_plain_read_median": statistics.median(
                (weight_bytes / t) / (probe.bytes / p)
                for p, t in zip(plain, times[name], strict=True)
            ),
        }
    result["speedup_of_lists_median"] = {  # the other side's step time over `lists`'
        name: statistics.median(b / a for a, b in zip(times["lists"], times[name], strict=True))
        for name in names[1:]
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5, help="steps a side a round")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    parser.add_argument("--baseline", help="another build of the kernels (a .so)")
    parser.add_argument("--source", default=model_source.DEFAULT_MODEL_ID, help="the model")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    result = measure(args.context, args.rounds, args.steps, args.baseline, args.source, args.batch)
    first, last = result["context_tokens"]
    plain = result["plain_read_gb_per_s"]
    print(
        f"{args.batch} sequences, context {first}-{last} tokens, {args.rounds} rounds of "
        f"{args.steps} steps a side, plain read {min(plain):.0f}-{max(plain):.0f} GB/s (median {statistics.median(plain):.0f})"
    )
    for name, side in result["sides"].items():
        print(
            f"{name:9s} median step {side['median_step_ms']:6.2f} ms; the weights at "
            f"{side['weights_of_plain_read_median']:.2f} of the plain read (median of rounds)"
        )
    for name, value in result["speedup_of_lists_median"].items():
        print(f"{name} / lists step time, median of the rounds' ratios: {value:.3f}")
    if args.json:
        report.write_json(args.json, {**kernel_run.header(), "baseline": args.baseline, **result})


if __name__ == "__main__":
    main()
