"""The autoscaling policies (`control/scale_policy.py`) replayed on a request trace
(`bench/autoscale_traces.py`) with a virtual clock, against an oracle that knows the future
and a fleet fixed at the peak: `llmfleet autoscale simulate --trace FILE.csv`.

The model, a discrete-event simulation (stated here; not a measurement of a device):

- **A worker** has `num_places` places (64: `--max-num-seqs`) and a step-time model,
  `fixed_s + per_token_s x tokens in the step`. A request takes a place for its whole
  service: its prefill (one step of its prompt), then one decode step per further output
  token at the full-batch step time (`step.of(num_places)`: as if the batch were always
  full, which is what a busy worker sees). TTFT = time waiting for a place + the prefill.
  The default step model, `gpu`, is a large model on one GPU: 25 ms + 0.2 ms per token (a
  decode step of 64 sequences 37.8 ms, ~26 tokens/s per stream; a 1,155-token prompt
  256 ms). `flat` is bench/simulate.py's (10 ms + 10 us per token: this project's 135M
  model on a GPU).
- **The capacity** the policies are given (`worker_tokens_per_s`) is what the step model
  gives at a full batch on the trace's mix: places x mean tokens per request (prompt +
  output) / mean service time.
- **Requests** wait in one FIFO queue for a place on any serving worker (the one with the
  most free places: workers pull as places free). A worker holds only what it runs, so a
  parked worker has nothing unstarted to hand back.
- **Worker states**: `loading` (a cold start, `cold_start_s`), `standby` (loaded, serving
  nothing), `activating` (standby to serving, `warm_activation_s`), `ready` (serving),
  `parking` (ready to standby: finishes what it runs, takes nothing new), `stopping`
  (finishes what it runs, then is gone). Every one of them holds a GPU, so all count in
  the worker-hours, until the worker is gone.
- **Every `tick_s`** the policy gets the signals of the simulated fleet (the arrival rate
  over the last `rate_window_s`, as the real loop measures it) and the simulator applies
  its decision (`_Fleet.apply`): more serving takes parking workers back at once, then
  wakes standby ones, then counts on loading ones, then starts new ones cold; fewer
  serving parks the ready workers running least; fewer in all stops loading workers
  first (they are furthest from useful), then standby, then parking ones (after their
  work). A worker that finishes loading serves if fewer serve than wanted, else stands by.
- **At the start** the fleet is what the policy decides for the first minute's arrival
  rate (running requests by Little's law), already loaded: every policy starts warm.

Baselines: `oracle` knows the arrivals of every `oracle_window_s` window and wants serving,
at each time, the most any window from the previous one to a cold start ahead needs at the
target utilisation (so it starts each worker a cold start before it is needed, and stops it
once no window within a cold start needs it and the window that last did is over);
`fixed-peak` keeps the most any window needs from start to end.

Each request must start and finish exactly once (checked as it happens, and counted for
the report); a worker leaves only with nothing running. The metrics, the targets and the
plot: `bench/autoscale_report.py`.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

from bench.autoscale_traces import TraceRequest
from control.scale_policy import (
    PolicyParams,
    ScaleDecision,
    ScalePolicy,
    ScaleSignals,
    make_policy,
)

# A run ends when every request has finished; one still waiting this long after the last
# arrival means the policy serves nothing, and the run stops with an error.
MAX_DRAIN_S = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class StepTime:
    fixed_s: float
    per_token_s: float

    def of(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens


STEP_MODELS = {"gpu": StepTime(0.025, 0.0002), "flat": StepTime(0.010, 0.00001)}


@dataclass(frozen=True, slots=True)
class SimConfig:
    cold_start_s: float = 180.0
    warm_activation_s: float = 2.0
    slo_ttft_s: float = 2.0
    tick_s: float = 5.0
    rate_window_s: float = 10.0
    num_places: int = 64
    step: StepTime = STEP_MODELS["gpu"]
    oracle_window_s: float = 60.0
    surge_ratio: float = 2.0


class State(enum.Enum):
    LOADING = "loading"
    ACTIVATING = "activating"
    READY = "ready"
    STANDBY = "standby"
    PARKING = "parking"
    STOPPING = "stopping"


SERVING = (State.READY, State.ACTIVATING)
DRAINING = (State.PARKING, State.STOPPING)


@dataclass(slots=True)
class Worker:
    worker_id: int
    state: State
    since_s: float
    num_running: int = 0
    epoch: int = 0  # moves on every change of state: a timer of an older epoch is void


_num_running = attrgetter("num_running")


@dataclass(frozen=True, slots=True)
class Sample:
    """The fleet at one tick."""

    t_s: float
    demand_workers: float  # arrivals in tokens per second over one worker's capacity
    num_ready: int
    num_standby: int
    num_loading: int  # cold or activating
    num_draining: int
    num_waiting: int


@dataclass
class Run:
    policy: str
    ttft_s: list[float]
    arrival_s: list[float]
    worker_seconds: dict[str, float]
    max_num_waiting: int
    samples: list[Sample]
    num_started: list[int]
    num_finished: list[int]


def worker_tokens_per_s(requests: list[TraceRequest], config: SimConfig) -> float:
    """One worker's capacity at a full batch on this trace's mix of requests."""
    num_tokens = sum(r.num_tokens for r in requests)
    service_s = sum(_service_s(r, config) for r in requests)
    return config.num_places * num_tokens / service_s


def _prefill_s(r: TraceRequest, config: SimConfig) -> float:
    return config.step.of(r.prompt_tokens)


def _service_s(r: TraceRequest, config: SimConfig) -> float:
    decode_step_s = config.step.of(config.num_places)
    return _prefill_s(r, config) + max(0, r.output_tokens - 1) * decode_step_s


class _Fleet:
    """The workers and the queue; the simulator's event loop drives it."""

    def __init__(self, requests: list[TraceRequest], config: SimConfig) -> None:
        self.requests = requests
        self.config = config
        self.workers: list[Worker] = []
        self.queue: deque[int] = deque()
        # (at_s, seq, kind, worker id, payload): the worker's epoch for "loaded" and
        # "active", which a later change of state voids; the request for "finished".
        self.timers: list[tuple[float, int, str, int, int]] = []
        self.num_ready_wanted = 0
        self.ttft_s = [math.nan] * len(requests)
        self.num_started = [0] * len(requests)
        self.num_finished = [0] * len(requests)
        self.worker_seconds = {state.value: 0.0 for state in State}
        self.max_num_waiting = 0
        self.num_done = 0
        self._by_id: dict[int, Worker] = {}
        self._ready: list[Worker] | None = None  # the ready workers, until a state changes
        self._next_id = 0
        self._seq = 0

    def count(self, *states: State) -> int:
        return sum(w.state in states for w in self.workers)

    def schedule(self, at_s: float, kind: str, worker_id: int, payload: int) -> None:
        self._seq += 1
        heapq.heappush(self.timers, (at_s, self._seq, kind, worker_id, payload))

    def move(self, w: Worker, state: State, now_s: float) -> None:
        self.worker_seconds[w.state.value] += now_s - w.since_s
        w.state, w.since_s, w.epoch = state, now_s, w.epoch + 1
        self._ready = None

    def start(self, now_s: float, state: State = State.LOADING) -> None:
        w = Worker(self._next_id, state, now_s)
        self._next_id += 1
        self.workers.append(w)
        self._by_id[w.worker_id] = w
        self._ready = None
        if state == State.LOADING:
            self.schedule(now_s + self.config.cold_start_s, "loaded", w.worker_id, w.epoch)

    def remove(self, w: Worker, now_s: float) -> None:
        self.move(w, w.state, now_s)
        self.workers.remove(w)
        del self._by_id[w.worker_id]

    # The decision.

    def apply(self, decision: ScaleDecision, now_s: float) -> None:
        self.num_ready_wanted = num_ready = max(0, decision.num_ready)
        num_serving = self.count(*SERVING)
        if num_serving < num_ready:
            self._serve_more(num_ready - num_serving, now_s)
        elif num_serving > num_ready:
            self._serve_fewer(num_serving - num_ready, now_s)
        num_up = len(self.workers) - self.count(State.STOPPING)
        num_wanted = num_ready + max(0, decision.num_standby)
        for _ in range(num_wanted - num_up):
            self.start(now_s)
        if num_up > num_wanted:
            self._stop(num_up - num_wanted, now_s)
        self.dispatch(now_s)

    def _serve_more(self, n: int, now_s: float) -> None:
        parking = sorted(self._in(State.PARKING), key=lambda w: -w.num_running)
        for w in parking[:n]:
            self.move(w, State.READY, now_s)  # it still holds its KV pool
        for w in self._in(State.STANDBY)[: max(0, n - len(parking))]:
            self.move(w, State.ACTIVATING, now_s)
            self.schedule(now_s + self.config.warm_activation_s, "active", w.worker_id, w.epoch)
        # The rest come from loading workers as they load, or from new ones apply() starts.

    def _serve_fewer(self, n: int, now_s: float) -> None:
        activating = self._in(State.ACTIVATING)
        ready = sorted(self._in(State.READY), key=lambda w: w.num_running)
        for w in (activating + ready)[:n]:
            self.move(w, State.PARKING if w.num_running else State.STANDBY, now_s)

    def _stop(self, n: int, now_s: float) -> None:
        loading = sorted(self._in(State.LOADING), key=lambda w: -w.since_s)
        for w in (loading + self._in(State.STANDBY) + self._in(State.PARKING))[:n]:
            if w.num_running:
                self.move(w, State.STOPPING, now_s)
            else:
                self.remove(w, now_s)

    def _in(self, state: State) -> list[Worker]:
        return [w for w in self.workers if w.state == state]

    # The events.

    def on_timer(self, kind: str, worker_id: int, payload: int, now_s: float) -> None:
        w = self._by_id.get(worker_id)
        if kind == "finished":
            assert w is not None, "a worker left with a request running"
            self._finish(w, payload, now_s)
        elif w is None or w.epoch != payload:
            return  # stopped, or moved on since
        elif kind == "loaded":
            serve = self.count(*SERVING) < self.num_ready_wanted
            self.move(w, State.READY if serve else State.STANDBY, now_s)
        elif kind == "active":
            self.move(w, State.READY, now_s)
        self.dispatch(now_s)

    def _finish(self, w: Worker, index: int, now_s: float) -> None:
        assert self.num_finished[index] == 0, f"request {index} finished twice"
        self.num_finished[index] += 1
        self.num_done += 1
        w.num_running -= 1
        if w.num_running == 0 and w.state == State.PARKING:
            self.move(w, State.STANDBY, now_s)
        elif w.num_running == 0 and w.state == State.STOPPING:
            self.remove(w, now_s)

    def arrive(self, index: int, now_s: float) -> None:
        self.queue.append(index)
        self.dispatch(now_s)

    def dispatch(self, now_s: float) -> None:
        """Each waiting request to the ready worker with the most free places, in turn."""
        places = self.config.num_places
        if self._ready is None:
            self._ready = self._in(State.READY)
        while self.queue:
            free = [w for w in self._ready if w.num_running < places]
            if not free:
                break
            if len(self.queue) == 1:  # the common case, an arrival: the first of the least busy
                self._begin(self.queue.popleft(), min(free, key=_num_running), now_s)
                break
            for w in sorted(free, key=_num_running):
                if not self.queue or w.num_running >= places:
                    break
                self._begin(self.queue.popleft(), w, now_s)
        self.max_num_waiting = max(self.max_num_waiting, len(self.queue))

    def _begin(self, index: int, w: Worker, now_s: float) -> None:
        r = self.requests[index]
        assert self.num_started[index] == 0, f"request {index} started twice"
        self.num_started[index] += 1
        self.ttft_s[index] = now_s - r.arrival_s + _prefill_s(r, self.config)
        w.num_running += 1
        self.schedule(now_s + _service_s(r, self.config), "finished", w.worker_id, index)

    def close(self, now_s: float) -> None:
        for w in self.workers:
            self.move(w, w.state, now_s)

    def sample(self, now_s: float, demand_workers: float) -> Sample:
        return Sample(
            now_s,
            demand_workers,
            self.count(State.READY),
            self.count(State.STANDBY),
            self.count(State.LOADING, State.ACTIVATING),
            self.count(*DRAINING),
            len(self.queue),
        )


