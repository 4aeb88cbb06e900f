"""Scenario runs: the workload through a stand-in for the tenants' Redis streams and the
workers' own intake rule into one or more in-process engines, each on a clock of its own.

What a worker sees decides what its fair queue can do, so a scenario run must not hand an
engine every request at once: a worker takes from the streams only what `plan_pull`
(`worker/intake.py`) lets it take, here as in `llmfleet worker`. Requests arrive on their
tenant's queue in the `Broker` at their arrival time, and each worker pulls before each of
its steps.

Each worker has its own clock, as each has its own device. A simulated engine
(`bench/simulate.py`) advances its clock by the step-cost model; a real one by the measured
wall time of its step, so several real engines in one process still run "side by side"
(on this machine their steps take turns on the CPU, and each is timed alone). The worker
whose clock is earliest acts next, so nothing sees the future. With pool-wide fairness the
workers share `PoolCounters`, synced once per step with one step of lag, as workers sync
through Redis (`worker/pool_service.py`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from bench.client import RequestResult
from bench.engine_direct import record_output, sequence_of
from bench.scenarios import WARMUP_TENANT, warmup_workload
from bench.simulate import VirtualClock
from bench.workload import RequestSpec, TenantSpec
from worker.engine import Engine
from worker.intake import plan_pull
from worker.pool_service import merge_service
from worker.sequence import Sequence, SequenceOutput
from worker.tenant_counters import ServiceUpdates

MIN_STEP_S = 1e-4  # a step that computed nothing still moves its worker's clock


@dataclass
class PoolCounters:
    """The pool's tenant service counters, in memory, merged as the Redis script merges them."""

    counters: dict[str, float] = field(default_factory=dict)

    def sync(self, updates: ServiceUpdates) -> dict[str, float]:
        merge_service(self.counters, updates)
        return dict(self.counters)


class Broker:
    """The model's tenant streams: arrived requests per tenant, oldest first. Like the
    Redis set of a model's tenants, a tenant stays listed once it has sent anything."""

    def __init__(self) -> None:
        self._streams: dict[str, deque[Sequence]] = {}

    @property
    def tenants(self) -> list[str]:
        return sorted(self._streams)

    def put(self, seq: Sequence) -> None:
        self._streams.setdefault(seq.tenant_id, deque()).append(seq)

    def take(self, plan: dict[str, int]) -> list[Sequence]:
        """Up to `plan[tenant]` of each tenant's oldest requests."""
        taken = []
        for tenant, count in plan.items():
            stream = self._streams[tenant]
            taken += [stream.popleft() for _ in range(min(count, len(stream)))]
        return taken


@dataclass
class ScenarioWorker:
    """One worker of a run: its engine, its clock, its intake and its share of the pool."""

    engine: Engine
    clock: VirtualClock
    is_measured: bool  # a real engine: its clock advances by the measured step time
    is_fair: bool = True
    preferred: frozenset[str] = frozenset()  # the worker's tenant affinity
    _counters: dict[str, float] | None = None

    @property
    def now_s(self) -> float:
        return self.clock.now()

    def pull(self, broker: Broker) -> list[Sequence]:
        """Take what the worker's intake would (`worker.intake.Intake.pull`, by
        `plan_pull`): idle, its room from every stream; busy, the preferred tenants' share
        of its room first, then the others'."""
        tenants = broker.tenants
        room = self.engine.num_free_slots()
        groups = [[t for t in tenants if t in self.preferred]]
        groups.append([t for t in tenants if t not in self.preferred])
        if not self.engine.has_work():
            groups = [tenants]  # idle: room for everyone
        taken: list[Sequence] = []
        for group in groups:
            num_taken = Counter(seq.tenant_id for seq in taken)
            num_free = max(0, room - sum(n for t, n in num_taken.items() if t not in group))
            plan = plan_pull(
                num_free, group, self.engine, is_fair=self.is_fair, num_taken=num_taken
            )
            taken += broker.take(plan)
        return taken

    def step(self, pool: PoolCounters | None) -> list[SequenceOutput]:
        """One engine step; the pool's counters as of its start are applied at its end."""
        updates = self.engine.take_service_updates()
        counters = pool.sync(updates) if pool is not None else None
        started_s, started = self.now_s, time.perf_counter()
        outputs = self.engine.step()
        if self.is_measured:
            self.clock.sleep(time.perf_counter() - started)
        if self.now_s == started_s:
            self.clock.sleep(MIN_STEP_S)
        if counters is not None:
            self.engine.apply_pool_service(counters)
        return outputs


