"""`llmfleet autoscale ...` (bench/autoscale_command.py), offered through the entry point of
the group `llmfleet.commands` (cli/plugins.py): it simulates a tiny trace, plain or gzipped,
sweeps the warm pool and the parameters, and writes a trace or a window of one."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from bench import autoscale_traces as traces
from bench.autoscale_traces import Shape, requests_of
from cli.main import app
from control.scale_policy import POLICY_NAMES

ALL = [*POLICY_NAMES, "oracle", "fixed-peak"]


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.csv.gz"
    traces.write_trace(path, requests_of(Shape(120.0, lambda t: 3.0), random.Random(0)))
    return path


def _invoke(*args: str):
    result = CliRunner().invoke(app, ["autoscale", *args])
    assert result.exit_code == 0, result.output
    return result


def test_it_simulates_a_gzipped_trace_and_writes_the_report_and_the_plot(tiny, tmp_path):
    out, plot = tmp_path / "tiny.json", tmp_path / "tiny.svg"
    result = _invoke(
        "simulate", "--trace", str(tiny), "--cold-start-s", "60", "--json", str(out),
        "--plot", str(plot),
    )  # fmt: skip
    assert "predictive+warm" in result.output and "fixed-peak" in result.output
    report = json.loads(out.read_text())
    assert list(report["results"]) == ALL
    assert report["config"]["cold_start_s"] == 60
    assert all(r["is_each_request_served_once"] for r in report["results"].values())
    assert plot.read_text().startswith("<svg") and plot.read_text().count("<polyline") == 5
    refused = CliRunner().invoke(app, ["autoscale", "simulate", "--trace", str(tiny),
                                       "--policy", "psychic"])  # fmt: skip
    assert refused.exit_code != 0


def test_it_sweeps_the_warm_pool(tiny, tmp_path):
    out = tmp_path / "pools.json"
    result = _invoke("pool-sweep", "--trace", str(tiny), "--sizes", "0,2", "--json", str(out))
    assert "warm pool 2" in result.output
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["oracle", "fixed-peak", "reactive", "predictive", "warm pool 0",
                             "warm pool 2"]  # fmt: skip
    assert results["warm pool 2"]["worker_hours"] > results["warm pool 0"]["worker_hours"]


def test_it_tunes_on_every_trace_together(tiny, tmp_path):
    other = tmp_path / "other.csv"
    traces.write_trace(other, requests_of(Shape(120.0, lambda t: 6.0), random.Random(1)))
    out = tmp_path / "tune.json"
    result = _invoke("tune", "--trace", str(tiny), "--trace", str(other), "--json", str(out))
    assert "base" in result.output
    report = json.loads(out.read_text())
    assert set(report["traces"]) == {"tiny.csv.gz", "other.csv"}
    assert all(set(row["results"]) == {"tiny.csv.gz", "other.csv"} for row in report["variants"])


def test_it_writes_a_trace_or_a_window_of_one(tmp_path):
    written = tmp_path / "ramp.csv"
    _invoke("trace", "--kind", "ramp", "--seed", "3", "--out", str(written))
    assert traces.read_trace(written) == traces.generate("ramp", seed=3)
    windowed = tmp_path / "ramp-window.csv.gz"
    _invoke("trace", "--kind", "ramp", "--seed", "3", "--start-s", "600", "--end-s", "660",
            "--out", str(windowed))  # fmt: skip
    expected = traces.window(traces.generate("ramp", seed=3), 600.0, 660.0)
    assert traces.read_trace(windowed) == expected and expected
