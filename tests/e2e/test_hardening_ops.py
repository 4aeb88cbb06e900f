"""Operations hardening: `/metrics` behind its token and without tenant names, security
headers on every answer and a strict CSP on `/dashboard` (checked in headless Chromium), and
a home directory only its user can read."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from cli.redis_server import EmbeddedRedis, free_port
from tests.e2e.test_dashboard import ADMIN_KEY, DevTools, _chromium
from tests.helpers import auth, llmfleet, stream

# The usual umask: what the processes must not rely on to keep their files private.
OPEN_UMASK = 0o022


def _scrape(url: str, token: str | None) -> httpx.Response:
    return httpx.get(f"{url}/metrics", headers=auth(token) if token else None, timeout=10)


# --- /metrics -------------------------------------------------------------------------------


def test_metrics_needs_the_generated_token_by_default(api_url, settings, make_tenant):
    assert settings.metrics_token is None  # conftest sets none: the generated one is in force
    _, tenant_key = make_tenant("scraper")
    for token in [None, "x" * 32, tenant_key, ADMIN_KEY]:
        refused = _scrape(api_url, token)
        assert refused.status_code == 401, token
        assert refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["type"] == "authentication_error"
        assert "llmfleet_" not in refused.text
    token_file = settings.metrics_token_path
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    allowed = _scrape(api_url, token_file.read_text().strip())
    assert allowed.status_code == 200 and "llmfleet_request_rejections" in allowed.text


def test_metrics_token_from_the_environment_replaces_the_generated_one(start_api, settings):
    token = "configured-metrics-token-0123"
    api = start_api({"LLMFLEET_METRICS_TOKEN": token})
    assert _scrape(api.url, token).status_code == 200
    assert _scrape(api.url, settings.metrics_secret).status_code == 401


def test_metrics_label_tenants_by_id_never_by_name(
    api_url, tiny_worker, tiny_deployment, make_tenant, settings
):
    tenant_id, key = make_tenant("secret-customer")
    body = {"model": tiny_deployment.model_id, "prompt": "Hello", "max_tokens": 2}
    assert stream(api_url, "/v1/completions", key, body).has_done
    text = _scrape(api_url, settings.metrics_secret).text
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    for name in ["llmfleet_queue_depth", "llmfleet_queue_pending"]:
        (sample,) = [s for s in families[name] if s.labels.get("tenant") == tenant_id]
        assert set(sample.labels) == {"model", "version", "tenant"}
    assert "secret-customer" not in text and "tenant_name" not in text


# --- security headers -------------------------------------------------------------------------

BASE_HEADERS = {"x-content-type-options": "nosniff", "x-frame-options": "DENY"}


def _csp(response: httpx.Response) -> dict[str, list[str]]:
    directives = [d.split() for d in response.headers["content-security-policy"].split(";")]
    return {d[0]: d[1:] for d in directives if d}


def test_every_answer_forbids_sniffing_and_framing(api_url, tiny_deployment, make_tenant):
    _, key = make_tenant("headers")
    body = {"model": tiny_deployment.model_id, "prompt": "Hi", "max_tokens": 2}
    answers = [
        httpx.get(f"{api_url}/healthz"),
        httpx.get(f"{api_url}/v1/models"),  # 401
        httpx.get(f"{api_url}/v1/models", headers=auth(key)),
        httpx.post(f"{api_url}/v1/completions", content=b"{", headers=auth(key)),  # 400
        httpx.get(f"{api_url}/no-such-path"),  # 404
        httpx.get(f"{api_url}/metrics"),  # 401
        httpx.get(f"{api_url}/admin/v1/tenants"),  # 401
        httpx.get(f"{api_url}/dashboard/data"),  # 401
    ]
    for response in answers:
        assert BASE_HEADERS.items() <= response.headers.items(), response.url
        assert _csp(response) == {"default-src": ["'none'"], "frame-ancestors": ["'none'"]}
        assert response.headers["referrer-policy"] == "no-referrer"
    assert {r.status_code for r in answers} == {200, 400, 401, 404}
    sse = stream(api_url, "/v1/completions", key, body)
    assert sse.status_code == 200 and BASE_HEADERS.items() <= sse.headers.items()


def _inline_hashes(html: str, tag: str) -> list[str]:
    bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
    return [
        f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'" for b in bodies
    ]


def test_dashboard_page_allows_only_its_own_script_style_and_origin(api_url):
    page = httpx.get(f"{api_url}/dashboard")
    assert page.status_code == 200 and BASE_HEADERS.items() <= page.headers.items()
    csp = _csp(page)
    assert csp["default-src"] == ["'none'"] and csp["frame-ancestors"] == ["'none'"]
    assert csp["script-src"] == _inline_hashes(page.text, "script") != []
    assert csp["style-src"] == _inline_hashes(page.text, "style") != []
    assert csp["connect-src"] == ["'self'"]
    assert csp["base-uri"] == csp["form-action"] == ["'none'"]
    assert "'unsafe-inline'" not in page.headers["content-security-policy"]


# Installed before the page's own script runs: every CSP violation the page meets is kept.
RECORD_VIOLATIONS_JS = """window.__violations = [];
document.addEventListener("securitypolicyviolation",
  (e) => window.__violations.push(e.effectiveDirective + " " + e.blockedURI));"""
INJECT_JS = """(() => {
  const script = document.createElement("script");
  script.textContent = "window.__injected = true";
  document.body.append(script);
  const img = document.createElement("img");
  img.src = "https://example.com/pixel.png";
  document.body.append(img);
  return window.__injected === true;
})()"""


def test_dashboard_works_under_its_csp_and_blocks_injected_code(api_url, tmp_path):
    browser = DevTools(_chromium(), tmp_path / "chromium-profile")
    try:
        browser.call("Page.enable")
        browser.call("Page.addScriptToEvaluateOnNewDocument", source=RECORD_VIOLATIONS_JS)
        browser.call("Page.navigate", url=f"{api_url}/dashboard#key={ADMIN_KEY}")
        deadline = time.monotonic() + 60
        while browser.evaluate("Number(document.body?.dataset.polls ?? 0)") < 3:
            assert time.monotonic() < deadline, "the page's script does not poll"
            time.sleep(0.3)
        assert browser.evaluate('document.getElementById("state").dataset.state') == "live"
        header_style = 'getComputedStyle(document.querySelector("header")).display'
        assert browser.evaluate(header_style) == "flex"  # the inline style applies
        assert browser.evaluate("window.__violations") == []
        assert browser.evaluate(INJECT_JS) is False  # the injected script did not run
        time.sleep(0.5)  # violation events are dispatched asynchronously
        violations = " ".join(browser.evaluate("window.__violations"))
        assert "script-src" in violations and "img-src" in violations, violations
    finally:
        browser.close()


# --- file permissions -------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _readable_by_others(home: Path) -> list[str]:
    return [
        f"{path.relative_to(home)} {oct(_mode(path))}"
        for path in [home, *home.rglob("*")]
        if _mode(path) & 0o077
    ]


def test_embedded_redis_keeps_its_aof_and_log_private(tmp_path):
    home = tmp_path / "fresh" / "home"
    server = EmbeddedRedis(home / "redis", port=free_port()).start()
    try:
        client = redis.Redis.from_url(server.url)
        client.set("k", "a queued prompt")
        client.close()
    finally:
        server.stop()
    assert _mode(home) == _mode(home / "redis") == 0o700
    assert _mode(home / "redis" / "appendonly.aof") == 0o600
    assert _mode(home / "redis" / "redis.log") == 0o600
    assert _readable_by_others(home) == []


@pytest.fixture
def fresh_home_env(tmp_path, tiny_model_dir) -> dict[str, str]:
    """The environment of a platform in a home of its own, with the tiny model registered."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    env.update(LLMFLEET_HOME_DIR=str(tmp_path / "home"), LLMFLEET_API_PORT=str(free_port()))
    added = llmfleet(env, "model", "add", "tiny", "--source", str(tiny_model_dir), umask=OPEN_UMASK)
    assert added.returncode == 0, added.stderr
    return env


