"""Report: show run summaries as a text table, save them as JSON, plot them as one PNG."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from bench.client import RequestResult

NUM_COLUMN_CHARS = 10


def _ms(metric: str, stat: str) -> Callable[[dict[str, Any]], float]:
    return lambda summary: summary[metric][stat] * 1000.0


# (header, value from a summarize() dict, format); latencies in milliseconds.
COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], float], str], ...] = (
    ("out tok/s", lambda s: s["output_tokens_per_s"], "{:.1f}"),
    ("req/s", lambda s: s["requests_per_s"], "{:.2f}"),
    ("TTFT p50", _ms("ttft_s", "p50"), "{:.1f}"),
    ("TTFT p99", _ms("ttft_s", "p99"), "{:.1f}"),
    ("TPOT p50", _ms("tpot_s", "p50"), "{:.1f}"),
    ("TPOT p99", _ms("tpot_s", "p99"), "{:.1f}"),
    ("ITL p50", _ms("itl_s", "p50"), "{:.1f}"),
    ("ITL p99", _ms("itl_s", "p99"), "{:.1f}"),
    ("E2E p50", _ms("e2e_s", "p50"), "{:.1f}"),
    ("E2E p99", _ms("e2e_s", "p99"), "{:.1f}"),
    ("goodput", lambda s: s["goodput_requests_per_s"], "{:.2f}"),
)


def format_table(rows: dict[str, dict]) -> str:
    """A fixed-width table, one row per run name (latencies in ms, goodput in req/s)."""
    name_width = max([len("name"), *map(len, rows)])
    header = "name".ljust(name_width) + "".join(
        h.rjust(NUM_COLUMN_CHARS + 1) for h, _, _ in COLUMNS
    )
    lines = [header, "-" * len(header)]
    for name, summary in rows.items():
        cells = (fmt.format(value(summary)) for _, value, fmt in COLUMNS)
        lines.append(name.ljust(name_width) + "".join(c.rjust(NUM_COLUMN_CHARS + 1) for c in cells))
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict) -> None:
    """Write `payload` as indented JSON, creating the parent folder if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def plot(results_by_name: dict[str, list[RequestResult]], path: str | Path) -> None:
    """One PNG, three panels: TTFT CDF, ITL CDF (log x), cumulative output tokens over time.

    Only successful requests are drawn, matching `summarize`.
    """
    # The object API with an explicit Agg canvas: no pyplot global state, no display needed.
    figure = Figure(figsize=(15, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    ttft_axes, itl_axes, tokens_axes = figure.subplots(1, 3)
    for name, results in results_by_name.items():
        ok = [r for r in results if r.is_ok]
        _plot_cdf(ttft_axes, [r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None], name)
        _plot_cdf(itl_axes, [gap_s * 1000.0 for r in ok for gap_s in r.itl_s if gap_s > 0], name)
        _plot_cumulative_tokens(tokens_axes, ok, name)
    ttft_axes.set(title="TTFT", xlabel="ms", ylabel="fraction of requests")
    itl_axes.set(
        title="Inter-token latency", xlabel="ms (log)", ylabel="fraction of gaps", xscale="log"
    )
    tokens_axes.set(
        title="Output tokens", xlabel="s since first request", ylabel="cumulative tokens"
    )
    for axes in (ttft_axes, itl_axes, tokens_axes):
        axes.grid(alpha=0.3)
        if axes.has_data():
            axes.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def _plot_cdf(axes: Axes, values: list[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(values)
    axes.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=label)


def _plot_cumulative_tokens(axes: Axes, results: list[RequestResult], label: str) -> None:
    if not results:
        return
    run_start_s = min(r.start_s for r in results)
    times_s: list[float] = []
    num_tokens: list[float] = []
    for r in results:
        # A chunk may carry several tokens: spread the request's usage count over its chunks
        # so the curve ends at the total the server reported.
        tokens_per_chunk = r.num_output_tokens / len(r.chunk_times_s) if r.chunk_times_s else 0.0
        times_s.extend(t - run_start_s for t in r.chunk_times_s)
        num_tokens.extend([tokens_per_chunk] * len(r.chunk_times_s))
    order = np.argsort(times_s)
    axes.step(
        np.asarray(times_s)[order],
        np.cumsum(np.asarray(num_tokens)[order]),
        where="post",
        label=label,
    )
