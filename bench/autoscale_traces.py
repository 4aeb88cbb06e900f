"""Request traces for the autoscaling simulator (`bench/autoscale_sim.py`): the file format,
and a seeded generator of the shapes in `bench/traces/`
(`llmfleet autoscale trace --kind KIND --seed N --out FILE.csv`).

A trace is a CSV file with the header `arrival_s,prompt_tokens,output_tokens` and one row
per request, in arrival order (seconds from the trace's start); gzipped when its name ends
in `.gz`.

**Token counts** follow the Azure LLM inference trace 2023, conversation service
(github.com/Azure/AzurePublicDataset, `data/AzureLLMInferenceTrace_conv.csv`, CC-BY; the
trace of Patel et al., "Splitwise: efficient generative LLM inference using phase
splitting", ISCA 2024). Its 19,366 requests (one hour on 2023-11-16) have prompts of median
1,020 tokens (mean 1,155, p90 2,734, p99 4,142) and outputs of median 129 (mean 211, p90
424, p99 601), the medians Splitwise reports for the conversation trace. The generator
draws prompt and output independently (their correlation in the trace is -0.11) from
piecewise-linear inverse CDFs through the trace's quantiles below (computed from the
released file): a request has 1,366 tokens of work on average.

**Arrivals** are a Poisson process whose rate follows the shape (drawn by thinning). The
rates of the short traces are chosen so that each needs a small GPU fleet under the
simulator's default worker (`gpu` step model, 64 places: ~7.8 requests a second at a full
batch on this mix, 6.2 at 80% utilisation), and each file stays under ~1.2 MB:

- `spike`: 15 req/s for 10 min (3 workers), then 5x (75 req/s, 13 workers) reached
  linearly within 60 s, held 10 min, back to 15 within 60 s, 8 min more: 30 min.
- `diurnal`: one day's shape compressed into an hour: a sinusoid of mean 20 req/s from
  trough to peak (30 min) and back, peak/trough 2.3. The ratio is read off the published
  week of the Azure LLM inference trace 2024 (conversation; the per-minute plot of
  `analysis/AzureLLMInferenceDataset2024.ipynb`: weekday troughs near 2,200 and peaks near
  5,000 invocations a minute). Compressing 24 h into 1 h makes the slopes 24x steeper than
  a real day's: harder than a real diurnal cycle, not easier.
- `ramp`: 10 req/s for 10 min, a linear ramp to 40 req/s (4x) over 20 min, 10 min held.
- `flash`: 15 req/s for 40 min with four flash crowds, one in each 10-minute slot at a
  seeded time: the rate rises by a seeded 2-4x within 10 s and decays back exponentially
  (seeded time constant 60-180 s). No public trace we found publishes flash-crowd
  statistics for LLM serving; these magnitudes are an assumption.
- `spike-day`: a whole day (t = 0 is midnight) of the diurnal shape at its real pace, peak /
  trough 2.3, lowest at 04:00 and highest at 16:00 (a business service's day; the Azure
  week has weekday troughs at night and peaks in the working day), mean 46 req/s: 28 at
  04:00 (5 workers), 64 at 16:00. At 14:00, 62 req/s (10 workers at 80%), one flash event
  (a launch, a mention in the news) multiplies it by 5 within 60 s, holds 20 minutes and
  goes within 60 s: 308 req/s, 50 workers. Early afternoon of a working day, on a base near
  the day's peak, so the largest jump in workers the day's traffic makes plausible. 4.3
  million requests (27 MB gzipped): it is not shipped, the command makes it
  (docs/benchmarks.md); `bench/traces/spike-day-sample.csv.gz` is its window 13:50-14:10.
"""

from __future__ import annotations

import bisect
import csv
import gzip
import io
import math
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import IO

HEADER = ("arrival_s", "prompt_tokens", "output_tokens")
KINDS = ("spike", "diurnal", "ramp", "flash", "spike-day")

# spike-day: a day of the diurnal shape, trough at 04:00, and one 5x spike at 14:00.
DAY_S = 86400.0
DAY_MEAN_PER_S = 46.0  # 62 req/s at 14:00: 10 workers at 80% before the spike, 50 in it
DAY_TROUGH_AT_S = 4 * 3600.0
DAY_SPIKE_AT_S = 14 * 3600.0
DAY_SPIKE_HELD_S = 1200.0

# Quantiles (percent) of the Azure 2023 conversation trace, and the token counts at each.
QUANTILES = (0, 1, 5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 95, 99, 99.5, 99.9, 100)
PROMPT_TOKENS_AT = (
    2, 29, 181, 207, 387, 403, 703, 1020, 1071, 1130, 1315, 2734, 4083, 4142, 4831, 6179, 14050,
)  # fmt: skip
OUTPUT_TOKENS_AT = (7, 16, 41, 54, 77, 91, 103, 129, 177, 384, 400, 424, 451, 601, 643, 954, 1000)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Shape:
    """An arrival rate over time (requests per second) and how long the trace lasts."""

    duration_s: float
    rate_per_s: Callable[[float], float]


@contextmanager
def _open(path: Path, mode: str) -> Iterator[IO[str]]:
    """The file as text, through gzip when its name ends in `.gz`: written with no name and
    no time in its header, so that the same trace makes the same bytes."""
    if path.suffix != ".gz":
        with path.open(mode, newline="") as f:
            yield f
        return
    with (
        path.open(mode + "b") as raw,
        gzip.GzipFile(filename="", mode=mode + "b", fileobj=raw, mtime=0) as zipped,
        io.TextIOWrapper(zipped, encoding="utf-8", newline="") as f,
    ):
        yield f


