"""A standby worker (`llmfleet worker --standby`) through the platform's processes: loaded and
registered, it pulls nothing and holds no KV pool, and `llmfleet status`, `/dashboard` and
the API's `/metrics` show it; the autoscaler's role `active` (`keys.AUTOSCALE_ROLES`) has it
serving a queued request within 2 s of the write, first token included; the role `standby`
drains it back (its running request finishes) and a new request waits in the queue until it
is active again. Every request ends once, with exact usage. In this process against a Redis
of its own, with the drain's hand-back: tests/worker/test_standby.py."""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from cli.status import print_status
from shared import deployments, keys
from tests.conftest import TINY_KV_CACHE_GB
from tests.helpers import auth, wait_for_usage_record

MAX_FIRST_TOKEN_S = 2.0  # from the role's write to the first token: the target
STEP_DELAY_MS = 40  # a request of 24 tokens runs at least ~1 s: still running when parked
PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 24
ADMIN_KEY = "test-admin-key-0123456789"  # conftest's LLMFLEET_ADMIN_KEY


@dataclass
class Answer:
    request_id: str
    chunks: list[dict]
    has_done: bool
    num_after_done: int = 0

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for chunk in self.chunks for c in chunk["choices"]
                if c.get("finish_reason")]  # fmt: skip

    @property
    def usage(self) -> dict:
        [usage] = [chunk["usage"] for chunk in self.chunks if chunk.get("usage")]
        return usage


def _complete(url: str, key: str, model: str, first_token: threading.Event) -> Answer:
    """Stream a completion; `first_token` is set when its first text arrives."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{url}/v1/completions", json=body, headers=auth(key)) as r,
    ):
        assert r.status_code == 200, r.read()
        answer = Answer(r.headers["x-request-id"], [], False)
        for line in r.iter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:"):
                continue
            if answer.has_done:
                answer.num_after_done += 1
            elif data == "[DONE]":
                answer.has_done = True
            else:
                answer.chunks.append(json.loads(data))
                if any(c.get("text") for c in answer.chunks[-1]["choices"]):
                    first_token.set()
    return answer


@dataclass
class Watched:
    """The worker under test, through its heartbeat."""

    rdb: object
    worker_id: str
    name: str  # model@version

    def heartbeat(self) -> dict[str, str]:
        raw = self.rdb.hgetall(keys.worker_heartbeat(self.worker_id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def wait_state(self, state: str, timeout_s: float = 10.0) -> set[str]:
        """The states seen until `state`."""
        seen, deadline = set(), time.monotonic() + timeout_s
        while (beat := self.heartbeat()).get("state") != state:
            seen.add(beat.get("state"))
            assert time.monotonic() < deadline, f"not {state}: {beat}"
            time.sleep(0.02)
        return seen

    def set_role(self, wanted: str) -> None:
        self.rdb.hset(keys.AUTOSCALE_ROLES, self.worker_id, wanted)

    def assert_standby(self) -> None:
        beat = self.heartbeat()
        assert beat["state"] == "standby", beat
        assert "kv_cache_blocks" not in beat and "max_num_seqs" not in beat  # no engine
        assert self.rdb.zscore(keys.ready_workers(self.name), self.worker_id) is None
        assert self.rdb.zscore(keys.model_capacity(self.name), self.worker_id) is None


def _worker_id(rdb, pid: int) -> str:
    for key in rdb.scan_iter(keys.worker_heartbeat_pattern()):
        if rdb.hget(key, "pid") == str(pid).encode():
            return key.decode().removeprefix(keys.worker_heartbeat(""))
    raise AssertionError(f"no heartbeat of pid {pid}")


def _num_pulled(rdb, stream: str) -> int:
    if not rdb.exists(stream) or not rdb.xinfo_groups(stream):
        return 0
    return rdb.xpending(stream, keys.WORKER_GROUP)["pending"]


def _wait_queued(rdb, stream: str, num_entries: int) -> None:
    deadline = time.monotonic() + 30
    while not (rdb.exists(stream) and rdb.xlen(stream) >= num_entries):
        assert time.monotonic() < deadline, "the request was never queued"
        time.sleep(0.02)


def _assert_visible(api_url, settings, db, watched: Watched, model: str) -> None:
    """`llmfleet status`, `/dashboard/data` and the API's `/metrics` show it on standby."""
    console = Console(record=True, width=200)
    print_status(settings, db, 60, console)
    lines = console.export_text().splitlines()
    assert any(watched.worker_id in line and " standby " in line for line in lines)
    model_row = next(line for line in lines if line.startswith(f"│ {watched.name} "))
    assert "0/1 (1 standby)" in model_row

    data = httpx.get(f"{api_url}/dashboard/data", headers=auth(ADMIN_KEY)).json()
    [snap] = [m for m in data["models"] if m["name"] == watched.name]
    assert snap["num_workers_by_state"] == {"standby": 1}
    [worker] = snap["workers"]
    assert (worker["worker_id"], worker["state"]) == (watched.worker_id, "standby")

    scrape = httpx.get(f"{api_url}/metrics", headers=auth(settings.metrics_secret)).text
    [workers] = [f for f in text_string_to_metric_families(scrape) if f.name == "llmfleet_workers"]
    mine = {s.labels["state"]: s.value for s in workers.samples if s.labels["model"] == model}
    assert mine == {"standby": 1}


