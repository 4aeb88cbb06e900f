"""The stream endpoints against clients that leave, odd `Last-Event-ID`s, dates past what the
arithmetic holds, and many resume streams: real API processes, Redis and a tiny worker.

A request that must stay open (resume streams) goes to a deployment no worker serves: it
stays queued, and its resume streams wait on it, for as long as the test needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlmodel import Session, select

from api import subscriber
from shared import deployments, keys
from shared.tables import UsageRecord
from tests.helpers import assert_error, auth, forget_tenant, wait_for_usage_record

UNSERVED_MODEL = "tiny-llama-unserved-streams"
RESUME_LEASE_S = 2.0
MAX_NUM_PER_REQUEST = 4
MAX_NUM_PER_TENANT = 6


@pytest.fixture(scope="module")
def unserved_deployment(db, tiny_model_dir):
    """The tiny model's weights under a model id no worker serves: requests stay queued."""
    return deployments.register(db, UNSERVED_MODEL, str(tiny_model_dir))


@pytest.fixture
def capped_api(start_api):
    """An API replica of this test's own (its log, its Redis clients) with a small tenant cap
    and a short lease, so that renewal and expiry show within seconds."""
    return start_api(
        {
            "LLMFLEET_MAX_NUM_RESUME_STREAMS_PER_TENANT": str(MAX_NUM_PER_TENANT),
            "LLMFLEET_RESUME_STREAM_LEASE_S": str(RESUME_LEASE_S),
        }
    )


@pytest.fixture
def queued_request(make_tenant, unserved_deployment, rdb):
    """Factory: a request admitted on the unserved model (its client hung up at once), for a
    tenant of its own unless one is given; returns (request id, tenant id, key)."""
    made: list[str] = []

    def factory(api_url: str, tenant: tuple[str, str] | None = None) -> tuple[str, str, str]:
        tenant_id, key = tenant or make_tenant("streams")
        body = {"model": UNSERVED_MODEL, "prompt": "hi", "max_tokens": 8, "stream": True}
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{api_url}/v1/completions", json=body, headers=auth(key)) as r,
        ):
            assert r.status_code == 200, r.read()
            made.append(tenant_id)
            return r.headers["x-request-id"], tenant_id, key

    yield factory
    for tenant_id in made:
        forget_tenant(rdb, tenant_id)


def _tenant_records(db, tenant_id: str) -> list[UsageRecord]:
    with Session(db) as session:
        return list(session.exec(select(UsageRecord).where(UsageRecord.tenant_id == tenant_id)))


# 1. A non-streaming request whose client leaves is cancelled, as a streaming one is.