def read_trace(path: Path) -> list[TraceRequest]:
    """A trace file: CSV, or CSV gzipped (`.csv.gz`)."""
    with _open(path, "r") as f:
        reader = csv.reader(f)
        header = tuple(next(reader, ()))
        if header != HEADER:
            raise ValueError(f"{path}: header must be {','.join(HEADER)}, not {','.join(header)}")
        requests = [TraceRequest(float(a), int(p), int(o)) for a, p, o in reader]
    if any(b.arrival_s < a.arrival_s for a, b in pairwise(requests)):
        raise ValueError(f"{path}: rows must be in arrival order")
    return requests


def write_trace(path: Path, requests: list[TraceRequest]) -> None:
    """CSV, gzipped when the name ends in `.gz`."""
    with _open(path, "w") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(HEADER)
        for r in requests:
            writer.writerow([f"{r.arrival_s:.3f}", r.prompt_tokens, r.output_tokens])


def generate(kind: str, seed: int) -> list[TraceRequest]:
    """A trace of `kind` (one of `KINDS`), the same for the same seed."""
    rng = random.Random(seed)
    return requests_of(shape_of(kind, rng), rng)


def window(requests: list[TraceRequest], start_s: float, end_s: float) -> list[TraceRequest]:
    """The requests arriving in [start_s, end_s), their times from `start_s`."""
    return [
        TraceRequest(round(r.arrival_s - start_s, 3), r.prompt_tokens, r.output_tokens)
        for r in requests
        if start_s <= r.arrival_s < end_s
    ]


def requests_of(shape: Shape, rng: random.Random) -> list[TraceRequest]:
    """Poisson arrivals at the shape's rate, each with the Azure conversation mix."""
    return [
        TraceRequest(round(t, 3), _draw(rng, PROMPT_TOKENS_AT), _draw(rng, OUTPUT_TOKENS_AT))
        for t in _arrivals(rng, shape)
    ]


def shape_of(kind: str, rng: random.Random) -> Shape:
    if kind == "spike":
        return Shape(1800.0, piecewise([(0, 15), (600, 15), (660, 75), (1260, 75), (1320, 15)]))
    if kind == "diurnal":
        return Shape(3600.0, diurnal(20.0, period_s=3600.0, trough_at_s=0.0))
    if kind == "ramp":
        return Shape(2400.0, piecewise([(0, 10), (600, 10), (1800, 40)]))
    if kind == "flash":
        return _flash_crowds(rng, base_per_s=15.0, num_slots=4, slot_s=600.0)
    if kind == "spike-day":
        return _spike_day()
    raise ValueError(f"unknown trace kind {kind!r}: one of {', '.join(KINDS)}")


def diurnal(mean_per_s: float, period_s: float, trough_at_s: float) -> Callable[[float], float]:
    """A sinusoid of mean `mean_per_s`, peak / trough 2.3, lowest at `trough_at_s`."""
    amplitude = (2.3 - 1) / (2.3 + 1)

    def rate(t: float) -> float:
        return mean_per_s * (1 - amplitude * math.cos(2 * math.pi * (t - trough_at_s) / period_s))

    return rate


def _spike_day() -> Shape:
    day = diurnal(DAY_MEAN_PER_S, period_s=DAY_S, trough_at_s=DAY_TROUGH_AT_S)
    start, held = DAY_SPIKE_AT_S, DAY_SPIKE_AT_S + 60 + DAY_SPIKE_HELD_S
    factor = piecewise([(0, 1), (start, 1), (start + 60, 5), (held, 5), (held + 60, 1)])
    return Shape(DAY_S, lambda t: day(t) * factor(t))


def piecewise(points: list[tuple[float, float]]) -> Callable[[float], float]:
    """Linear between (time, rate) points, flat after the last."""
    times = [t for t, _ in points]

    def rate(t: float) -> float:
        i = bisect.bisect_right(times, t)
        if i == len(points):
            return points[-1][1]
        (t0, r0), (t1, r1) = points[i - 1], points[i]
        return r0 + (r1 - r0) * (t - t0) / (t1 - t0)

    return rate


def _flash_crowds(rng: random.Random, base_per_s: float, num_slots: int, slot_s: float) -> Shape:
    crowds = [
        (i * slot_s + rng.uniform(60, 420), rng.uniform(2, 4), rng.uniform(60, 180))
        for i in range(num_slots)
    ]
    rise_s = 10.0

    def rate(t: float) -> float:
        extra = 0.0
        for start_s, factor, decay_s in crowds:
            if t >= start_s:
                age = t - start_s
                ramp = min(1.0, age / rise_s)
                extra += (factor - 1) * ramp * math.exp(-max(0.0, age - rise_s) / decay_s)
        return base_per_s * (1 + extra)

    return Shape(num_slots * slot_s, rate)


def _arrivals(rng: random.Random, shape: Shape) -> list[float]:
    """A Poisson process of rate `shape.rate_per_s(t)`, by thinning one of the peak rate."""
    peak = max(shape.rate_per_s(t) for t in range(int(shape.duration_s) + 1)) * 1.05
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= shape.duration_s:
            return times
        if rng.random() * peak < shape.rate_per_s(t):
            times.append(t)


def _draw(rng: random.Random, tokens_at: tuple[int, ...]) -> int:
    """A token count by the inverse CDF through the quantiles, linear between them."""
    u = rng.random() * 100
    i = min(bisect.bisect_right(QUANTILES, u), len(QUANTILES) - 1)
    q0, q1 = QUANTILES[i - 1], QUANTILES[i]
    low, high = tokens_at[i - 1], tokens_at[i]
    return max(1, round(low + (high - low) * (u - q0) / (q1 - q0)))
