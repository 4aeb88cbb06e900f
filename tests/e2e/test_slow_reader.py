"""A client that opens a stream and never reads it (`api/streaming.py`, `stream_stalled`): the
worker is not slowed (another tenant's stream runs at its speed alone), and the API ends the
stream once its socket has not drained for `LLMFLEET_STREAM_SEND_TIMEOUT_S`: the request is
cancelled, its usage recorded, and the client finds the error event and `[DONE]` once it
reads. Real API, Redis and worker processes.

The client's socket is made to fill early: a small receive buffer and a small MSS announced
in its SYN (which keeps the server's send buffer small too), so the API's writes wait after
some 100 kB, well within what the request would send."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from api import subscriber
from shared import deployments, keys
from tests import tiny_model
from tests.helpers import stream, wait_for_usage_record

SEND_TIMEOUT_S = 2
# Long enough that the request cannot end by itself before its client's socket fills and
# the send timeout passes, however fast the machine (about 1,000 events fill it).
CONTEXT_TOKENS = 16384
SLOW_MAX_TOKENS = 16000
OTHER_MAX_TOKENS = 200


@pytest.fixture(scope="module")
def long_context_deployment(db, tmp_path_factory, settings):
    path = tiny_model.build(
        tmp_path_factory.mktemp("tiny-long-context"),
        settings.home / "cache",
        max_position_embeddings=CONTEXT_TOKENS,
    )
    return deployments.register(db, "tiny-llama-slow-reader", str(path))


@pytest.fixture(scope="module")
def long_context_worker(start_worker, long_context_deployment):
    """One torch thread: on a loaded 2-core machine two threads' OpenMP team made each
    decode step of the tiny model ~20x slower (63 against 3 ms), and the never-reading
    client's socket must fill well within the request's length."""
    num_tokens = 2 * CONTEXT_TOKENS + 512
    return start_worker(
        long_context_deployment.model_id,
        "--max-num-seqs", "4",
        "--kv-cache-gb", str(num_tokens * 512 / 2**30),  # fp32: 512 bytes per token
        "--dtype", "float32",
        env_overrides={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def _never_reading_client(port: int, key: str, body: dict) -> socket.socket:
    """A socket that sends a streamed completion and reads nothing (until the test does)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock.sendall(head + payload)
    return sock


def _read_to_the_end(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    received = bytearray()
    while b"data: [DONE]" not in received:
        data = sock.recv(65536)
        if not data:
            break
        received += data
    return bytes(received)


def _subscriber_ids(rdb, api) -> list[str]:
    name = f"{subscriber.CLIENT_NAME}-{api.process.pid}"
    return sorted(c["id"] for c in rdb.client_list() if c["name"] == name)


def _timed_stream(url: str, key: str, body: dict) -> float:
    started = time.monotonic()
    result = stream(url, "/v1/completions", key, body)
    assert result.has_done and result.finish_reasons[-1] == "length"
    return time.monotonic() - started


def _wait_for(value, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (result := value()):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)
    return result


def test_a_client_that_never_reads_is_cut_off_and_slows_nobody(
    start_api, long_context_worker, long_context_deployment, make_tenant, db, rdb
):
    api = start_api({"LLMFLEET_STREAM_SEND_TIMEOUT_S": str(SEND_TIMEOUT_S)})
    model = long_context_deployment.model_id
    _, other_key = make_tenant("reads")
    slow_tenant, slow_key = make_tenant("never-reads")
    other_body = {
        "model": model,
        "prompt": "go",
        "max_tokens": OTHER_MAX_TOKENS,
        "ignore_eos": True,
    }
    alone_s = _timed_stream(api.url, other_key, other_body)
    subscriber_ids = _subscriber_ids(rdb, api)

    slow_body = {**other_body, "max_tokens": SLOW_MAX_TOKENS, "stream": True}
    sock = _never_reading_client(int(api.url.rsplit(":", 1)[1]), slow_key, slow_body)
    try:
        inflight = keys.tenant_inflight(slow_tenant)
        request_id = _wait_for(lambda: rdb.zrange(inflight, 0, 0), 30, "not admitted")[0].decode()
        _wait_for(lambda: rdb.xlen(keys.request_events(request_id)) > 0, 30, "not started")
        beside_s = _timed_stream(api.url, other_key, other_body)
        # Ended within the bound, cancelled long before its length: what it computed billed.
        record = wait_for_usage_record(db, request_id, timeout_s=SEND_TIMEOUT_S + 60)
        assert record.finish_reason == "cancelled"
        assert record.output_tokens < SLOW_MAX_TOKENS / 2
        received = _read_to_the_end(sock, timeout_s=30)
    finally:
        sock.close()
    # The API's shared subscriber connections were never dropped (it drains them whatever
    # a stream's client does).
    assert _subscriber_ids(rdb, api) == subscriber_ids and len(subscriber_ids) == 2
    # The other tenant's stream ran at its own speed meanwhile (a generous bound: on this
    # machine the two are within a few tenths of a second).
    assert beside_s < 3 * alone_s + 5, (alone_s, beside_s)
    # Once read, the stream ends whole: its events in order, the error event, then [DONE].
    ids = [int(i) for i in re.findall(rb"\r\nid: ([0-9]+)\r\n", received)]
    assert ids and ids == sorted(set(ids))
    [error] = [json.loads(d)["error"] for d in re.findall(rb"data: (\{\"error.*)\r\n", received)]
    assert error["code"] == "stream_stalled" and error["last_event_id"] == str(ids[-1])
    assert received.index(b"data: [DONE]") > received.index(b"stream_stalled")