@dataclass
class _Run:
    workers: list[ScenarioWorker]
    decoder: object
    pending: deque[RequestSpec]
    tenants: dict[str, TenantSpec]
    pool: PoolCounters | None
    start_s: float
    results: dict[int, RequestResult] = field(default_factory=dict)
    broker: Broker = field(default_factory=Broker)
    num_in_flight: Counter[str] = field(default_factory=Counter)
    tenant_of: dict[str, str] = field(default_factory=dict)  # request id -> tenant

    def act(self) -> None:
        """The earliest worker's next move: see what arrived, pull, then step or idle."""
        worker = min(self.workers, key=lambda w: w.now_s)
        if worker.now_s == math.inf:
            raise RuntimeError("requests are unfinished but no worker has anything to do")
        self.deliver(until_s=worker.now_s)
        for seq in worker.pull(self.broker):
            if (refused := worker.engine.add(seq)) is not None:
                self.record(refused, worker.now_s)
        if worker.engine.has_work():
            outputs = worker.step(self.pool)
            for output in outputs:
                self.record(output, worker.now_s)
        elif self.pending:
            worker.clock.now_s = max(worker.now_s, self.start_s + self.pending[0].arrival_s)
        else:
            worker.clock.now_s = math.inf  # nothing left to arrive

    def deliver(self, until_s: float) -> None:
        """Requests that have arrived by `until_s` join their tenant's queue; a tenant's
        request over its in-flight limit is refused, as the API's 429 would."""
        while self.pending and self.start_s + self.pending[0].arrival_s <= until_s:
            spec = self.pending.popleft()
            arrival_s = self.start_s + spec.arrival_s
            result = self.results[spec.index]
            result.start_s = result.accepted_s = arrival_s
            tenant = self.tenants.get(spec.tenant, TenantSpec(spec.tenant))
            if self.num_in_flight[tenant.name] == tenant.max_requests_in_flight:
                result.is_ok, result.error = False, "429 requests_in_flight_exceeded"
                result.end_s = arrival_s
                continue
            self.num_in_flight[tenant.name] += 1
            self.broker.put(sequence_of(spec, tenant, self.decoder, arrival_ts=arrival_s))

    def record(self, output: SequenceOutput, now_s: float) -> None:
        record_output(self.results[int(output.request_id)], output, now_s)
        if output.is_finished:
            self.num_in_flight[self.tenant_of[output.request_id]] -= 1


def run_workers(
    workers: list[ScenarioWorker],
    decoder,
    workload: list[RequestSpec],
    *,
    tenants: Iterable[TenantSpec] = (),
    until_tenants_done: set[str] | None = None,
    pool: PoolCounters | None = None,
) -> tuple[list[RequestResult], float]:
    """Run `workload` on `workers` until every request finished or, with
    `until_tenants_done`, until those tenants' have (the rest are abandoned); the results
    in index order and the run's duration on the workers' clocks."""
    start_s = max(worker.now_s for worker in workers)
    for worker in workers:
        worker.clock.now_s = start_s
    run = _Run(workers, decoder, deque(workload), {t.name: t for t in tenants}, pool, start_s)
    run.results = {s.index: RequestResult(s.index, True, None, 0.0) for s in workload}
    run.tenant_of = {str(s.index): s.tenant for s in workload}
    awaited = [
        run.results[s.index]
        for s in workload
        if until_tenants_done is None or s.tenant in until_tenants_done
    ]
    while not all(result.end_s for result in awaited):
        run.act()
    end_s = max((r.end_s for r in run.results.values() if r.end_s), default=start_s)
    return sorted(run.results.values(), key=lambda r: r.index), end_s - start_s


def run_plan(plan, base, make_engine, decoder, *, on_run=None):
    """Every run of a scenario plan (`bench/scenarios.py`), each on fresh workers with
    engines from `make_engine(config) -> (engine, clock or None: a real engine)`; the
    results and durations by label."""
    runs, durations = {}, {}
    for planned in plan.runs:
        if on_run is not None:
            on_run(planned.label)
        config = dataclasses.replace(base, queueing=planned.queueing, **planned.engine)
        workers = [
            _worker(make_engine(config), planned, index) for index in range(planned.num_workers)
        ]
        if workers[0].is_measured:  # a real engine: warm it up as the full stack does
            warmup = [TenantSpec(WARMUP_TENANT)]
            run_workers(workers[:1], decoder, warmup_workload(), tenants=warmup)
        pool = PoolCounters() if planned.fairness_scope == "pool" else None
        runs[planned.label], durations[planned.label] = run_workers(
            workers,
            decoder,
            plan.workloads[planned.workload],
            tenants=planned.tenants or plan.tenants,
            until_tenants_done=plan.until_tenants_done,
            pool=pool,
        )
    return runs, durations


def _worker(made: tuple[Engine, VirtualClock | None], planned, index: int) -> ScenarioWorker:
    engine, clock = made
    affinity = planned.affinity[index % len(planned.affinity)] if planned.affinity else ()
    return ScenarioWorker(
        engine,
        clock or VirtualClock(),
        is_measured=clock is None,
        is_fair=planned.queueing == "fair",
        preferred=frozenset(affinity),
    )
