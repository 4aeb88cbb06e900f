"""The figures of `llmfleet bench --platform-load`, from the client's records and the
processes' samples: plain functions, no I/O.

Added ITL: the echo engine emits each sequence's tokens exactly one step period apart (a
fixed grid, `worker/echo_engine.py`), so every gap a client sees between two content chunks
of a stream, less that period, is what the platform added between the worker's emission
and the client: the worker's publish, Redis, the API's relay and the client's own read. The
worker's own ITL (from its latency window) is reported beside it, so a worker that fell
behind its grid is told apart from a slow relay. The wire format carries no timestamps, and
needs none for this.

Added ITL over the emission: the streams' echo worker also writes down when it handed out
each token (`--echo-emissions`, the machine's monotonic clock, as the client's), so each
token's delivery time (its arrival at the client less its emission) is known, and the gap
between two chunks less the gap between their emissions is what the platform added to
that ITL whether or not the worker kept its grid: the worker's publish, Redis, the API's
relay and the client's read, and nothing of the worker's own lateness.

The hold: from the moment the last stream was admitted to the moment the first one ended,
every stream is open. Costs per token are taken between the first and the last sample
inside it, so they are the relay's alone, without the admissions of the ramp.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from itertools import pairwise
from typing import Any

from bench.metrics import percentiles
from bench.process_sampler import Sample
from bench.sse_load import StreamRecord


def max_concurrent(intervals: Iterable[tuple[float, float]]) -> int:
    """The most intervals (start, end) open at one time; an interval is open from its start
    up to, not including, its end."""
    events = sorted(
        [(start_s, 1) for start_s, _ in intervals] + [(end_s, -1) for _, end_s in intervals]
    )  # at a tie, an end (-1) before a start
    count, best = 0, 0
    for _, change in events:
        count += change
        best = max(best, count)
    return best


def open_intervals(records: Iterable[StreamRecord]) -> list[tuple[float, float]]:
    """Each accepted stream's life at the client: its status line to its end."""
    return [(r.accepted_s, r.end_s) for r in records if r.is_accepted and r.end_s > 0]


def hold_window(records: list[StreamRecord]) -> tuple[float, float] | None:
    """When every accepted stream was open: the last admission to the first end; None if
    that never happened (a stream ended before the last was admitted)."""
    accepted = [r for r in records if r.is_accepted and r.end_s > 0]
    if not accepted:
        return None
    start_s, end_s = max(r.accepted_s for r in accepted), min(r.end_s for r in accepted)
    return (start_s, end_s) if start_s < end_s else None


def stream_errors(records: Iterable[StreamRecord], num_expected_tokens: int) -> Counter[str]:
    """What went wrong, by kind: a failed stream, or one that ended well with a usage other
    than `num_expected_tokens` completion tokens (the echo engine honours `max_tokens`)."""
    errors: Counter[str] = Counter()
    for record in records:
        if record.error is not None:
            errors[record.error] += 1
        elif record.num_completion_tokens != num_expected_tokens:
            errors[f"usage: {record.num_completion_tokens} completion tokens"] += 1
    return errors


def read_emissions(lines: Iterable[str]) -> dict[str, list[float]]:
    """An emission log (`worker/echo_engine.EmissionLog`): each request's token times, in
    order."""
    emissions: dict[str, list[float]] = {}
    for line in lines:
        request_id, _, at_s = line.partition(" ")
        if at_s:
            emissions.setdefault(request_id, []).append(float(at_s))
    return emissions


def delivery_s(
    records: Iterable[StreamRecord],
    emissions: dict[str, list[float]],
    within: tuple[float, float] | None = None,
) -> tuple[list[float], list[float]]:
    """Per token of the good streams whose chunks match their emissions one for one: its
    delivery time (arrival less emission), and per gap between two of them the ITL added
    over the emission (the change in delivery time); `within`: the tokens that arrived in
    that window (a gap: its later token)."""
    low_s, high_s = within or (float("-inf"), float("inf"))
    delivery, added = [], []
    for record in records:
        emitted = emissions.get(record.request_id)
        if not record.is_ok or emitted is None or len(emitted) != len(record.token_times_s):
            continue
        latencies = [
            (arrived, arrived - at_s)
            for arrived, at_s in zip(record.token_times_s, emitted, strict=True)
        ]
        delivery += [latency for arrived, latency in latencies if low_s <= arrived <= high_s]
        added += [
            later - earlier
            for (_, earlier), (arrived, later) in pairwise(latencies)
            if low_s <= arrived <= high_s
        ]
    return delivery, added


def added_itl_s(
    records: Iterable[StreamRecord], period_s: float, within: tuple[float, float] | None = None
) -> list[float]:
    """Every gap between consecutive content chunks of the good streams, less the period;
    `within`: only the gaps that ended in that window."""
    low_s, high_s = within or (float("-inf"), float("inf"))
    return [
        later - earlier - period_s
        for record in records
        if record.is_ok
        for earlier, later in pairwise(record.token_times_s)
        if low_s <= later <= high_s
    ]