def test_the_database_is_created_private_by_any_command(fresh_home_env, tmp_path):
    home = tmp_path / "home"
    assert _mode(home) == 0o700
    assert _mode(home / "llmfleet.db") == 0o600
    assert _readable_by_others(home) == []


def test_up_keeps_the_whole_home_private(fresh_home_env, tmp_path):
    home = tmp_path / "home"
    out_path = tmp_path / "up.out"
    with out_path.open("wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "cli", "up", "--model", "tiny"],
            env=fresh_home_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            umask=OPEN_UMASK,
        )
    try:
        deadline = time.monotonic() + 180
        while "llmfleet is up" not in out_path.read_text():
            assert up.poll() is None and time.monotonic() < deadline, out_path.read_text()
            time.sleep(0.2)
        text = out_path.read_text()
        url = re.search(r"llmfleet is up at (\S+)", text).group(1)
        key = re.search(r"development API key: (lf-\S+)", text).group(1)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        assert stream(url, "/v1/completions", key, body).has_done
        # While everything runs: the database and its WAL, the AOF, logs, secrets, metrics.
        for name in ["llmfleet.db", "redis/appendonly.aof", "logs/api.log", "secrets/dev_api_key"]:
            assert _mode(home / name) == 0o600, name
        assert {p.name for p in (home / "logs").iterdir()} >= {"api.log", "worker-0.log"}
        assert _readable_by_others(home) == []
        # `up` generated the metrics token before the API started, and says where it is.
        token_path = home / "secrets" / "metrics_token"
        assert str(token_path) in text
        assert _scrape(url, token_path.read_text().strip()).status_code == 200
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    assert _readable_by_others(home) == []


def test_an_existing_open_home_is_closed(tmp_path, env):
    home = tmp_path / "old-home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    result = llmfleet({**env, "LLMFLEET_HOME_DIR": str(home)}, "model", "list", umask=OPEN_UMASK)
    assert result.returncode == 0, result.stderr
    assert _mode(home) == 0o700
    assert _readable_by_others(home) == []


def test_an_api_started_on_its_own_keeps_its_metrics_values_private(start_api, home, settings):
    """Not under `llmfleet up` (honcho, systemd, this test's umask 022): the API's
    multiprocess metric files are still its owner's only."""
    previous = os.umask(0o022)
    try:
        api = start_api()
    finally:
        os.umask(previous)
    port = api.url.rsplit(":", 1)[1]
    # A refused request counts a rejection: its value file is written.
    assert httpx.get(f"{api.url}/v1/models", headers=auth("lf-wrong")).status_code == 401
    token = settings.metrics_secret
    assert (
        "llmfleet_request_rejections" in httpx.get(f"{api.url}/metrics", headers=auth(token)).text
    )
    values = home / "metrics" / f"api-{port}"
    assert stat.S_IMODE(values.stat().st_mode) & 0o077 == 0
    files = list(values.iterdir())
    assert files
    assert all(stat.S_IMODE(path.stat().st_mode) & 0o077 == 0 for path in files)