class _Arrivals:
    """The arrivals of the last `window_s`, as the real loop reads its rate."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._seen: deque[tuple[float, int]] = deque()
        self._num_tokens = 0

    def add(self, at_s: float, num_tokens: int) -> None:
        self._seen.append((at_s, num_tokens))
        self._num_tokens += num_tokens

    def rates(self, now_s: float) -> tuple[float, float]:
        while self._seen and self._seen[0][0] <= now_s - self.window_s:
            self._num_tokens -= self._seen.popleft()[1]
        span_s = min(self.window_s, now_s) or self.window_s
        return len(self._seen) / span_s, self._num_tokens / span_s


def simulate(
    requests: list[TraceRequest], policy: ScalePolicy, config: SimConfig, capacity: float
) -> Run:
    """Replay `requests` under `policy`, workers of `capacity` tokens/s at a full batch."""
    fleet = _Fleet(requests, config)
    arrivals = _Arrivals(config.rate_window_s)
    samples = [_start_warm(fleet, policy, capacity)]
    next_tick_s, i, now_s = config.tick_s, 0, 0.0
    give_up_s = (requests[-1].arrival_s if requests else 0.0) + MAX_DRAIN_S
    while fleet.num_done < len(requests):
        if now_s > give_up_s:
            raise RuntimeError(f"{policy.name}: {len(requests) - fleet.num_done} requests unserved")
        at_arrival = requests[i].arrival_s if i < len(requests) else math.inf
        at_timer = fleet.timers[0][0] if fleet.timers else math.inf
        now_s = min(at_arrival, at_timer, next_tick_s)
        if at_timer == now_s:
            _, _, kind, worker_id, payload = heapq.heappop(fleet.timers)
            fleet.on_timer(kind, worker_id, payload, now_s)
        elif at_arrival == now_s:
            arrivals.add(now_s, requests[i].num_tokens)
            fleet.arrive(i, now_s)
            i += 1
        else:
            samples.append(_tick(fleet, policy, arrivals, capacity, now_s))
            next_tick_s += config.tick_s
    fleet.close(now_s)
    return Run(
        policy.name,
        fleet.ttft_s,
        [r.arrival_s for r in requests],
        fleet.worker_seconds,
        fleet.max_num_waiting,
        samples,
        fleet.num_started,
        fleet.num_finished,
    )


def _signals(
    fleet: _Fleet,
    now_s: float,
    rates: tuple[float, float],
    capacity: float,
    num_running: int | None = None,
) -> ScaleSignals:
    if num_running is None:
        num_running = sum(w.num_running for w in fleet.workers)
    return ScaleSignals(
        now_s=now_s,
        arrival_rate_per_s=rates[0],
        arrival_tokens_per_s=rates[1],
        num_waiting=len(fleet.queue),
        num_running=num_running,
        worker_tokens_per_s=capacity,
        num_ready=fleet.count(State.READY),
        num_standby=fleet.count(State.STANDBY),
        num_loading=fleet.count(State.LOADING, State.ACTIVATING),
        num_draining=fleet.count(*DRAINING),
    )


def _tick(
    fleet: _Fleet, policy: ScalePolicy, arrivals: _Arrivals, capacity: float, now_s: float
) -> Sample:
    rates = arrivals.rates(now_s)
    fleet.apply(policy.decide(_signals(fleet, now_s, rates, capacity)), now_s)
    return fleet.sample(now_s, rates[1] / capacity)


def _start_warm(fleet: _Fleet, policy: ScalePolicy, capacity: float) -> Sample:
    """The fleet the policy wants for the first minute's rate, as if it had run at it."""
    first = [r for r in fleet.requests if r.arrival_s < 60.0]
    rates = (len(first) / 60.0, sum(r.num_tokens for r in first) / 60.0)
    num_running = round(sum(_service_s(r, fleet.config) for r in first) / 60.0)  # Little
    decision = policy.decide(_signals(fleet, 0.0, rates, capacity, num_running))
    for _ in range(max(0, decision.num_ready)):
        fleet.start(0.0, State.READY)
    for _ in range(max(0, decision.num_standby)):
        fleet.start(0.0, State.STANDBY)
    fleet.num_ready_wanted = decision.num_ready
    return fleet.sample(0.0, rates[1] / capacity)


