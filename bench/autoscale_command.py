"""`llmfleet autoscale ...`: the autoscaling policies (`control/scale_policy.py`) on a request
trace, with a virtual clock, against an oracle that knows the future and a fleet fixed at
the peak (`simulate`); the warm pool's size swept on one trace (`pool-sweep`); the
predictive policies' parameters swept on several traces together (`tune`); and the seeded
traces they replay (`trace`).

A bench tool: the command line (`cli`) offers it through the entry point `autoscale` of the
group `llmfleet.commands` (pyproject.toml, cli/plugins.py), as `llmfleet bench`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from bench import autoscale_sweep
from bench.autoscale_report import compare, plot_svg
from bench.autoscale_sim import STEP_MODELS, SimConfig
from bench.autoscale_traces import KINDS, generate, read_trace, window, write_trace
from cli.common import print_table
from control.scale_policy import POLICY_NAMES, PolicyParams

autoscale_app = typer.Typer(
    help="Autoscaling policies on a request trace (simulated).", no_args_is_help=True
)

ALL_POLICIES = (*POLICY_NAMES, "oracle", "fixed-peak")
DEFAULTS = PolicyParams()
TRACE_HELP = "CSV (or .csv.gz): arrival_s,prompt_tokens,output_tokens."


@dataclasses.dataclass(frozen=True, slots=True)
class _Model:
    """The options every simulating command shares."""

    params: PolicyParams
    config: SimConfig


def _model(
    cold_start_s: float,
    warm_activation_s: float,
    slo_ttft_s: float,
    warm_pool: int,
    max_workers: int,
    step_model: str,
    places: int,
    tick_s: float,
) -> _Model:
    if step_model not in STEP_MODELS:
        raise typer.BadParameter(f"one of {', '.join(STEP_MODELS)}", param_hint="--step-model")
    params = dataclasses.replace(
        DEFAULTS, cold_start_s=cold_start_s, warm_pool=warm_pool, max_workers=max_workers
    )
    config = SimConfig(
        cold_start_s=cold_start_s,
        warm_activation_s=warm_activation_s,
        slo_ttft_s=slo_ttft_s,
        tick_s=tick_s,
        num_places=places,
        step=STEP_MODELS[step_model],
    )
    return _Model(params, config)


def _requests(trace: Path) -> list:
    requests = read_trace(trace)
    if not requests:
        raise typer.BadParameter("the trace has no requests", param_hint="--trace")
    return requests


ColdStart = Annotated[
    float, typer.Option(help="A new worker's start (and the forecast's horizon).")
]
WarmActivation = Annotated[float, typer.Option(help="Standby to serving.")]
SloTtft = Annotated[float, typer.Option(help="The TTFT SLO.")]
StepModel = Annotated[
    str, typer.Option(help="gpu (25 ms + 0.2 ms/token) | flat (10 ms + 10 us/token).")
]
Places = Annotated[int, typer.Option(help="Places in a worker's batch.")]
TickS = Annotated[float, typer.Option(help="The policies' tick.")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Write the report here.")]
Jobs = Annotated[int, typer.Option(help="Simulations run at once (processes).")]


@autoscale_app.command("simulate")
def simulate(
    trace: Annotated[Path, typer.Option(exists=True, dir_okay=False, help=TRACE_HELP)],
    policy: Annotated[
        list[str] | None,
        typer.Option(help=f"Repeatable; default all: {', '.join(ALL_POLICIES)}."),
    ] = None,
    cold_start_s: ColdStart = 180.0,
    warm_activation_s: WarmActivation = 2.0,
    slo_ttft_s: SloTtft = 2.0,
    warm_pool: Annotated[
        int, typer.Option(help="predictive+warm: workers loaded beyond the baseline's serving.")
    ] = DEFAULTS.warm_pool,
    target_utilisation: float = DEFAULTS.target_utilisation,
    scale_down_delay_s: float = DEFAULTS.scale_down_delay_s,
    standby_quiet_s: float = DEFAULTS.standby_quiet_s,
    max_workers: int = DEFAULTS.max_workers,
    step_model: StepModel = "gpu",
    places: Places = 64,
    tick_s: TickS = 5.0,
    json_out: JsonOut = None,
    plot: Annotated[Path | None, typer.Option(help="Write the SVG plot here.")] = None,
) -> None:
    """Replay TRACE under each policy; print TTFT, SLO attainment and worker-hours."""
    names = policy or list(ALL_POLICIES)
    unknown = sorted(set(names) - set(ALL_POLICIES))
    if unknown:
        raise typer.BadParameter(f"{', '.join(unknown)}: one of {', '.join(ALL_POLICIES)}")
    model = _model(
        cold_start_s, warm_activation_s, slo_ttft_s, warm_pool, max_workers, step_model,
        places, tick_s,
    )  # fmt: skip
    params = dataclasses.replace(
        model.params,
        target_utilisation=target_utilisation,
        scale_down_delay_s=scale_down_delay_s,
        standby_quiet_s=standby_quiet_s,
    )
    report, runs = compare(_requests(trace), names, params, model.config)
    report["trace"] = str(trace)
    _print_report(report)
    _write_json(json_out, report)
    if plot is not None:
        plot.write_text(plot_svg(runs, report["results"], _title(trace, report)))
        typer.echo(f"wrote {plot}")


@autoscale_app.command("pool-sweep")
def pool_sweep(
    trace: Annotated[Path, typer.Option(exists=True, dir_okay=False, help=TRACE_HELP)],
    sizes: Annotated[str, typer.Option(help="Warm pool sizes, comma-separated.")] = "0,1,2,4,8",
    cold_start_s: ColdStart = 180.0,
    warm_activation_s: WarmActivation = 2.0,
    slo_ttft_s: SloTtft = 2.0,
    max_workers: int = DEFAULTS.max_workers,
    step_model: StepModel = "gpu",
    places: Places = 64,
    tick_s: TickS = 5.0,
    jobs: Jobs = 1,
    json_out: JsonOut = None,
) -> None:
    """predictive+warm at each warm pool size on TRACE, next to the oracle, fixed-peak,
    reactive and predictive: SLO attainment overall and in the surges, worker-hours."""
    pools = [int(n) for n in sizes.split(",") if n.strip()]
    model = _model(
        cold_start_s, warm_activation_s, slo_ttft_s, DEFAULTS.warm_pool, max_workers,
        step_model, places, tick_s,
    )  # fmt: skip
    report = autoscale_sweep.pool_sweep(_requests(trace), pools, model.params, model.config, jobs)
    report["trace"] = str(trace)
    report["config"] = dataclasses.asdict(model.config)
    typer.echo(f"{report['num_requests']} requests; surges {_spans(report['surges_s'])}")
    _print_results(report["results"])
    _write_json(json_out, report)


@autoscale_app.command("tune")
def tune(
    trace: Annotated[
        list[Path],
        typer.Option(exists=True, dir_okay=False, help=f"Repeatable. {TRACE_HELP}"),
    ],
    base: Annotated[
        list[str] | None,
        typer.Option(help="Repeatable NAME=VALUE: a PolicyParams field the search starts from."),
    ] = None,
    jobs: Jobs = 1,
    json_out: JsonOut = None,
) -> None:
    """The predictive policies' parameters, one at a time around the defaults (or --base),
    scored on every TRACE together (bench/autoscale_sweep.py: goodput per worker-hour
    against the oracle's, geometric mean over traces and policies)."""
    model = _model(180.0, 2.0, 2.0, DEFAULTS.warm_pool, DEFAULTS.max_workers, "gpu", 64, 5.0)
    params = dataclasses.replace(model.params, **_overrides(base or []))
    traces = {path.name: _requests(path) for path in trace}
    report = autoscale_sweep.tune(traces, params, model.config, num_procs=jobs, progress=typer.echo)
    header = ["VARIANT", "SCORE", "SLO CHANGE", *(f"{t} P / P+W" for t in traces)]
    rows = []
    for row in report["variants"]:
        allowed = "" if row["is_allowed"] else " (no)"
        cells = [row["variant"], f"{row['score']:.4f}", f"{row['worst_slo_change']:+.2%}{allowed}"]
        for by_policy in row["results"].values():
            cells.append(
                " / ".join(
                    f"{by_policy[p]['slo_attainment']:.1%} {by_policy[p]['worker_hours_vs_oracle']:.2f}x"
                    for p in autoscale_sweep.TUNED_POLICIES
                )
            )
        rows.append(cells)
    print_table(header, rows)
    _write_json(json_out, report)


@autoscale_app.command("trace")
def trace(
    kind: Annotated[str, typer.Option(help=" | ".join(KINDS))],
    out: Annotated[
        Path, typer.Option(dir_okay=False, help="The file to write: .csv, or .csv.gz gzipped.")
    ],
    seed: int = 0,
    start_s: Annotated[
        float | None, typer.Option(help="Keep only arrivals from here (times from it).")
    ] = None,
    end_s: Annotated[float | None, typer.Option(help="... and before here.")] = None,
) -> None:
    """Write a seeded trace of KIND (bench/autoscale_traces.py describes each), or a window
    of it."""
    if kind not in KINDS:
        raise typer.BadParameter(f"one of {', '.join(KINDS)}", param_hint="--kind")
    requests = generate(kind, seed)
    if start_s is not None or end_s is not None:
        requests = window(requests, start_s or 0.0, float("inf") if end_s is None else end_s)
    write_trace(out, requests)
    last_s = requests[-1].arrival_s if requests else 0.0
    typer.echo(f"wrote {out}: {len(requests)} requests over {last_s:.0f} s")


def _overrides(pairs: list[str]) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(PolicyParams)}
    found: dict[str, Any] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in fields or not value:
            raise typer.BadParameter(f"{pair!r}: NAME=VALUE of PolicyParams", param_hint="--base")
        found[name] = type(getattr(DEFAULTS, name))(float(value))
    return found


