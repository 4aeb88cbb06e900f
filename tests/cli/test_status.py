"""`llmfleet status`: the fleet snapshot as tables, from a constructed snapshot (against the
running stack: tests/e2e/test_status.py)."""

from __future__ import annotations

from rich.console import Console

from cli.status import (
    autoscale_table,
    models_table,
    processes_table,
    queues_table,
    workers_table,
)
from shared.fleet import FleetSnapshot, ModelSnapshot, QueueState, WorkerState
from shared.latency_window import LatencySummary
from shared.scale_decisions import ScaleView
from shared.supervised import ProcessState


def _render(*tables) -> str:
    console = Console(record=True, width=200)
    for table in tables:
        console.print(table)
    return console.export_text()


def test_tables_show_queues_workers_and_latencies():
    worker = WorkerState(
        "host-1-abc", "m", "ready", 1.25, num_running=3, num_waiting=1, kv_cache_usage=0.5,
        max_num_seqs=4, num_preemptions=2,
    )  # fmt: skip
    snap = ModelSnapshot(
        "m",
        [QueueState("ten_1", num_entries=7, num_pending=3, num_consumers=2)],
        [worker],
        LatencySummary(10, 0.1234, 0.9),
        LatencySummary(40, 0.02, 0.05),
    )
    fleet = FleetSnapshot(0.0, {"m": snap}, {"ten_1": "acme"})
    text = _render(models_table(fleet, 60), workers_table(fleet), queues_table(fleet))
    assert "Models (latency over the last 60 s)" in text
    model_row = next(line for line in text.splitlines() if "│ m " in line and "1/1" in line)
    for cell in ["1/1", "50.0%", "75.0%", "123.4 ms", "900.0 ms", "20.0 ms", "50.0 ms", "10/40"]:
        assert cell in model_row
    worker_row = next(line for line in text.splitlines() if "host-1-abc" in line)
    assert all(cell in worker_row for cell in ["ready", "50.0%", "1.2 s"])
    queue_row = next(line for line in text.splitlines() if "acme" in line)
    assert [c for c in queue_row.replace("│", " ").split()][-4:] == ["7", "3", "4", "2"]


def test_the_processes_up_supervises_show_their_restarts():
    processes = [
        ProcessState("api", "running", 41, 0, None, 990.0),
        ProcessState("worker-1", "running", 77, 3, "signal SIGKILL", 700.0, metrics_port=9301),
        ProcessState("worker-0", "restarting", None, 1, "exit 1", None, metrics_port=9300),
    ]
    text = _render(processes_table(FleetSnapshot(1000.0, {}, {}, processes)))
    assert "Processes (supervised by `llmfleet up`)" in text
    rows = {line.split()[1]: line.replace("│", " ").split() for line in text.splitlines()
            if line.startswith("│ ")}  # fmt: skip
    assert rows["api"] == ["api", "running", "41", "0", "-", "10", "s", "-"]
    assert rows["worker-1"] == ["worker-1", "running", "77", "3", "signal", "SIGKILL", "5", "min",
                                "9301"]  # fmt: skip
    assert rows["worker-0"] == ["worker-0", "restarting", "-", "1", "exit", "1", "-", "9300"]


def test_the_autoscalers_decision_is_shown_for_the_versions_it_decides():
    none = LatencySummary(0, None, None)
    view = ScaleView("predictive+warm", 3, 1, 912.4, 2.5, 750.2, 400.0, 12, 0.0)
    decided = ModelSnapshot("m", [], [], none, none, version="2", scale=view)
    fleet = FleetSnapshot(0.0, {"m@2": decided, "n@1": ModelSnapshot("n", [], [], none, none)})
    text = _render(autoscale_table(fleet))
    assert "Autoscaling" in text
    rows = [line.replace("│", " ").split() for line in text.splitlines() if line.startswith("│ ")]
    assert rows == [["m@2", "predictive+warm", "3", "1", "750", "912", "400", "12"]]
