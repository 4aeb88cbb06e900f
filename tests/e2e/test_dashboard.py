"""`/dashboard`: its data behind the admin key, and the page itself in headless Chromium
against the running stack (`make test` installs Debian's `chromium`)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from shared import keys
from shared.latency_window import MAX_NUM_SAMPLES
from tests.helpers import auth, stream

ADMIN_KEY = "test-admin-key-0123456789"  # conftest's LLMFLEET_ADMIN_KEY
CHARTS = ["queue_depth", "ttft", "itl", "kv_cache_usage", "batch_occupancy"]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",  # root in a container
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--window-size=1400,1100",
    "--remote-debugging-port=0",  # DevTools on a free port, written to DevToolsActivePort
]
MIN_NUM_POINTS = 6  # six polls (about six seconds of live data), six points in each chart


@pytest.fixture
def traffic(api_url, tiny_worker, tiny_deployment, make_tenant, rdb):
    """A few finished requests, so the latency window and the queues have data."""
    tenant_id, key = make_tenant("dash")
    model = tiny_deployment.model_id
    ttft_key = keys.latency_samples(tiny_deployment.name, "ttft")
    num_before = rdb.llen(ttft_key)
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True}
    for _ in range(3):
        assert stream(api_url, "/v1/completions", key, body).has_done
    deadline = time.monotonic() + 10  # the worker pushes its samples once a second
    while rdb.llen(ttft_key) < min(num_before + 3, MAX_NUM_SAMPLES):
        assert time.monotonic() < deadline, "no latency samples from the worker"
        time.sleep(0.1)
    return tenant_id, key


def test_dashboard_data_needs_the_admin_key(api_url, traffic, tiny_deployment):
    _, tenant_key = traffic
    url = f"{api_url}/dashboard/data"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers=auth(tenant_key)).status_code == 401
    assert httpx.get(url, headers=auth(ADMIN_KEY + "x")).status_code == 401
    data = httpx.get(url, headers=auth(ADMIN_KEY)).json()
    (model,) = [m for m in data["models"] if m["model"] == tiny_deployment.model_id]
    assert model["ttft_s"]["num_samples"] >= 3 and model["ttft_s"]["p99"] > 0
    assert model["itl_s"]["p50"] > 0
    assert 0 <= model["kv_cache_usage"] <= 1 and 0 <= model["batch_occupancy"] <= 1
    assert any(q["tenant"].startswith("dash-") for q in model["queues"])
    assert all(w["max_num_seqs"] == 8 for w in model["workers"])


def test_dashboard_page_is_a_self_contained_shell(api_url):
    page = httpx.get(f"{api_url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/dashboard/data" in page.text
    assert not re.search(
        r"""(src|href)=["']?(https?:)?//""", page.text
    )  # nothing fetched elsewhere
    assert ADMIN_KEY not in page.text


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (`make test` installs Debian's package)")
    return path


class DevTools:
    """Just enough of the Chrome DevTools protocol: one page, commands answered in order."""

    def __init__(self, chromium: str, profile: Path) -> None:
        self.process = subprocess.Popen(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            assert time.monotonic() < deadline and self.process.poll() is None, "no DevTools"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        # Entered as a context manager, as websockets asks (a bare connect() is deprecated),
        # and left in close().
        self._connection = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        self.ws = self._connection.__enter__()
        self._next_id = 0

    def call(self, method: str, **params) -> dict:
        self._next_id += 1
        self.ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=30))
            if message.get("id") == self._next_id:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def close(self) -> None:
        self._connection.__exit__(None, None, None)
        self.process.terminate()
        self.process.wait(30)


@pytest.fixture
def devtools(tmp_path) -> Iterator[DevTools]:
    browser = DevTools(_chromium(), tmp_path / "chromium-profile")
    yield browser
    browser.close()


@pytest.fixture
def background_load(api_url, tiny_deployment, traffic):
    """Bursts of concurrent requests while the page watches, so the lines move."""
    _, key = traffic
    body = {"model": tiny_deployment.model_id, "prompt": "Tell me", "max_tokens": 24}
    stop = threading.Event()

    def bursts() -> None:
        while not stop.is_set():
            burst = [
                threading.Thread(target=stream, args=(api_url, "/v1/completions", key, body))
                for _ in range(10)
            ]
            for thread in burst:
                thread.start()
            for thread in burst:
                thread.join()
            stop.wait(0.3)

    runner = threading.Thread(target=bursts, daemon=True)
    runner.start()
    yield
    stop.set()
    runner.join(60)


# Safe while the page is still loading (about:blank first): missing parts read as nothing.
CHART_POINTS_JS = """JSON.stringify({
  polls: Number(document.body?.dataset.polls ?? 0),
  state: document.getElementById("state")?.dataset.state,
  points: Object.fromEntries([...document.querySelectorAll(".chart")].map(
    (el) => [el.dataset.chart, Number(el.dataset.points)])),
})"""


def test_dashboard_charts_fill_in_headless_chromium(api_url, background_load, devtools, tmp_path):
    devtools.call("Page.enable")
    devtools.call("Page.navigate", url=f"{api_url}/dashboard#key={ADMIN_KEY}")
    deadline = time.monotonic() + 60
    while True:  # the page polls once a second; wait for enough of its points
        seen = json.loads(devtools.evaluate(CHART_POINTS_JS))
        if seen["polls"] >= MIN_NUM_POINTS and min(seen["points"].values()) >= MIN_NUM_POINTS:
            break
        assert time.monotonic() < deadline, seen
        time.sleep(0.5)
    assert seen["state"] == "live" and seen["polls"] >= MIN_NUM_POINTS
    assert set(seen["points"]) == set(CHARTS)
    html = devtools.evaluate("document.documentElement.outerHTML")
    assert re.search(r'<td class="l">tiny-llama@1</td><td class="l">ready</td>', html)
    assert ADMIN_KEY not in devtools.evaluate("location.href")  # the fragment is cleared

    png = base64.b64decode(devtools.call("Page.captureScreenshot", format="png")["data"])
    screenshot = tmp_path / "dashboard.png"
    screenshot.write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 20_000  # charts drawn, not a blank page