def test_a_non_streaming_request_is_cancelled_when_its_client_leaves(
    api_url, tiny_worker, tiny_deployment, make_tenant, db, rdb
):
    tenant_id, key = make_tenant("leaves")
    max_tokens = 480
    body = {
        "model": tiny_deployment.model_id,
        "prompt": "go",
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    port = int(api_url.rsplit(":", 1)[1])
    with _sent(port, key, body):
        # Leave once it is generating: its id is in the tenant's in-flight set, its first
        # tokens in its journal.
        request_id = _wait_for(lambda: _one_inflight(rdb, tenant_id), "never admitted")
        events = keys.request_events(request_id)
        _wait_for(lambda: rdb.xlen(events) >= 3, "never generated")
        left_at = rdb.xlen(events)
    record = wait_for_usage_record(db, request_id)
    assert record.finish_reason == "cancelled"
    # Generation stopped soon after the client left, far from the whole answer, and the
    # record bills what was delivered.
    assert left_at <= record.output_tokens < max_tokens / 2, (left_at, record.output_tokens)
    assert record.computed_tokens < max_tokens / 2 + 8


def _one_inflight(rdb, tenant_id: str) -> str | None:
    members = rdb.zrange(keys.tenant_inflight(tenant_id), 0, -1)
    return members[0].decode() if members else None


def _wait_for(value, what: str, timeout_s: float = 30):
    deadline = time.monotonic() + timeout_s
    while not (result := value()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return result


@contextlib.contextmanager
def _sent(port: int, key: str, body: dict):
    """A POST /v1/completions sent over a socket of its own, closed when the block ends (the
    client leaves, without reading the answer)."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + payload)
        yield


# 2. `Last-Event-ID`: at most 18 ASCII digits, anything else a 400.


@pytest.mark.parametrize(
    "last_event_id",
    ["²", "9" * 5000, str(2**64), "1e20", "-1", "", "1 2", "+1", "\u0661"],
    ids=[
        "superscript",
        "5000-digits",
        "2^64",
        "1e20",
        "negative",
        "empty",
        "inner-space",
        "plus",
        "arabic",
    ],
)
@pytest.mark.parametrize("where", ["header", "query"])
def test_a_malformed_last_event_id_is_400(
    api_url, queued_request, unserved_deployment, last_event_id, where
):
    request_id, _, key = queued_request(api_url)
    headers, params = auth(key), {}
    if where == "header":
        # Servers read header bytes as latin-1: `²` is one byte there, the Arabic digit two.
        try:
            headers["Last-Event-ID"] = last_event_id.encode("latin-1")
        except UnicodeEncodeError:
            headers["Last-Event-ID"] = last_event_id.encode()
    else:
        params["last_event_id"] = last_event_id
    path = f"{api_url}/v1/requests/{request_id}/events"
    # Streamed: a stream wrongly accepted would never end (its request stays queued).
    with (
        httpx.Client(timeout=30) as client,
        client.stream("GET", path, params=params, headers=headers) as response,
    ):
        assert response.status_code == 400
        response.read()
    assert_error(response, 400)


def test_the_largest_last_event_id_resumes(api_url, queued_request, unserved_deployment):
    request_id, _, key = queued_request(api_url)
    headers = {**auth(key), "Last-Event-ID": "9" * 18}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("GET", f"{api_url}/v1/requests/{request_id}/events", headers=headers) as r,
    ):
        assert r.status_code == 200


# 3. `GET /v1/usage`: dates the arithmetic cannot handle, malformed dates, absurd ranges.


@pytest.mark.parametrize(
    "params",
    [
        {"end": "9999-12-31"},
        {"start": "2026-01-01", "end": "9999-12-31"},
        {"start": "0001-01-01", "end": "9999-12-31"},
        {"start": "2025-01-01", "end": "2026-01-02"},  # 367 days
        {"start": "20260310", "end": "20260310"},
        {"start": "2026-W10-2", "end": "2026-03-10"},
        {"start": "2026-02-30", "end": "2026-03-10"},
        {"start": "0000-01-01", "end": "2026-03-10"},
        {"start": "\uff12\uff10\uff12\uff16-03-10", "end": "2026-03-10"},
        {"start": "2026-03-10 ", "end": "2026-03-10"},
        {"start": "2026-03-11", "end": "2026-03-10"},
    ],
)
def test_the_usage_report_refuses_dates_and_ranges_it_cannot_serve(make_tenant, api_url, params):
    _, key = make_tenant("report-hard")
    response = httpx.get(f"{api_url}/v1/usage", params=params, headers=auth(key), timeout=30)
    assert_error(response, 400)


@pytest.mark.parametrize(
    ("start", "end"), [("9999-12-31", "9999-12-31"), ("9999-01-01", "9999-12-31")]
)
def test_the_usage_report_reaches_the_last_day(make_tenant, api_url, start, end):
    _, key = make_tenant("report-last")
    params = {"start": start, "end": end}
    response = httpx.get(f"{api_url}/v1/usage", params=params, headers=auth(key), timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["data"] == []


# 4. Clients that leave at once: no ERROR in the log, nothing left behind.


def _log_lines(home, api) -> list[str]:
    port = api.url.rsplit(":", 1)[1]
    return (home / f"api-{port}.log").read_text().splitlines()


def test_clients_that_leave_at_once_log_no_error_and_leave_nothing(
    capped_api, tiny_worker, tiny_deployment, make_tenant, db, rdb, home
):
    """Fifty clients, streaming or not, that leave right after sending: most before their
    body is read, some after their request was admitted (the later leavers)."""
    tenant_id, key = make_tenant("at-once")
    port = int(capped_api.url.rsplit(":", 1)[1])
    max_tokens = 400
    body = {"model": tiny_deployment.model_id, "prompt": "go", "max_tokens": max_tokens}

    def send_and_leave(i: int) -> None:
        with _sent(port, key, {**body, "ignore_eos": True, "stream": i % 2 == 0}):
            time.sleep((0.0, 0.0, 0.05, 1.0)[i % 4])

    with ThreadPoolExecutor(max_workers=10) as pool:
        list(pool.map(send_and_leave, range(50)))
    # Every admitted request ends, cancelled, and gives its slot back.
    _wait_for(
        lambda: not rdb.zcard(keys.tenant_inflight(tenant_id)), "admissions left", timeout_s=60
    )
    time.sleep(2)  # the control process records the last usage
    records = _tenant_records(db, tenant_id)
    assert records, "no client stayed long enough to be admitted"
    assert all(r.finish_reason == "cancelled" for r in records), [
        (r.finish_reason, r.output_tokens) for r in records
    ]
    assert all(r.output_tokens < max_tokens / 2 for r in records)
    # Nothing at ERROR, and no traceback about these clients (the log is the API process's
    # whole log: its warm-up may have warned about other tests' deployments).
    lines = _log_lines(home, capped_api)
    assert not [line for line in lines if '"level": "ERROR"' in line]
    assert not [line for line in lines if "ClientDisconnect" in line]


def test_a_client_that_leaves_mid_body_on_any_route_logs_no_error(capped_api, settings, home):
    """Also outside the completion routes: an admin body the client stops sending."""
    port = int(capped_api.url.rsplit(":", 1)[1])
    head = (
        f"POST /admin/v1/tenants HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {settings.admin_secret}\r\nContent-Type: application/json\r\n"
        "Content-Length: 10000\r\n\r\n"
    ).encode()
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + b'{"name": "lea')
    _wait_for(
        lambda: (
            sum("client left before its answer" in line for line in _log_lines(home, capped_api))
            >= 5
        ),
        "the five departures logged",
        timeout_s=30,
    )
    assert not [line for line in _log_lines(home, capped_api) if '"level": "ERROR"' in line]


# 5. Resume streams: capped per request and per tenant, released on every exit path, and
# their Redis connections closed with them.


@contextlib.asynccontextmanager
async def _resume_streams(api_url: str, key: str, request_ids: list[str]):
    """Open a resume stream on each of `request_ids` at once; yield the responses (a refused
    one's body read), all open until the block ends, then all closed."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with (
        httpx.AsyncClient(timeout=30, limits=limits) as client,
        contextlib.AsyncExitStack() as streams,
    ):

        async def open_one(request_id: str) -> httpx.Response:
            path = f"{api_url}/v1/requests/{request_id}/events"
            response = await streams.enter_async_context(
                client.stream("GET", path, headers=auth(key))
            )
            if response.status_code != 200:
                await response.aread()
            return response

        yield await asyncio.gather(*(open_one(rid) for rid in request_ids))


def _num_redis_clients(rdb) -> int:
    return rdb.info("clients")["connected_clients"]


def _api_clients(rdb, api) -> list[dict]:
    """The Redis connections of one API process: their client names end with its pid
    (`api/app.py`, `api/subscriber.py`)."""
    suffix = f"-{api.process.pid}"
    return [c for c in rdb.client_list() if c.get("name", "").endswith(suffix)]


def _num_subscribers(rdb, request_id: str) -> int:
    [(_, count)] = rdb.pubsub_numsub(keys.request_channel(request_id))
    return count


def _statuses(responses: list[httpx.Response]) -> list[int]:
    return sorted(r.status_code for r in responses)


async def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


async def test_resume_streams_beyond_the_request_cap_get_429_and_close_their_connections(
    capped_api, queued_request, rdb
):
    """The extra streams get 429; the open ones hold no Redis connection of their own (they
    share the process's subscriber connections), renew their slots past a lease, and give
    back slot and subscription when they close."""
    request_id, _, key = queued_request(capped_api.url)
    await asyncio.sleep(0.5)
    num_clients_before = _num_redis_clients(rdb)
    async with _resume_streams(capped_api.url, key, [request_id] * 10) as responses:
        assert _statuses(responses) == [200] * MAX_NUM_PER_REQUEST + [429] * 6
        for refused in (r for r in responses if r.status_code == 429):
            assert_error(refused, 429, "resume_streams_per_request_exceeded")
            assert int(refused.headers["retry-after"]) >= 1
        assert _num_subscribers(rdb, request_id) == 1  # the four streams' one subscription
        clients = _api_clients(rdb, capped_api)
        assert sum(subscriber.CLIENT_NAME in c["name"] for c in clients) == 2
        assert len(clients) <= 16
        # Past a whole lease the open streams still hold their slots (they renew them).
        await asyncio.sleep(RESUME_LEASE_S * 1.5)
        path = f"{capped_api.url}/v1/requests/{request_id}/events"
        late = await asyncio.to_thread(httpx.get, path, headers=auth(key), timeout=30)
        assert_error(late, 429, "resume_streams_per_request_exceeded")
    slots = keys.request_resume_streams(request_id)
    await _wait_until(lambda: rdb.zcard(slots) == 0, 10, "slots not released")
    await _wait_until(lambda: _num_subscribers(rdb, request_id) == 0, 10, "left subscribed")
    # Near the start: the API's shared pool keeps open (for reuse) at most as many idle
    # connections as it ran commands at once, here fewer than the ten streams asked for.
    num_clients_after = _num_redis_clients(rdb)
    assert num_clients_after < num_clients_before + 10, (num_clients_before, num_clients_after)
    async with _resume_streams(capped_api.url, key, [request_id] * 4) as responses:
        assert _statuses(responses) == [200] * MAX_NUM_PER_REQUEST


async def test_resume_streams_beyond_the_tenant_cap_get_429(capped_api, queued_request, rdb):
    first, tenant_id, key = queued_request(capped_api.url)
    second, _, _ = queued_request(capped_api.url, (tenant_id, key))
    async with _resume_streams(capped_api.url, key, [first] * 4 + [second] * 4) as responses:
        assert _statuses(responses) == [200] * MAX_NUM_PER_TENANT + [429] * 2
        for refused in (r for r in responses if r.status_code == 429):
            assert_error(refused, 429, "resume_streams_per_tenant_exceeded")
    slots = keys.tenant_resume_streams(tenant_id)
    await _wait_until(lambda: rdb.zcard(slots) == 0, 10, "slots not released")


async def test_the_slots_of_a_dead_api_expire_with_their_lease(
    capped_api, start_api, queued_request
):
    doomed = start_api({"LLMFLEET_RESUME_STREAM_LEASE_S": str(RESUME_LEASE_S)})
    request_id, _, key = queued_request(capped_api.url)
    async with _resume_streams(doomed.url, key, [request_id] * 4) as responses:
        assert _statuses(responses) == [200] * MAX_NUM_PER_REQUEST
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait()
        async with _resume_streams(capped_api.url, key, [request_id]) as [refused]:
            assert_error(refused, 429, "resume_streams_per_request_exceeded")
        await asyncio.sleep(RESUME_LEASE_S + 0.5)
        async with _resume_streams(capped_api.url, key, [request_id] * 4) as again:
            assert _statuses(again) == [200] * MAX_NUM_PER_REQUEST
