"""Fixtures of the chaos suite: the tiny model built once, a fresh platform per scenario, and
the summary table, printed at the end of every run (and written under pytest's tmp dir)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tiny_model
from tests.chaos.checks import SUMMARY_HEADER
from tests.chaos.harness import Stack

SUMMARY_KEY = pytest.StashKey[list[str]]()
HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every scenario starts a platform of its own: they are end-to-end tests (`e2e`), like
    those of tests/e2e/. A conftest's hook sees every collected item, not only this folder's."""
    for item in items:
        if item.path.resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def chaos_model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chaos-model")
    return tiny_model.build(root / "tiny", root / "cache")


@pytest.fixture
def chaos_stack(tmp_path, chaos_model_dir) -> Iterator:
    """Factory: start a platform of this scenario's own (its processes with extra environment)."""
    stacks: list[Stack] = []

    def factory(extra_env: dict[str, str] | None = None, **options) -> Stack:
        stack = Stack(tmp_path, chaos_model_dir, extra_env=extra_env or {}, **options)
        stacks.append(stack)
        return stack.start()

    yield factory
    for stack in stacks:
        stack.stop()


@pytest.fixture
def chaos_report(request, tmp_path_factory):
    """Record a scenario's summary line: printed (`-s`), kept for the terminal summary, and
    appended to `<pytest tmp dir>/chaos-summary.txt`."""
    path = tmp_path_factory.getbasetemp() / "chaos-summary.txt"

    def report(line: str) -> None:
        print(f"\n{SUMMARY_HEADER}\n{line}")
        request.config.stash.setdefault(SUMMARY_KEY, []).append(line)
        with path.open("a") as f:
            f.write(line + "\n")

    return report


def pytest_terminal_summary(terminalreporter, config) -> None:
    lines = config.stash.get(SUMMARY_KEY, [])
    if lines:
        terminalreporter.section("chaos summary")
        for line in [SUMMARY_HEADER, *lines]:
            terminalreporter.write_line(line)
