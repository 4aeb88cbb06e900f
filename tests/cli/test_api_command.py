"""`llmfleet api`: what it hands uvicorn from the settings."""

from __future__ import annotations

import pytest
import uvicorn
from typer.testing import CliRunner

from cli import main


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("false", False), ("true", True)])
def test_the_access_log_follows_llmfleet_access_log(monkeypatch, tmp_path, value, expected):
    runs: list[dict] = []
    monkeypatch.setattr(uvicorn, "run", lambda *args, **options: runs.append(options))
    monkeypatch.setattr(main, "_private_files", lambda: None)  # no umask for the test process
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setenv("LLMFLEET_HOME_DIR", str(tmp_path))
    if value is None:
        monkeypatch.delenv("LLMFLEET_ACCESS_LOG", raising=False)
    else:
        monkeypatch.setenv("LLMFLEET_ACCESS_LOG", value)
    result = CliRunner().invoke(main.app, ["api", "--port", "1"])
    assert result.exit_code == 0, result.output
    [options] = runs
    assert options["access_log"] is expected
