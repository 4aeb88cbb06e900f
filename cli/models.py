"""`llmfleet model ...`: model deployments."""

from __future__ import annotations

from typing import Annotated

import typer

from cli.common import db

model_app = typer.Typer(help="Model deployments.", no_args_is_help=True)


@model_app.command("add")
def model_add(
    model_id: str,
    source: Annotated[str, typer.Option(help="smollm2-135m, a .gguf file or a HF model directory")],
    version: Annotated[str, typer.Option()] = "1",
) -> None:
    """Register a model deployment."""
    from shared import deployments

    deployment = deployments.register(db(), model_id, source, version)
    typer.echo(f"deployment {deployment.model_id} v{deployment.version} from {deployment.source}")


@model_app.command("list")
def model_list() -> None:
    """List the active deployments."""
    from shared import deployments

    for d in deployments.list_active(db()):
        typer.echo(f"{d.model_id}\tv{d.version}\t{d.max_context_tokens} ctx\t{d.source}")