def _write_json(path: Path | None, report: dict[str, Any]) -> None:
    if path is not None:
        path.write_text(json.dumps(report, indent=1) + "\n")
        typer.echo(f"wrote {path}")


def _print_report(report: dict) -> None:
    typer.echo(
        f"{report['num_requests']} requests over {report['duration_s']:.0f} s; a worker serves "
        f"{report['worker_tokens_per_s']:.0f} tokens/s at a full batch; surges "
        f"{_spans(report['surges_s'])}"
    )
    _print_results(report["results"])
    for label, check in report["targets"].items():
        typer.echo(f"target: {label}: {check['value']} ({'met' if check['is_met'] else 'NOT met'})")


def _print_results(results: dict[str, dict]) -> None:
    header = ["POLICY", "TTFT P50", "TTFT P99", "SLO", "SLO SURGES", "WORKER-H", "VS ORACLE",
              "STANDBY-H", "MAX QUEUE", "SERVED ONCE"]  # fmt: skip
    rows = []
    for name, r in results.items():
        in_surges = r["slo_attainment_in_surges"]
        vs_oracle = r["worker_hours_vs_oracle"]
        rows.append(
            [
                name,
                f"{r['ttft_p50_s']:.2f} s",
                f"{r['ttft_p99_s']:.2f} s",
                f"{r['slo_attainment']:.2%}",
                None if in_surges is None else f"{in_surges:.2%}",
                f"{r['worker_hours']:.2f}",
                None if vs_oracle is None else f"{vs_oracle:.2f}x",
                f"{r['worker_hours_by_state']['standby']:.2f}",
                r["max_num_waiting"],
                "yes" if r["is_each_request_served_once"] else "NO",
            ]
        )
    print_table(header, rows)


def _spans(spans: list) -> str:
    return ", ".join(f"{a / 60:g}-{b / 60:g} min" for a, b in spans) or "none"


def _title(trace: Path, report: dict) -> str:
    config = report["config"]
    return (
        f"{trace.name}: {report['num_requests']} requests; cold start {config['cold_start_s']:g} s, "
        f"warm activation {config['warm_activation_s']:g} s, TTFT SLO {config['slo_ttft_s']:g} s"
    )