# The baselines: policies that read the trace instead of the signals.


def window_needs(
    requests: list[TraceRequest], params: PolicyParams, config: SimConfig, capacity: float
) -> list[int]:
    """Workers each `oracle_window_s` window's arrivals need at the target utilisation."""
    window_s = config.oracle_window_s
    num_windows = int(requests[-1].arrival_s // window_s) + 1 if requests else 1
    num_tokens = [0] * num_windows
    for r in requests:
        num_tokens[int(r.arrival_s // window_s)] += r.num_tokens
    per_worker = capacity * params.target_utilisation * window_s
    return [
        min(max(math.ceil(n / per_worker), params.min_workers), params.max_workers)
        for n in num_tokens
    ]


class OraclePolicy:
    """Knows every window's arrivals: wants serving the most any window from the last one to
    a cold start (plus a tick) ahead needs, so each worker is started a cold start before it
    is needed and stopped once no window within a cold start needs it. No standby."""

    name = "oracle"

    def __init__(self, needs: list[int], config: SimConfig) -> None:
        self._needs = needs
        self._config = config

    def decide(self, signals: ScaleSignals) -> ScaleDecision:
        window_s = self._config.oracle_window_s
        lookahead_s = self._config.cold_start_s + self._config.tick_s
        # From the window before this one: a window's mean understates its first seconds on
        # a falling edge, so a worker stays until the window after the last that needs it.
        first = max(0, min(int(signals.now_s // window_s), len(self._needs)) - 1)
        last = int((signals.now_s + lookahead_s) // window_s)
        return ScaleDecision(max(self._needs[first : last + 1]), 0)


class FixedPeakPolicy:
    """Provisioned for the busiest window, from start to end."""

    name = "fixed-peak"

    def __init__(self, needs: list[int]) -> None:
        self._num_ready = max(needs)

    def decide(self, signals: ScaleSignals) -> ScaleDecision:
        return ScaleDecision(self._num_ready, 0)


def make(name: str, needs: list[int], params: PolicyParams, config: SimConfig) -> ScalePolicy:
    """A policy by name: `oracle`, `fixed-peak` or one of `control.scale_policy`."""
    if name == "oracle":
        return OraclePolicy(needs, config)
    if name == "fixed-peak":
        return FixedPeakPolicy(needs)
    return make_policy(name, params)
