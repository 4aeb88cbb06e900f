"""Commands that live above the command line's layer, registered by name: `llmfleet bench`,
`llmfleet autoscale`.

The benchmark (`bench/`) drives the local stack this package starts (`cli/up.py`, the
embedded Redis), so it imports `cli`; for `cli` to offer `llmfleet bench` without importing
it back, the benchmark declares its commands as entry points of the group
`llmfleet.commands` (pyproject.toml), and the command line loads each one when it runs: a
function becomes a command, a `typer.Typer` a group of commands.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import typer

GROUP = "llmfleet.commands"


def register(app: typer.Typer) -> None:
    """Add every entry point of the group to `app` under its name: a Typer app as a group of
    commands, anything else as one command."""
    for entry_point in entry_points(group=GROUP):
        loaded = entry_point.load()
        if isinstance(loaded, typer.Typer):
            app.add_typer(loaded, name=entry_point.name)
        else:
            app.command(entry_point.name)(loaded)
