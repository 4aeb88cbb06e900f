"""bench/sse_load.py, the raw-socket load client, against a fake completions server that
answers as the API does (sse-starlette under uvicorn: chunked framing, `\\r\\n` lines)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bench.sse_load import LoadConfig, StreamRecord, run
from cli.redis_server import free_port
from tests.bench.servers import serving

API_KEY = "load-key"
NUM_CHUNKS = 3
NUM_USAGE_TOKENS = 5  # not the number of chunks: the record takes the usage chunk's


class FakeApi:
    """Prompt [1]: an error event; [2]: the stream stops before [DONE]; [3]: a 429; else
    content chunks, the usage chunk and [DONE]. Counts the requests open at once."""

    def __init__(self) -> None:
        self.num_open = 0
        self.max_num_open = 0
        self.bodies: list[dict] = []
        self.client_ports: list[int] = []  # one per connection

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/completions", self.completions, methods=["POST"])])

    async def completions(self, request: Request) -> Response:
        assert request.headers["authorization"] == f"Bearer {API_KEY}"
        body = await request.json()
        self.bodies.append(body)
        self.client_ports.append(request.client.port)
        if body["prompt"] == [3]:
            return JSONResponse({"error": {"code": "requests_in_flight_exceeded"}}, 429)
        return EventSourceResponse(self.events(body["prompt"]), ping=60)

    async def events(self, prompt: list[int]) -> Any:
        self.num_open += 1
        self.max_num_open = max(self.max_num_open, self.num_open)
        try:
            for index in range(NUM_CHUNKS):
                await asyncio.sleep(0.02)
                choice = {"index": 0, "text": f"t{index}", "logprobs": None, "finish_reason": None}
                yield {"data": json.dumps({"id": "x", "choices": [choice], "usage": None})}
            if prompt == [1]:
                yield {"data": json.dumps({"error": {"code": "worker_lost", "message": "gone"}})}
            elif prompt == [2]:
                return
            else:
                usage = {"prompt_tokens": 1, "completion_tokens": NUM_USAGE_TOKENS}
                yield {"data": json.dumps({"id": "x", "choices": [], "usage": usage})}
            yield {"data": "[DONE]"}
        finally:
            self.num_open -= 1


def _config(url: str, prompt: list[int], num_requests: int, **kwargs) -> LoadConfig:
    port = int(url.rsplit(":", 1)[1])
    return LoadConfig(
        host="127.0.0.1", port=port, api_key=API_KEY, model="m", prompt_token_ids=prompt,
        max_tokens=9, num_requests=num_requests, start_at_s=time.perf_counter(),
        timeout_s=10.0, **kwargs,
    )  # fmt: skip


def _run(config: LoadConfig) -> list[StreamRecord]:
    return asyncio.run(run(config))


def test_streams_are_timed_chunk_by_chunk_and_their_usage_is_read():
    api = FakeApi()
    with serving(api.app()) as url:
        records = _run(_config(url, [7, 8], 4))
    assert len(records) == 4
    for record in records:
        assert record.is_ok, record.error
        assert record.num_completion_tokens == NUM_USAGE_TOKENS
        times = record.token_times_s
        assert len(times) == NUM_CHUNKS  # content chunks only: not the usage chunk
        assert record.sent_s < record.accepted_s <= times[0] < times[1] < times[2]
        assert times[2] <= record.end_s
    assert api.bodies[0] == {
        "model": "m", "prompt": [7, 8], "max_tokens": 9, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip


def test_an_error_event_a_cut_stream_a_refusal_and_no_server_are_errors():
    api = FakeApi()
    with serving(api.app()) as url:
        [error_event] = _run(_config(url, [1], 1))
        [cut] = _run(_config(url, [2], 1))
        [refused] = _run(_config(url, [3], 1))
    [unreachable] = _run(_config(f"http://127.0.0.1:{free_port()}", [7], 1))
    assert error_event.error == "error event: worker_lost" and error_event.is_accepted
    assert len(error_event.token_times_s) == NUM_CHUNKS
    assert cut.error == "closed before [DONE]"
    assert refused.error is not None and refused.error.startswith("HTTP 429")
    assert "requests_in_flight_exceeded" in refused.error and not refused.is_accepted
    assert unreachable.error is not None and unreachable.error.startswith("connect:")
    assert not any(r.is_ok for r in (error_event, cut, refused, unreachable))


def test_a_ramp_paces_the_starts_and_concurrency_bounds_the_open_requests():
    paced_api, bounded_api = FakeApi(), FakeApi()
    with serving(paced_api.app()) as url:
        paced = _config(url, [7], 5, ramp_per_s=20.0)
        records = _run(paced)
    with serving(bounded_api.app()) as url:
        bounded = _run(_config(url, [7], 6, concurrency=2))
    starts = sorted(r.sent_s for r in records)
    for index, sent_s in enumerate(starts):
        assert sent_s >= paced.start_at_s + index / 20.0  # never ahead of the pace
    assert all(r.is_ok for r in records + bounded)
    assert len(bounded_api.bodies) == 6 and bounded_api.max_num_open == 2


def test_kept_alive_lanes_send_their_requests_on_one_connection_each():
    api = FakeApi()
    with serving(api.app()) as url:
        records = _run(_config(url, [7], 8, concurrency=2, keep_alive=True))
    assert len(records) == 8 and all(r.is_ok for r in records), [r.error for r in records]
    assert all(r.num_completion_tokens == NUM_USAGE_TOKENS for r in records)
    assert len(api.bodies) == 8 and api.max_num_open == 2
    assert len(set(api.client_ports)) == 2  # the lanes' two connections, each kept


def test_a_kept_alive_lane_opens_a_new_connection_after_an_error():
    api = FakeApi()
    with serving(api.app()) as url:
        cut = _run(_config(url, [2], 3, concurrency=1, keep_alive=True))
        refused = _run(_config(url, [3], 2, concurrency=1, keep_alive=True))
    assert [r.error for r in cut] == ["closed before [DONE]"] * 3
    assert all(r.error is not None and r.error.startswith("HTTP 429") for r in refused)
    assert len(set(api.client_ports)) == 5  # none of them reused