def num_tokens_between(records: Iterable[StreamRecord], start_s: float, end_s: float) -> int:
    return sum(start_s < t <= end_s for record in records for t in record.token_times_s)


def ms(values_s: list[float]) -> dict[str, float]:
    """`bench.metrics.percentiles` in milliseconds (p50, p90, p99, max, mean)."""
    return {name: value * 1e3 for name, value in percentiles(values_s).items()}


def num_open_at(records: Iterable[StreamRecord], at_s: float) -> int:
    """Streams admitted (their status line came) and not yet ended at `at_s`."""
    return sum(r.is_accepted and r.accepted_s <= at_s < (r.end_s or at_s + 1) for r in records)


def sample_when_held(samples: list[Sample], records: list[StreamRecord]) -> tuple[Sample, int]:
    """The sample taken while the most streams were open, by the client's records (the
    first such), and how many. Not by the API's sockets: a connection the API has accepted
    may still wait for its admission, and holds no stream yet."""
    counts = [num_open_at(records, sample.at_s) for sample in samples]
    best = max(range(len(samples)), key=counts.__getitem__)
    return samples[best], counts[best]


def held_figures(baseline: Sample, held: Sample, num_streams: int) -> dict[str, Any]:
    """Memory, descriptors and Redis connections of the API holding `num_streams` streams at
    `held`, against `baseline` (none), also per stream."""

    def per_stream(delta: float) -> float | None:
        return delta / num_streams if num_streams > 0 else None

    return {
        "api_streams_held": num_streams,
        "api_client_connections_held": held.num_client_connections,
        "api_rss_baseline_bytes": baseline.api_rss_bytes,
        "api_rss_held_bytes": held.api_rss_bytes,
        "memory_per_stream_bytes": per_stream(held.api_rss_bytes - baseline.api_rss_bytes),
        "api_fds_baseline": baseline.api_fds,
        "api_fds_held": held.api_fds,
        "fds_per_stream": per_stream(held.api_fds - baseline.api_fds),
        "api_redis_connections_baseline": baseline.num_redis_connections,
        "api_redis_connections_held": held.num_redis_connections,
        "api_redis_clients_held_by_name": held.redis_clients_by_name,
        "redis_connections_per_stream": per_stream(
            held.num_redis_connections - baseline.num_redis_connections
        ),
    }


def costs(first: Sample, last: Sample, count: int, unit: str) -> dict[str, Any]:
    """CPU of the API, the worker and Redis, and Redis's commands, between two samples, per
    `unit` (a token, a request) of the `count` in between; CPU in microseconds."""
    if count <= 0:
        return {}
    calls = {
        name: (num_calls - first.redis_calls.get(name, 0)) / count
        for name, num_calls in last.redis_calls.items()
        if num_calls > first.redis_calls.get(name, 0)
    }
    return {
        f"num_{unit}s": count,
        "seconds": last.at_s - first.at_s,
        f"api_cpu_per_{unit}_us": (last.api_cpu_s - first.api_cpu_s) / count * 1e6,
        f"worker_cpu_per_{unit}_us": (last.worker_cpu_s - first.worker_cpu_s) / count * 1e6,
        f"redis_cpu_per_{unit}_us": (last.redis_cpu_s - first.redis_cpu_s) / count * 1e6,
        f"redis_calls_per_{unit}": sum(calls.values()),
        f"redis_calls_per_{unit}_by_command": dict(sorted(calls.items())),
    }


def admission_figures(records: list[StreamRecord], num_expected_tokens: int) -> dict[str, Any]:
    """A burst of short requests: how many the API admitted a second (status lines over the
    time from the first request sent to the last admitted), and how many completed."""
    if not records:
        return {"num_requests": 0}
    admitted = [r for r in records if r.is_accepted]
    first_sent_s = min(r.sent_s for r in records)
    admitted_s = max((r.accepted_s for r in admitted), default=first_sent_s) - first_sent_s
    ended_s = max(r.end_s for r in records) - first_sent_s
    errors = stream_errors(records, num_expected_tokens)
    num_errors = sum(errors.values())
    return {
        "num_requests": len(records),
        "num_admitted": len(admitted),
        "num_ok": len(records) - num_errors,
        "num_errors": num_errors,
        "errors": dict(errors),
        "admitted_per_s": len(admitted) / admitted_s if admitted_s > 0 else 0.0,
        "completed_per_s": (len(records) - num_errors) / ended_s if ended_s > 0 else 0.0,
        "admission_latency_ms": ms([r.accepted_s - r.sent_s for r in admitted]),
    }
