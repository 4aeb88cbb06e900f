"""Engine-direct mode: the same workload straight into an engine, no HTTP, Redis or SSE.

Compared with a run over HTTP on the same workload, it shows what the platform around the
engine costs. Arrivals are honoured open loop by wall clock, as the HTTP client does (or by
a simulated clock: `bench/simulate.py`).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bench.client import RequestResult, progress_bar
from bench.workload import RequestSpec, TenantSpec
from shared.protocol import QueuedRequest, SamplingParams
from worker.engine import Engine
from worker.sequence import Sequence, SequenceOutput


@dataclass(slots=True)
class EngineRun:
    results: list[RequestResult]
    duration_s: float = 0.0
    kv_cache_usage: list[float] = field(default_factory=list)  # one sample per step
    kv_cache_waste: list[float] = field(default_factory=list)  # per step with blocks in use
    num_steps: int = 0


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


@dataclass
class _Driver:
    engine: Engine
    decoder: object
    pending: deque[RequestSpec]
    results: dict[int, RequestResult]
    run: EngineRun
    advance: Callable[[], None]
    temperature: float
    tenants: dict[str, TenantSpec]
    clock: WallClock
    max_concurrency: int | None = None
    start_s: float = 0.0
    num_in_flight: Counter[str] = field(default_factory=Counter)
    tenant_of: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.start_s = self.clock.now()

    def admit_arrived(self) -> None:
        """Hand the engine what has arrived; with `max_concurrency`, an arrived request
        waits for a slot and its `start_s` is taken once it holds one (as over HTTP)."""
        now = self.clock.now()
        while self.pending and self.start_s + self.pending[0].arrival_s <= now:
            if self.max_concurrency and self.num_in_flight.total() >= self.max_concurrency:
                return
            spec = self.pending.popleft()
            self.results[spec.index].start_s = now
            tenant = self.tenants.get(spec.tenant, TenantSpec(spec.tenant))
            if self.num_in_flight[tenant.name] == tenant.max_requests_in_flight:
                self.refuse(spec.index, "429 requests_in_flight_exceeded", now)
                continue
            self.num_in_flight[tenant.name] += 1
            self.tenant_of[spec.index] = tenant.name
            refused = self.engine.add(sequence_of(spec, tenant, self.decoder, self.temperature))
            if refused is not None:
                self.record(refused, now)

    def refuse(self, index: int, error: str, now: float) -> None:
        result = self.results[index]
        result.is_ok, result.error, result.end_s = False, error, now
        self.advance()

    def step_or_wait(self) -> None:
        if not self.engine.has_work():
            if self.pending:
                next_s = self.start_s + self.pending[0].arrival_s
                self.clock.sleep(next_s - self.clock.now())
            return
        outputs = self.engine.step()
        now = self.clock.now()
        self.run.num_steps += 1
        stats = self.engine.stats()
        if stats.kv_cache_usage is not None:
            self.run.kv_cache_usage.append(stats.kv_cache_usage)
        if stats.kv_cache_waste is not None:
            self.run.kv_cache_waste.append(stats.kv_cache_waste)
        for output in outputs:
            self.record(output, now)

    def record(self, output: SequenceOutput, now: float) -> None:
        result = self.results[int(output.request_id)]
        record_output(result, output, now)
        if output.is_finished:
            self.num_in_flight[self.tenant_of[result.index]] -= 1
            self.advance()


def record_output(result: RequestResult, output: SequenceOutput, now_s: float) -> None:
    """What one engine output tells of its request, at `now_s`."""
    if output.num_new_tokens:
        result.chunk_times_s.append(now_s)
    result.num_prompt_tokens = output.num_prompt_tokens
    result.num_output_tokens = output.num_output_tokens
    result.num_computed_tokens = output.num_computed_tokens
    if output.is_finished:
        result.end_s = now_s
        if output.error is not None:
            result.is_ok, result.error = False, output.error.message


def run_engine(
    engine: Engine,
    decoder,
    workload: list[RequestSpec],
    *,
    temperature: float = 0.0,
    show_progress: bool = True,
    tenants: Iterable[TenantSpec] = (),
    until_tenants_done: set[str] | None = None,
    clock=None,
    max_concurrency: int | None = None,
) -> EngineRun:
    """Run `workload` through `engine` until every request finished, or, with
    `until_tenants_done`, until those tenants' requests have (the rest are abandoned).
    `max_concurrency` caps the requests in flight, as the HTTP client's does."""
    results = {spec.index: RequestResult(spec.index, True, None, 0.0) for spec in workload}
    awaited = [
        results[spec.index]
        for spec in workload
        if until_tenants_done is None or spec.tenant in until_tenants_done
    ]
    run = EngineRun(list(results.values()))
    by_name = {tenant.name: tenant for tenant in tenants}
    clock = clock or WallClock()
    with progress_bar(len(workload), show_progress) as advance:
        driver = _Driver(
            engine,
            decoder,
            deque(workload),
            results,
            run,
            advance,
            temperature,
            by_name,
            clock,
            max_concurrency,
        )
        while not all(result.end_s for result in awaited):
            driver.admit_arrived()
            driver.step_or_wait()
    run.duration_s = clock.now() - driver.start_s
    return run


def sequence_of(
    spec: RequestSpec,
    tenant: TenantSpec,
    decoder,
    temperature: float = 0.0,
    arrival_ts: float | None = None,
) -> Sequence:
    request = QueuedRequest(
        request_id=str(spec.index),
        tenant_id=tenant.name,
        tier=tenant.tier,
        weight=tenant.weight,
        model="bench",
        deployment_id=0,
        kind="completion",
        prompt_token_ids=spec.prompt_token_ids,
        sampling=SamplingParams(
            max_tokens=spec.max_tokens, temperature=temperature, ignore_eos=True, seed=spec.index
        ),
        arrival_ts=time.time() if arrival_ts is None else arrival_ts,
    )
    return Sequence.from_request(request, decoder, frozenset())
