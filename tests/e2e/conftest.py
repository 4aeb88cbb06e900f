"""The end-to-end tests: each starts the platform's processes (API, worker, control, `llmfleet`
commands, Chromium) through the fixtures of tests/conftest.py or its own. All of them carry the
`e2e` marker: `-m "not e2e"` runs the unit tests alone (`make test-unit`)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A conftest's hook sees every collected item, not only this folder's.
    for item in items:
        if item.path.resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)
