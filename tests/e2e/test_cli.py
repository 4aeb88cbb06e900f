"""The `llmfleet` command line, run as a user would."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import httpx

from tests.helpers import auth, llmfleet

ROOT = Path(__file__).resolve().parents[2]


def test_tenant_create_prints_a_working_key_once(env, api_url, settings):
    name = f"cli-{uuid.uuid4().hex[:6]}"
    result = llmfleet(env, "tenant", "create", name)
    assert result.returncode == 0, result.stderr
    key = re.search(r"(lf-\S+)", result.stdout).group(1)
    assert httpx.get(f"{api_url}/v1/models", headers=auth(key)).status_code == 200
    # the key appears nowhere in the database file
    db_bytes = b"".join(p.read_bytes() for p in settings.home.glob("llmfleet.db*"))
    assert key.encode() not in db_bytes
    again = llmfleet(env, "tenant", "create", name)
    assert again.returncode != 0 and "already exists" in again.stderr + again.stdout


def test_model_add_and_list(env, tiny_model_dir):
    model_id = f"cli-model-{uuid.uuid4().hex[:6]}"
    added = llmfleet(
        env, "model", "add", model_id, "--source", str(tiny_model_dir), "--version", "2"
    )
    assert added.returncode == 0, added.stderr
    assert "(stable)" in added.stdout  # the model's first version
    again = llmfleet(env, "model", "add", model_id, "--source", str(tiny_model_dir))
    assert again.returncode == 0 and "not stable" in again.stdout
    listed = llmfleet(env, "model", "list")
    assert re.search(rf"^{model_id} +2 +stable +1024 ", listed.stdout, re.M)
    assert re.search(rf"^{model_id} +1 +1024 ", listed.stdout, re.M)


def test_model_add_rejects_a_bad_source(env, tmp_path):
    result = llmfleet(env, "model", "add", "broken", "--source", str(tmp_path))
    assert result.returncode != 0
    assert "neither" in result.stderr + result.stdout


def test_procfile_is_valid_for_honcho(env):
    result = subprocess.run(
        [sys.executable, "-m", "honcho", "check"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert {"redis", "web", "worker"} <= set(
        re.findall(r"^(\w+):", (ROOT / "Procfile").read_text(), re.M)
    )
