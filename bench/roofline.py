"""Saturated decode against the memory-bandwidth roofline.

A decode step must read every weight once and every cached key and value of every sequence
once, so its floor is (weight bytes + KV bytes read) / memory bandwidth. This measures the
bandwidth (a large tensor reduction on the CPU, a device copy on a GPU), times steady decode steps of the continuous engine at
several batch sizes, and reports the fraction of the roofline each step reaches.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from shared.protocol import QueuedRequest, SamplingParams
from worker.config import EngineConfig
from worker.model_engine import build_engine
from worker.runner import host_memory
from worker.runner.loader import LoadedModel
from worker.runner.model_runner import kv_bytes_per_token
from worker.sequence import Sequence

BANDWIDTH_PROBE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class RooflinePoint:
    batch_size: int
    context_tokens: int
    step_s: float
    weight_bytes: int
    kv_bytes: int
    bandwidth_bytes_per_s: float

    @property
    def roofline_s(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / self.bandwidth_bytes_per_s

    @property
    def fraction_of_roofline(self) -> float:
        return self.roofline_s / self.step_s

    def as_dict(self) -> dict:
        return asdict(self) | {
            "roofline_s": self.roofline_s,
            "fraction_of_roofline": self.fraction_of_roofline,
            "tokens_per_s": self.batch_size / self.step_s,
        }


def measure_bandwidth(device: torch.device | None = None, num_repeats: int = 8) -> float:
    """Memory bandwidth in bytes/s. On the CPU, read bandwidth: summing a tensor far larger
    than any cache, the best of `num_repeats` passes (STREAM's convention: on a shared host
    the mean mixes in a neighbour's bursts; the best pass is what the memory can give, and
    the harder roofline to reach). On a GPU, copying one (each byte read once and written
    once, both counted), timed by CUDA events."""
    if device is not None and device.type == "cuda":
        return _device_copy_bandwidth(device, num_repeats)
    probe = BandwidthProbe()
    return probe.bytes / min(probe.read() for _ in range(num_repeats))


class BandwidthProbe:
    """The CPU's plain read: a tensor far larger than any cache, summed. `read()` is one
    pass's seconds."""

    def __init__(self, num_bytes: int = BANDWIDTH_PROBE_BYTES) -> None:
        self.bytes = num_bytes
        # in huge pages, as the weights are (worker/runner/host_memory.py)
        self._tensor = host_memory.zeros((num_bytes // 4,), torch.float32).fill_(1.0)
        self._tensor.sum()

    def read(self) -> float:
        start = time.perf_counter()
        self._tensor.sum()
        return time.perf_counter() - start


def _device_copy_bandwidth(device: torch.device, num_repeats: int) -> float:
    source = torch.ones(BANDWIDTH_PROBE_BYTES // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(num_repeats):
        target.copy_(source)
    end.record()
    end.synchronize()
    elapsed_s = start.elapsed_time(end) / 1e3
    return 2 * num_repeats * BANDWIDTH_PROBE_BYTES / elapsed_s


def measure_decode(
    loaded: LoadedModel,
    decoder,
    batch_size: int,
    context_tokens: int,
    bandwidth: float | None,
    forward: str = "auto",
    num_steps: int = 30,
    cuda_graphs: bool = True,
    probe_rounds: int = 3,
) -> RooflinePoint:
    """Steady decode steps at `batch_size` against the roofline at `bandwidth`. With
    `bandwidth` None (the CPU), the bandwidth is probed between the timed steps instead, in
    `probe_rounds` rounds of two passes, each before a run of the steps, and its best pass
    taken: a shared host's bandwidth moves from minute to minute (the probe read 47-81 GB/s
    in one session here), and a probe read once, seconds away from the steps, set them
    against another host's roofline."""
    config = EngineConfig(
        max_num_seqs=batch_size,
        max_num_batched_tokens=batch_size * context_tokens,
        forward=forward,
        cuda_graphs=cuda_graphs,
    )
    engine = build_engine(loaded, config)
    sequences = [_sequence(i, context_tokens, decoder) for i in range(batch_size)]
    for seq in sequences:
        engine.add(seq)
    while any(seq.num_output_tokens == 0 for seq in sequences):
        engine.step()  # the prompts, in as many steps as the scheduler chunks them into
    for _ in range(5):
        engine.step()  # warm-up decodes (a fresh engine's first steps pay first-use costs)
    rounds = 1 if bandwidth is not None else probe_rounds
    elapsed_s, probed = 0.0, 0.0
    for index in range(rounds):
        if bandwidth is None:
            probed = max(probed, measure_bandwidth(num_repeats=2))
        start = time.perf_counter()
        for _ in range(num_steps * (index + 1) // rounds - num_steps * index // rounds):
            engine.step()
        elapsed_s += time.perf_counter() - start
    step_s = elapsed_s / num_steps
    mean_context = context_tokens + 6 + num_steps / 2  # the first token, then 5 warm-up decodes
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    kv_bytes = int(batch_size * mean_context * kv_bytes_per_token(loaded))
    return RooflinePoint(
        batch_size, context_tokens, step_s, weight_bytes, kv_bytes, bandwidth or probed
    )


def _sequence(i: int, num_tokens: int, decoder) -> Sequence:
    request = QueuedRequest(
        request_id=str(i),
        tenant_id="roofline",
        model="roofline",
        deployment_id=0,
        kind="completion",
        prompt_token_ids=[1000 + (i * 7 + j) % 19000 for j in range(num_tokens)],
        sampling=SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),
        arrival_ts=float(i),
    )
    return Sequence.from_request(request, decoder, frozenset())