@pytest.fixture(scope="module")
def standby_deployment(db, tiny_model_dir):
    return deployments.register(db, f"tiny-standby-{uuid.uuid4().hex[:6]}", str(tiny_model_dir))


def test_a_standby_worker_serves_within_2_s_of_activation_and_drains_back_to_standby(
    api_url, start_worker, standby_deployment, make_tenant, rdb, db, settings
):
    model = standby_deployment.model_id
    process = start_worker(
        model, "--standby", "--dtype", "float32", "--max-num-seqs", "4",
        "--kv-cache-gb", str(TINY_KV_CACHE_GB),
        env_overrides={"LLMFLEET_FAULT_STEP_DELAY_MS": str(STEP_DELAY_MS)}, state="standby",
    )  # fmt: skip
    watched = Watched(rdb, _worker_id(rdb, process.pid), standby_deployment.name)
    watched.assert_standby()
    _assert_visible(api_url, settings, db, watched, model)
    tenant_id, key = make_tenant("standby")
    stream = keys.tenant_stream(standby_deployment.name, tenant_id)
    first_tokens = [threading.Event(), threading.Event()]
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_complete, api_url, key, model, first_tokens[0])
        _wait_queued(rdb, stream, 1)
        time.sleep(1.0)  # five of its role polls: on standby, it takes nothing
        assert _num_pulled(rdb, stream) == 0 and not first_tokens[0].is_set()

        written_at_s = time.monotonic()
        watched.set_role("active")
        assert first_tokens[0].wait(10)
        assert time.monotonic() - written_at_s <= MAX_FIRST_TOKEN_S
        watched.set_role("standby")  # while the request runs: it finishes first
        assert "draining" in watched.wait_state("standby")
        answers = [first.result(timeout=30)]
        watched.assert_standby()
        assert 0 < float(watched.heartbeat()["activation_s"]) < MAX_FIRST_TOKEN_S

        second = pool.submit(_complete, api_url, key, model, first_tokens[1])
        _wait_queued(rdb, stream, 1)
        time.sleep(1.0)
        assert _num_pulled(rdb, stream) == 0 and not first_tokens[1].is_set()
        watched.set_role("active")  # it ends once too
        answers.append(second.result(timeout=30))

    assert watched.heartbeat()["state"] == "ready"
    served = str(2 * (len(PROMPT) + MAX_TOKENS))  # its running total, by the next heartbeat
    deadline = time.monotonic() + 5
    while watched.heartbeat()["num_served_tokens"] != served:
        assert time.monotonic() < deadline, watched.heartbeat()
        time.sleep(0.1)
    for answer in answers:
        assert answer.has_done and answer.num_after_done == 0
        assert answer.finish_reasons == ["length"]
        assert answer.usage == {"prompt_tokens": len(PROMPT), "completion_tokens": MAX_TOKENS,
                                "total_tokens": len(PROMPT) + MAX_TOKENS}  # fmt: skip
        assert rdb.get(keys.request_done(answer.request_id)) == watched.worker_id.encode()
        record = wait_for_usage_record(db, answer.request_id)
        assert (record.input_tokens, record.output_tokens) == (len(PROMPT), MAX_TOKENS)
        assert record.finish_reason == "length"
