"""`infra/`: the Prometheus config and rules (promtool, when installed: `make test` installs
it), the Grafana dashboard and the KEDA example, all checked against the metrics llmfleet
defines."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from api import admin
from api.admin_autoscale import get_autoscale
from shared.fleet import FleetSnapshot, ModelSnapshot, QueueState, RolloutView, WorkerState
from shared.latency_window import LatencySummary
from shared.metrics import ApiMetrics, FleetCollector, WorkerMetrics
from shared.scale_decisions import ScaleView

INFRA = Path(__file__).resolve().parent.parent / "infra"
PROMETHEUS = INFRA / "prometheus"
SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}


def _defined_metrics() -> set[str]:
    """Every series name llmfleet exports, as PromQL sees it."""
    none = LatencySummary(0, None, None)
    snap = ModelSnapshot(
        "m",
        [QueueState("t", 1, 0, 1)],
        [WorkerState("w", "m", "ready", 0)],
        none,
        none,
        scale=ScaleView("predictive", 1, 0, 1.0, 1.0, 1.0, 1.0, 0, 0.0),
    )
    families = [
        *WorkerMetrics().registry.collect(),
        *ApiMetrics().registry.collect(),
        *FleetCollector(
            FleetSnapshot(0.0, {"m@1": snap}, rollouts=[RolloutView("m", "2", "running", 10)])
        ).collect(),
    ]
    names = set()
    for family in families:
        names.add(family.name)
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ()))
    return names


def _series_names(expr: str) -> set[str]:
    """Metric and recording-rule names an expression reads (quoted label values dropped)."""
    unquoted = re.sub(r'"[^"]*"', '""', expr)
    return {t for t in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", unquoted) if "llmfleet" in t}


def _rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_rules_read_only_metrics_that_exist():
    known = _defined_metrics() | {r["record"] for r in _rules() if "record" in r}
    alerts = [r for r in _rules() if "alert" in r]
    for rule in _rules():
        assert _series_names(rule["expr"]) <= known, rule
    assert {a["labels"]["severity"] for a in alerts} <= {"page", "warning"}
    assert all(a["annotations"]["summary"] for a in alerts)
    # the seed's table, one alert each
    assert {
        "LlmfleetTTFTP99AboveTarget",
        "LlmfleetITLP99Rising",
        "LlmfleetBatchUtilisationLow",
        "LlmfleetKVCachePressure",
        "LlmfleetTenantQueueGrowingFaster",
    } <= {a["alert"] for a in alerts}


def test_scrape_config_names_the_rules_and_both_jobs():
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"llmfleet-api", "llmfleet-worker"}
    # the API's /metrics always needs its token
    assert jobs["llmfleet-api"]["authorization"]["credentials_file"]


def _config_with_token_file(tmp_path: Path) -> Path:
    """A copy of infra/prometheus whose credentials file exists (promtool checks that it does)."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    token = tmp_path / "metrics-token"
    token.write_text("t" * 32)
    for job in config["scrape_configs"]:
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(token)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    return tmp_path


def test_grafana_dashboard_queries_metrics_that_exist():
    dashboard = json.loads((INFRA / "grafana" / "llmfleet-dashboard.json").read_text())
    known = _defined_metrics()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 16
    for expr in exprs:
        assert _series_names(expr) and _series_names(expr) <= known, expr
    titles = " ".join(panel["title"] for panel in dashboard["panels"])
    for figure in ["Queue depth", "first token", "Inter-token", "KV-cache", "Batch occupancy"]:
        assert figure in titles
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_keda_baseline_scales_workers_on_queue_depth():
    scaled = yaml.safe_load((INFRA / "keda" / "scaledobject-queue-depth.yaml").read_text())
    assert scaled["kind"] == "ScaledObject" and scaled["apiVersion"].startswith("keda.sh/")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert _series_names(trigger["metadata"]["query"]) == {"llmfleet_queue_depth"}
    assert int(trigger["metadata"]["threshold"]) > 0


def test_keda_scales_workers_on_the_autoscalers_decision():
    docs = list(yaml.safe_load_all((INFRA / "keda" / "scaledobject.yaml").read_text()))
    scaled, auth = docs
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "metrics-api" and trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    # The route the admin API serves, the field it answers with, one pod per unit.
    path = urlparse(meta["url"]).path
    (mount,) = admin.routes
    assert path.startswith(mount.path + "/")
    (route,) = [r for r in mount.routes if getattr(r, "endpoint", None) is get_autoscale]
    assert route.path_regex.fullmatch(path[len(mount.path) :])
    assert meta["valueLocation"] == "num_workers" and float(meta["targetValue"]) == 1
    assert meta["authMode"] == "bearer"
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert auth["kind"] == "TriggerAuthentication"
    assert [p["parameter"] for p in auth["spec"]["secretTargetRef"]] == ["token"]


@pytest.mark.parametrize("name", ["scaledobject.yaml", "scaledobject-queue-depth.yaml"])
def test_keda_manifests_match_kedas_schema(name, tmp_path):
    tool = Path(sys.executable).parent.parent / "keda-schema"
    node = shutil.which("node")
    if node is None or not (tool / "node_modules" / "@kubernetes-models" / "keda").is_dir():
        pytest.skip("KEDA's schemas not installed (`make keda-schema`, needs node and npm)")
    # An ES module resolves its imports next to itself: run a copy inside the install.
    script = tool / "keda_validate.mjs"
    shutil.copyfile(Path(__file__).parent / "keda_validate.mjs", script)
    result = subprocess.run(
        [node, str(script), str(INFRA / "keda" / name)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "valid" in result.stdout
    # The check can fail: the same manifest with a string where KEDA wants a number.
    broken = tmp_path / name
    broken.write_text(
        (INFRA / "keda" / name).read_text().replace("maxReplicaCount: 8", 'maxReplicaCount: "8"')
    )
    result = subprocess.run(
        [node, str(script), str(broken)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "maxReplicaCount must be integer" in result.stdout


def _promtool() -> str | None:
    return shutil.which("promtool") or shutil.which(
        "promtool", path=str(Path(sys.executable).parent)
    )


@pytest.mark.parametrize(
    "args",
    [
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],
    ],
    ids=["check-config", "check-rules", "test-rules"],
)
def test_promtool(args, tmp_path):
    promtool = _promtool()
    if promtool is None:
        pytest.skip("promtool not installed (`make promtool` extracts it from Debian's prometheus)")
    cwd = _config_with_token_file(tmp_path) if args[:2] == ["check", "config"] else PROMETHEUS
    result = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
