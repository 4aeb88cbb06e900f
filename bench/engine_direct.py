"""Engine-direct mode: the same workload straight into an engine, no HTTP, Redis or SSE.

Compared with a run over HTTP on the same workload, it shows what the platform around the
engine costs. Arrivals are honoured open loop by wall clock, as the HTTP client does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from bench.client import RequestResult
from bench.workload import RequestSpec
from shared.protocol import QueuedRequest, SamplingParams
from worker.engine import Engine
from worker.sequence import Sequence


@dataclass(slots=True)
class EngineRun:
    results: list[RequestResult]
    duration_s: float
    kv_cache_usage: list[float] = field(default_factory=list)  # one sample per step
    num_steps: int = 0


def run_engine(
    engine: Engine, decoder, workload: list[RequestSpec], *, temperature: float = 0.0
) -> EngineRun:
    results = {spec.index: RequestResult(spec.index, True, None, 0.0) for spec in workload}
    pending = list(workload)
    run = EngineRun(list(results.values()), 0.0)
    start = time.perf_counter()
    num_done = 0
    while num_done < len(workload):
        now = time.perf_counter()
        while pending and start + pending[0].arrival_s <= now:
            spec = pending.pop(0)
            results[spec.index].start_s = now
            refused = engine.add(_sequence(spec, decoder, temperature))
            if refused is not None:
                num_done += _record(results[spec.index], refused, now)
        if not engine.has_work():
            if pending:
                time.sleep(max(0.0, start + pending[0].arrival_s - time.perf_counter()))
            continue
        outputs = engine.step()
        now = time.perf_counter()
        run.num_steps += 1
        if (usage := engine.stats().get("kv_cache_usage")) is not None:
            run.kv_cache_usage.append(usage)
        for output in outputs:
            num_done += _record(results[int(output.request_id)], output, now)
    run.duration_s = time.perf_counter() - start
    return run


def _sequence(spec: RequestSpec, decoder, temperature: float) -> Sequence:
    request = QueuedRequest(
        request_id=str(spec.index),
        tenant_id="bench",
        model="bench",
        deployment_id=0,
        kind="completion",
        prompt_token_ids=spec.prompt_token_ids,
        sampling=SamplingParams(
            max_tokens=spec.max_tokens, temperature=temperature, ignore_eos=True, seed=spec.index
        ),
        arrival_ts=time.time(),
    )
    return Sequence.from_request(request, decoder, frozenset())


def _record(result: RequestResult, output, now: float) -> int:
    """Note a step's output for a request; 1 when it finished."""
    if output.num_new_tokens:
        result.chunk_times_s.append(now)
    result.num_prompt_tokens = output.num_prompt_tokens
    result.num_output_tokens = output.num_output_tokens
    if not output.is_finished:
        return 0
    result.end_s = now
    if output.error is not None:
        result.is_ok, result.error = False, output.error.message
    return 1
