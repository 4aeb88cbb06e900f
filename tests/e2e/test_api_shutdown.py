"""SIGTERM of an API process with open streams (`api/shutdown.py`): it fails readiness at
once and keeps liveness, refuses new requests, lets a stream that finishes within the grace
end normally, ends a longer one with `api_shutdown` and `[DONE]` (no stream is cut), and
that request, not cancelled, resumes on another API process with everything after the last
event its client got. Real API, Redis and worker processes.

The long request's worker is stopped (SIGSTOP) once the stream is under way, so that it
outlasts the grace on any machine; the API's heartbeat timeout is raised so that the
stopped worker is not taken for dead meanwhile."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared import deployments, keys
from tests.helpers import (
    StreamRead,
    assert_error,
    auth,
    journal_text,
    read_stream,
    stream,
    wait_for_usage_record,
)

GRACE_S = 10
LONG_MAX_TOKENS = 300
SHORT_MAX_TOKENS = 16


@pytest.fixture
def long_deployment(db, tiny_model_dir):
    return deployments.register(db, "tiny-llama-api-shutdown", str(tiny_model_dir))


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_sigterm_drains_streams_and_the_rest_resumes_on_another_api(
    start_api,
    api_url,
    start_worker,
    long_deployment,
    tiny_worker,
    tiny_deployment,
    make_tenant,
    db,
    rdb,
    home,
):
    api = start_api(
        {"LLMFLEET_SHUTDOWN_GRACE_S": str(GRACE_S), "LLMFLEET_WORKER_HEARTBEAT_TIMEOUT_S": "120"}
    )
    long_worker = start_worker(long_deployment.model_id, "--dtype", "float32")
    tenant_id, key = make_tenant("api-shutdown")
    long_body = {
        "model": long_deployment.model_id,
        "prompt": "go",
        "max_tokens": LONG_MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    short_body = {**long_body, "model": tiny_deployment.model_id, "max_tokens": SHORT_MAX_TOKENS}
    long, short = StreamRead(), StreamRead()
    try:
        with ThreadPoolExecutor(3) as pool:
            reading_long = pool.submit(read_stream, api.url, key, long_body, long)
            assert long.started.wait(60)
            _wait_for(lambda: len(long.ids) >= 5, 60, "the long stream stalled")
            long_worker.send_signal(signal.SIGSTOP)
            # A non-streamed request, queued behind the stopped worker.
            collecting = pool.submit(
                httpx.post,
                f"{api.url}/v1/completions",
                json={**long_body, "stream": False},
                headers=auth(key),
                timeout=120,
            )
            queue = keys.tenant_stream(
                keys.deployment_name(long_deployment.model_id, long_deployment.version), tenant_id
            )
            _wait_for(lambda: rdb.xlen(queue) == 2, 30, "the non-streamed one not queued")
            reading_short = pool.submit(read_stream, api.url, key, short_body, short)
            assert short.started.wait(60)
            api.process.send_signal(signal.SIGTERM)
            signalled_at = time.monotonic()

            _wait_for(lambda: httpx.get(f"{api.url}/readyz").status_code == 503, 2, "still ready")
            assert httpx.get(f"{api.url}/healthz").status_code == 200
            refused = httpx.post(
                f"{api.url}/v1/completions", json=short_body, headers=auth(key), timeout=30
            )
            assert_error(refused, 503, "shutting_down")
            assert int(refused.headers["retry-after"]) >= 1

            reading_short.result(timeout=GRACE_S + 30)
            reading_long.result(timeout=GRACE_S + 30)
            collected = collecting.result(timeout=GRACE_S + 30)
            ended_at = time.monotonic()
        assert api.process.wait(timeout=30) is not None
    finally:
        long_worker.send_signal(signal.SIGCONT)

    # The short stream finished within the grace, as if nothing happened.
    assert short.has_done and not short.errors and short.finish_reason == "length"
    # The long one waited out the grace, then got the error event, then [DONE]: not cut.
    assert ended_at - signalled_at >= GRACE_S - 1
    assert long.has_done and not long.is_cut and long.finish_reason is None
    [error] = long.errors
    assert error["code"] == "api_shutdown" and error["request_id"] == long.request_id
    assert error["last_event_id"] == str(long.ids[-1])
    # The non-streamed one: 503 naming its request, which runs on.
    body = assert_error(collected, 503, "api_shutdown")
    collected_id = collected.headers["x-request-id"]
    assert collected_id in body["message"]

    # Resumed on another API process: the rest, and its end.
    rest = stream(
        api_url,
        f"/v1/requests/{long.request_id}/events",
        key,
        {},
        method="GET",
        headers={"Last-Event-ID": error["last_event_id"]},
    )
    assert rest.status_code == 200 and rest.has_done
    assert rest.finish_reasons[-1] == "length"
    assert "".join(long.texts) + rest.text == journal_text(rdb, long.request_id)
    # Neither request was cancelled: both ran to their length, billed in full.
    for request_id in (long.request_id, collected_id):
        record = wait_for_usage_record(db, request_id, timeout_s=60)
        assert record.finish_reason == "length" and record.output_tokens == LONG_MAX_TOKENS
    log = (home / f"api-{api.url.rsplit(':', 1)[1]}.log").read_text()
    assert '"level": "ERROR"' not in log
