"""What `llmfleet bench --platform-load` (`bench/platform_load.py`) and `--pool-spike`
(`bench/pool_spike.py`) run, and their defaults: plain data, so that the command line shows
them without importing the runs."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shared.model_source import DEFAULT_MODEL_ID
from shared.settings import Settings

NUM_WARMUP_REQUESTS = 16  # to each echo worker, before the baseline is taken
DEFAULT_STREAM_IDLE_CHECK_S: float = Settings.model_fields["stream_idle_check_s"].default


@dataclass(frozen=True)
class LoadPlan:
    num_streams: int = 5000
    tokens_per_s: float = 0.25  # per stream
    # The streams' echo worker hands out tokens every `step_ms`, to the streams whose turn
    # it is (`worker/echo_engine.py`): spread over the period as a fleet's are, not all at once.
    step_ms: float = 20.0
    ramp_per_s: float = 100.0  # streams opened a second
    hold_s: float = 20.0  # all streams open together at least this long
    num_burst_requests: int = 5000
    burst_concurrency: int = 256
    # Each of the burst's lanes keeps its connection, as clients behind a pool or a load
    # balancer do: what a request costs the API, not what accepting a connection does.
    burst_keep_alive: bool = True
    burst_tokens_per_s: float = 200.0  # the burst's echo worker's steps a second
    num_client_processes: int = 2
    source: str = DEFAULT_MODEL_ID  # whose tokenizer the deployments use
    sample_interval_s: float = 2.0

    @property
    def max_tokens(self) -> int:
        """Each stream's length: through the whole ramp, then the hold."""
        return math.ceil(self.tokens_per_s * (self.num_streams / self.ramp_per_s + self.hold_s))

    @property
    def stream_s(self) -> float:
        return self.max_tokens / self.tokens_per_s

    @property
    def stream_idle_check_s(self) -> float:
        """The API's `LLMFLEET_STREAM_IDLE_CHECK_S` for the run: above the streams' period.
        A stream silent for it reads its journal (a dropped message, a dead worker), so
        streams slower than the default 1 s would each read their journal between every
        two tokens: a cost of the bench's slow rate, not of real streams (tens of tokens a
        second), which the run would otherwise count as the relay's."""
        return max(DEFAULT_STREAM_IDLE_CHECK_S, 2.0 / self.tokens_per_s)


@dataclass(frozen=True)
class SpikePlan:
    rate_per_s: float = 1.2  # each model's, before the spike (B's throughout)
    spike_factor: float = 5.0
    warmup_s: float = 40.0  # more than the pool's dwell: the shared worker may move at once
    spike_s: float = 60.0
    max_tokens: int = 40
    tokens_per_s: float = 20.0  # per sequence: a request takes max_tokens / this
    max_num_seqs: int = 8  # each worker: max_num_seqs * tokens_per_s / max_tokens req/s
    seed: int = 0
    # Each platform is run this many times (seeds `seed`, `seed + 1`, ...), and the figures
    # are taken over all of their spikes' requests together.
    repeats: int = 1
    source: str = DEFAULT_MODEL_ID  # whose tokenizer the models use

    @property
    def capacity_per_s(self) -> float:
        """Requests a second one worker completes."""
        return self.max_num_seqs * self.tokens_per_s / self.max_tokens


@dataclass(frozen=True)
class RampPlan:
    """`llmfleet bench --autoscale-ramp` (bench/autoscale_ramp.py): the policy `up` autoscales
    with, the ramp of requests (each `prompt_tokens` in, `max_tokens` out), the workers'
    places and how many `up` may run; "backed up" is `backed_up_waiting` requests waiting."""

    policy: str = "predictive"
    start_rate_per_s: float = 0.2
    peak_rate_per_s: float = 3.0
    ramp_s: float = 120.0
    hold_s: float = 90.0
    prompt_tokens: int = 48
    max_tokens: int = 96
    max_num_seqs: int = 32
    max_workers: int = 2
    worker_tokens_per_s: float | None = None
    backed_up_waiting: int = 8
    model: str = DEFAULT_MODEL_ID
