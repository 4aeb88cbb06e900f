"""Commands that live above the command line's layer, registered by name: `llmfleet bench`.

The benchmark (`bench/`) drives the local stack this package starts (`cli/up.py`, the
embedded Redis), so it imports `cli`; for `cli` to offer `llmfleet bench` without importing
it back, the benchmark declares its command as an entry point of the group
`llmfleet.commands` (pyproject.toml), and the command line loads each one when it runs.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import typer

GROUP = "llmfleet.commands"


def register(app: typer.Typer) -> None:
    """Add every command of the entry-point group to `app`, under its entry point's name."""
    for entry_point in entry_points(group=GROUP):
        app.command(entry_point.name)(entry_point.load())
