"""`llmfleet model ...`: model deployments (the versions of each model)."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import db, print_table

model_app = typer.Typer(help="Model deployments.", no_args_is_help=True)


@model_app.command("add")
def model_add(
    model_id: str,
    source: Annotated[str, typer.Option(help="smollm2-135m, a .gguf file or a HF model directory")],
    version: Annotated[str, typer.Option()] = "1",
) -> None:
    """Register a model deployment. A model's first version is its stable one; a later
    version takes traffic through `llmfleet rollout start`, or when a request pins it
    (`model@version`)."""
    from shared import deployments

    try:
        deployment = deployments.register(db(), model_id, source, version)
    except deployments.InvalidName as exc:
        raise typer.BadParameter(str(exc)) from None
    role = "stable" if deployment.is_stable else "not stable: roll it out to give it traffic"
    typer.echo(
        f"deployment {deployment.model_id} v{deployment.version} from {deployment.source} ({role})"
    )


@model_app.command("list")
def model_list() -> None:
    """List the active deployments."""
    from shared import deployments

    rows = [
        [d.model_id, d.version, "stable" if d.is_stable else "", d.max_context_tokens, d.source]
        for d in deployments.list_active(db())
    ]
    print_table(["MODEL", "VERSION", "ROLE", "CONTEXT", "SOURCE"], rows)
