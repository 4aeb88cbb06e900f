"""Commands of the layers above `cli`, registered from their entry points (cli/plugins.py):
a function as a command, a Typer app as a group of commands."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer
from typer.testing import CliRunner

from cli import plugins


@dataclass
class FakeEntryPoint:
    name: str
    value: Any

    def load(self) -> Any:
        return self.value


def test_a_function_is_a_command_and_a_typer_app_a_group(monkeypatch):
    group = typer.Typer()

    @group.command("one")
    def one() -> None:
        typer.echo("group one")

    @group.command("two")
    def two() -> None:
        typer.echo("group two")

    def solo() -> None:
        typer.echo("solo")

    found = [FakeEntryPoint("grouped", group), FakeEntryPoint("solo", solo)]
    monkeypatch.setattr(plugins, "entry_points", lambda group: found)
    app = typer.Typer()
    plugins.register(app)
    runner = CliRunner()
    assert runner.invoke(app, ["grouped", "two"]).output == "group two\n"
    assert runner.invoke(app, ["solo"]).output == "solo\n"


def test_the_platform_offers_bench_and_autoscale_through_their_entry_points():
    from cli.main import app

    runner = CliRunner()
    for name in ("bench", "autoscale"):
        result = runner.invoke(app, [name, "--help"])
        assert result.exit_code == 0, result.output
    assert "pool-sweep" in runner.invoke(app, ["autoscale", "--help"]).output
