"""`llmfleet rollout ...`: canary rollouts of a model's versions (`shared/rollouts.py`).

The commands write SQL, where the rollout lives; the control process's loop moves it on
(`control/rollouts.py`) and every API replica routes by it within `routing_cache_s`.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from cli.common import db, print_table, when

rollout_app = typer.Typer(help="Canary rollouts of model versions.", no_args_is_help=True)


@rollout_app.command("start")
def rollout_start(
    model: str,
    version: str,
    percent: Annotated[float, typer.Option(help="The canary's share of requests at once, in %.")],
    step: Annotated[
        float, typer.Option(help="Added every --interval while healthy; 0: held until promoted.")
    ] = 0.0,
    interval: Annotated[float, typer.Option(help="Seconds between steps.")] = 60.0,
    sticky: Annotated[
        str,
        typer.Option(
            help="none | tenant | user: one tenant's (or user's) requests on one version."
        ),
    ] = "none",
    min_samples: Annotated[
        int | None,
        typer.Option(
            help="Requests each version needs in the window before the canary is judged "
            "(default: LLMFLEET_ROLLOUT_MIN_NUM_SAMPLES)."
        ),
    ] = None,
) -> None:
    """Start sending PERCENT of MODEL's requests to VERSION, beside its stable version."""
    from shared import rollouts

    rollout = _run(
        rollouts.start,
        db(),
        model,
        version,
        percent,
        step_percent=step,
        interval_s=interval,
        sticky=sticky,
        min_num_samples=min_samples,
    )
    typer.echo(f"rollout of {model} v{version} started at {rollout.percent:g}%")


@rollout_app.command("status")
def rollout_status(model: Annotated[str | None, typer.Argument()] = None) -> None:
    """The latest rollout of MODEL (or of every model), with the canary's health while it runs."""
    from shared import rollouts

    engine = db()
    if model is not None:
        latest = rollouts.latest(engine, model)
        if latest is None:
            raise typer.BadParameter(f"no rollout of {model!r}")
        found = [latest]
    else:
        found = rollouts.latest_per_model(engine)
    rows, health = [], []
    for rollout in found:
        canary, stable = rollouts.deployments_of(engine, rollout)
        rows.append(
            [
                rollout.model_id,
                stable.version,
                canary.version,
                rollout.state,
                f"{rollout.percent:g}%",
                f"+{rollout.step_percent:g}%/{rollout.interval_s:g}s",
                rollout.sticky,
                when(rollout.started_at),
                when(rollout.finished_at),
            ]
        )
        if rollout.state == rollouts.RolloutState.RUNNING:
            health.append(f"{canary.name}: {_assess(rollout, canary, stable)}")
        elif rollout.reason:
            health.append(f"{canary.name}: {rollout.state}: {rollout.reason}")
    print_table(
        ["MODEL", "STABLE", "CANARY", "STATE", "PERCENT", "STEP", "STICKY", "STARTED", "ENDED"],
        rows,
    )
    for line in health:
        typer.echo(line)


@rollout_app.command("promote")
def rollout_promote(model: str) -> None:
    """Make the running rollout's canary MODEL's stable version now."""
    from shared import rollouts

    rollout = _run(rollouts.promote, db(), model)
    canary, _ = rollouts.deployments_of(db(), rollout)
    typer.echo(f"{canary.name} is the stable version of {model}")


@rollout_app.command("abort")
def rollout_abort(model: str) -> None:
    """Stop the running rollout: the canary gets no more requests."""
    from shared import rollouts

    _run(rollouts.abort, db(), model)
    typer.echo(f"rollout of {model} aborted; its stable version takes all requests")


def _run(fn, *args, **kwargs):
    from shared.rollouts import RolloutError

    try:
        return fn(*args, **kwargs)
    except RolloutError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2 if exc.status_code == 409 else 1) from None


def _assess(rollout, canary, stable) -> str:
    from shared import canary_health
    from shared.canary_health import Margins
    from shared.redis_conn import async_client
    from shared.settings import get_settings

    settings = get_settings()

    async def read():
        redis = async_client(settings.redis_url, retries=2)
        try:
            margins = Margins.of(settings)
            return await canary_health.assess(redis, margins, rollout, canary, stable)
        finally:
            await redis.aclose()

    found = asyncio.run(read())
    return f"{found.judgement.verdict}: {found.judgement.reason}"
