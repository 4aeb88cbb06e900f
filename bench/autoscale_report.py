"""What `llmfleet autoscale simulate` reports of the runs of `bench/autoscale_sim.py`: the
metrics of each policy, the issue's targets, and a plot of demand against workers over time
(an SVG file written by hand: one panel per policy).

The targets (docs/benchmarks.md, "Autoscaling"), checked where the policies ran:
`predictive+warm` meets the TTFT SLO for at least 99% of requests at no more than 1.15x the
oracle's worker-hours; `reactive` misses the SLO in the surges; `fixed-peak` costs more than
1.5x the oracle's worker-hours.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from statistics import median

from bench.autoscale_sim import Run, Sample, SimConfig, make, simulate, window_needs
from bench.autoscale_sim import worker_tokens_per_s as capacity_of
from bench.autoscale_traces import TraceRequest
from control.scale_policy import PolicyParams


def surges(requests: list[TraceRequest], config: SimConfig) -> list[tuple[float, float]]:
    """The 60-s windows with at least `surge_ratio` x the median window's arrivals, merged."""
    if not requests:
        return []
    counts = [0] * (int(requests[-1].arrival_s // 60) + 1)
    for r in requests:
        counts[int(r.arrival_s // 60)] += 1
    threshold = config.surge_ratio * median(counts)
    spans: list[tuple[float, float]] = []
    for k, count in enumerate(counts):
        if count < threshold:
            continue
        if spans and spans[-1][1] == k * 60.0:
            spans[-1] = (spans[-1][0], (k + 1) * 60.0)
        else:
            spans.append((k * 60.0, (k + 1) * 60.0))
    return spans


def summarize(run: Run, config: SimConfig, spans: list[tuple[float, float]]) -> dict:
    ttfts = sorted(run.ttft_s)
    in_surges = [
        t
        for t, a in zip(run.ttft_s, run.arrival_s, strict=True)
        if any(start <= a < end for start, end in spans)
    ]
    return {
        "ttft_p50_s": round(_percentile(ttfts, 50), 3),
        "ttft_p99_s": round(_percentile(ttfts, 99), 3),
        "slo_attainment": round(_attainment(ttfts, config.slo_ttft_s), 5),
        "slo_attainment_in_surges": (
            round(_attainment(in_surges, config.slo_ttft_s), 5) if in_surges else None
        ),
        "worker_hours": round(sum(run.worker_seconds.values()) / 3600, 3),
        "worker_hours_by_state": {
            state: round(seconds / 3600, 3) for state, seconds in run.worker_seconds.items()
        },
        "max_num_waiting": run.max_num_waiting,
        "num_requests": len(run.ttft_s),
        "is_each_request_served_once": all(n == 1 for n in run.num_started)
        and all(n == 1 for n in run.num_finished),
        "timeline": _timeline(run.samples[:: _every(len(run.samples))]),
    }


def _every(num_samples: int) -> int:
    """One sample kept of this many: every third (15 s at the default tick), fewer on a long
    trace, so that a day keeps ~2,000 points (the JSON and SVG files stay small)."""
    return max(EVERY, math.ceil(num_samples / MAX_POINTS))


def _timeline(samples: list[Sample]) -> dict[str, list[float]]:
    """The samples as columns."""
    columns: dict[str, list[float]] = {}
    for s in samples:
        for name, value in asdict(s).items():
            columns.setdefault(name, []).append(round(value, 3))
    return columns


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest rank."""
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _attainment(ttfts: list[float], slo_s: float) -> float:
    return sum(t <= slo_s for t in ttfts) / len(ttfts) if ttfts else math.nan


def add_ratios(results: dict[str, dict]) -> None:
    """Each policy's worker-hours over the oracle's, where the oracle ran."""
    oracle = results.get("oracle")
    for summary in results.values():
        summary["worker_hours_vs_oracle"] = (
            round(summary["worker_hours"] / oracle["worker_hours"], 3) if oracle else None
        )


TARGETS = (  # (label, policy, figure, whether its value meets it)
    ("predictive+warm SLO attainment >= 0.99", "predictive+warm", "slo_attainment",
     lambda v: v >= 0.99),
    ("predictive+warm worker-hours <= 1.15x oracle", "predictive+warm", "worker_hours_vs_oracle",
     lambda v: v <= 1.15),
    ("reactive misses the SLO in the surges (< 0.99)", "reactive", "slo_attainment_in_surges",
     lambda v: v < 0.99),
    ("fixed-peak worker-hours > 1.5x oracle", "fixed-peak", "worker_hours_vs_oracle",
     lambda v: v > 1.5),
)  # fmt: skip


def targets(results: dict[str, dict]) -> dict[str, dict]:
    """The issue's targets (set for the spike trace), for the policies that ran."""
    return {
        label: {"value": results[name][key], "is_met": bool(is_met(results[name][key]))}
        for label, name, key, is_met in TARGETS
        if results.get(name, {}).get(key) is not None
    }


def compare(
    requests: list[TraceRequest], names: list[str], params: PolicyParams, config: SimConfig
) -> tuple[dict, dict[str, Run]]:
    """Every policy of `names` on the trace: the report (JSON-ready) and the runs."""
    capacity = capacity_of(requests, config)
    needs = window_needs(requests, params, config, capacity)
    spans = surges(requests, config)
    runs = {
        name: simulate(requests, make(name, needs, params, config), config, capacity)
        for name in names
    }
    results = {name: summarize(run, config, spans) for name, run in runs.items()}
    add_ratios(results)
    report = {
        "num_requests": len(requests),
        "duration_s": requests[-1].arrival_s if requests else 0.0,
        "worker_tokens_per_s": round(capacity, 1),
        "surges_s": spans,
        "config": asdict(config),
        "params": asdict(params),
        "results": results,
        "targets": targets(results),
    }
    return report, runs


# The plot.

LAYERS = (  # bottom to top: (label, Sample field, colour)
    ("ready", "num_ready", "#2e7d32"),
    ("standby", "num_standby", "#1565c0"),
    ("loading", "num_loading", "#ef6c00"),
    ("draining", "num_draining", "#9e9e9e"),
)
WIDTH, LEFT, RIGHT, TOP, PANEL_H, GAP = 900, 50, 20, 56, 130, 46
SMOOTHING = 12  # samples in the demand's moving mean: a minute at a 5-s tick
EVERY = 3  # one point kept per this many samples at least (15 s at a 5-s tick)
MAX_POINTS = 2000  # ... and at most this many points kept of a run


def plot_svg(runs: dict[str, Run], results: dict[str, dict], title: str) -> str:
    """Demand (in workers at a full batch, a one-minute moving mean) against the workers
    ready, on standby, loading and draining: one panel per policy, each on its own scale."""
    end_s = max(run.samples[-1].t_s for run in runs.values())
    height = TOP + len(runs) * (PANEL_H + GAP)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="{LEFT}" y="18" font-size="14">{_escape(title)}</text>',
        _legend(),
    ]
    for k, (name, run) in enumerate(runs.items()):
        y0 = TOP + k * (PANEL_H + GAP) + 16
        every = _every(len(run.samples))
        demand = _smoothed([s.demand_workers for s in run.samples])[::every]
        parts += _panel(name, run.samples[::every], demand, results.get(name, {}), y0, end_s)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _panel(
    name: str, samples: list[Sample], demand: list[float], summary: dict, y0: float, end_s: float
) -> list[str]:
    def x(t_s: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * t_s / end_s

    stacked = [_stacked(s) for s in samples]
    y_max = _nice(1.1 * max(max(levels[-1], d) for levels, d in zip(stacked, demand, strict=True)))

    def y(value: float) -> float:
        return y0 + PANEL_H * (1 - value / y_max)

    caption = name
    if summary:
        caption += (
            f": SLO {summary['slo_attainment']:.2%}, TTFT p99 "
            f"{summary['ttft_p99_s']:.2f} s, {summary['worker_hours']:.2f} worker-h"
        )
    parts = [f'<text x="{LEFT}" y="{y0 - 5:.1f}" font-size="12">{_escape(caption)}</text>']
    parts += _axes(x, y, y0, end_s, y_max)
    times = [s.t_s for s in samples]
    for layer, (_, _, colour) in enumerate(LAYERS):
        upper = [(x(t), y(levels[layer + 1])) for t, levels in zip(times, stacked, strict=True)]
        lower = [(x(t), y(levels[layer])) for t, levels in zip(times, stacked, strict=True)]
        points = upper + lower[::-1]
        parts.append(
            f'<polygon fill="{colour}" fill-opacity="0.75" stroke="none" '
            f'points="{_points(points)}"/>'
        )
    line = [(x(t), y(d)) for t, d in zip(times, demand, strict=True)]
    parts.append(
        f'<polyline fill="none" stroke="black" stroke-width="1.2" points="{_points(line)}"/>'
    )
    return parts


def _axes(x, y, y0: float, end_s: float, y_max: float) -> list[str]:
    parts = [
        f'<rect x="{LEFT}" y="{y0}" width="{WIDTH - LEFT - RIGHT}" height="{PANEL_H}" '
        'fill="none" stroke="#444"/>'
    ]
    step = _nice(y_max / 4)
    value = 0.0
    while value <= y_max + 1e-9:
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" '
            f'y2="{y(value):.1f}" stroke="#ddd"/>'
        )
        parts.append(
            f'<text x="{LEFT - 4}" y="{y(value) + 4:.1f}" text-anchor="end">{value:g}</text>'
        )
        value += step
    for t_s, label in _time_labels(end_s):
        parts.append(
            f'<text x="{x(t_s):.1f}" y="{y0 + PANEL_H + 13}" text-anchor="middle">{label}</text>'
        )
    return parts


def _time_labels(end_s: float) -> list[tuple[int, str]]:
    """Every 5 or 15 minutes up to 3 hours; every 2 hours beyond."""
    if end_s > 3 * 3600:
        return [(t_s, f"{t_s // 3600} h") for t_s in range(0, int(end_s) + 1, 7200)]
    minutes = 5 if end_s <= 3600 else 15
    return [(t_s, f"{t_s // 60} min") for t_s in range(0, int(end_s) + 1, minutes * 60)]


def _legend() -> str:
    items = [*((label, colour) for label, _, colour in LAYERS), ("demand", "black")]
    parts = []
    for k, (label, colour) in enumerate(items):
        x = LEFT + k * 95
        parts.append(
            f'<rect x="{x}" y="28" width="12" height="10" fill="{colour}"/>'
            f'<text x="{x + 16}" y="37">{label}</text>'
        )
    parts.append(
        f'<text x="{LEFT + len(items) * 95}" y="37">(workers; demand at a full '
        "batch, 1-min mean)</text>"
    )
    return "".join(parts)


def _stacked(s: Sample) -> list[float]:
    levels = [0.0]
    for _, field_name, _ in LAYERS:
        levels.append(levels[-1] + getattr(s, field_name))
    return levels


def _smoothed(values: list[float]) -> list[float]:
    half = SMOOTHING // 2
    out = []
    for i in range(len(values)):
        window = values[max(0, i - half) : i + half]
        out.append(sum(window) / len(window))
    return out


def _nice(value: float) -> float:
    """The next of 1, 2, 5 x 10^k at or above `value`."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= value)


def _points(points: list[tuple[float, float]]) -> str:
    return " ".join(f"{px:.1f},{py:.1f}" for px, py in points)


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
