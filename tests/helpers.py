"""Helpers for reading llmfleet's HTTP answers in tests, and for running `llmfleet` itself."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlmodel import Session, select

from shared import keys
from shared.protocol import FinalEvent, TokenEvent, decode_event
from shared.tables import ModelDeployment, UsageRecord


@dataclass
class SSEResult:
    status_code: int
    headers: httpx.Headers
    chunks: list[dict] = field(default_factory=list)
    has_done: bool = False
    events_after_done: int = 0

    @property
    def text(self) -> str:
        parts = []
        for chunk in self.chunks:
            for choice in chunk.get("choices", []):
                parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        return "".join(parts)

    @property
    def usage(self) -> dict | None:
        finals = [c for c in self.chunks if c.get("usage")]
        return finals[-1]["usage"] if finals else None

    @property
    def finish_reasons(self) -> list[str | None]:
        return [ch.get("finish_reason") for c in self.chunks for ch in c.get("choices", [])]


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    """An OpenAI-style error body (`{"error": {message, type, param, code}}`) with `status`
    and, given, `code`; the error."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def forget_tenant(rdb, tenant_id: str) -> None:
    """Drop a test tenant's Redis state: its queues that no worker reads (no consumer group:
    a served model's stream belongs to its workers, which fail on a group deleted under
    them), its admission and rate counters, its resume-stream slots."""
    for stream in rdb.scan_iter(keys.tenant_stream("*", tenant_id)):
        if not rdb.xinfo_groups(stream):
            rdb.delete(stream)
            model = stream.decode().split(":")[2]
            rdb.srem(keys.model_tenants(model), tenant_id)
    rdb.delete(
        keys.tenant_inflight(tenant_id),
        keys.tenant_queued(tenant_id),
        keys.tenant_buckets(tenant_id),
        keys.tenant_resume_streams(tenant_id),
    )


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def stream(
    url: str,
    path: str,
    key: str,
    body: dict,
    timeout_s: float = 120,
    *,
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> SSEResult:
    """POST with `stream: true` (or GET, without a body) and parse every `data:` line of the
    SSE answer."""
    json_body = {**body, "stream": True} if method == "POST" else None
    headers = auth(key) | (headers or {})
    with (
        httpx.Client(timeout=timeout_s) as client,
        client.stream(method, url + path, json=json_body, headers=headers) as r,
    ):
        result = SSEResult(r.status_code, r.headers)
        if r.status_code != 200:
            r.read()
            result.chunks.append(r.json())
            return result
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if result.has_done:
                result.events_after_done += 1
            elif data == "[DONE]":
                result.has_done = True
            else:
                result.chunks.append(json.loads(data))
    return result


def get_usage(url: str, key: str, request_id: str, timeout_s: float = 30) -> httpx.Response:
    """GET a request's usage, waiting while it is 404: a finished request's usage reaches
    SQL through the control process, shortly after `[DONE]`."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{url}/v1/requests/{request_id}/usage", headers=auth(key))
        if response.status_code != 404 or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def wait_for_usage_record(db, request_id: str, timeout_s: float = 30) -> UsageRecord:
    """A request's usage record, once the control process has written it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with Session(db) as session:
            record = session.exec(
                select(UsageRecord).where(UsageRecord.request_id == request_id)
            ).first()
        if record is not None:
            return record
        time.sleep(0.1)
    raise AssertionError(f"no usage record for {request_id}")


def add_deployment(db, model_id: str) -> ModelDeployment:
    """A deployment row of the test's own (usage records refer to one)."""
    with Session(db) as session:
        deployment = ModelDeployment(model_id=model_id, source="x", max_context_tokens=100)
        session.add(deployment)
        session.commit()
        session.refresh(deployment)
        return deployment


def llmfleet(env: dict[str, str], *args: str, umask: int = -1) -> subprocess.CompletedProcess:
    """Run the `llmfleet` command line (as `python -m cli`) to completion; `umask`: the
    child's (-1: this process's)."""
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        umask=umask,
    )


PENDING_DRAIN_TIMEOUT_S = 30.0


def wait_pending_drained(client, streams: list[str]) -> dict[str, int]:
    """XPENDING of every stream, once all reach 0 or the timeout passes. A worker
    acknowledges an entry just after the request's final event, so a client that has its
    answer may look a moment before the entry is gone."""
    deadline = time.monotonic() + PENDING_DRAIN_TIMEOUT_S
    while True:
        pending = {s: _pending(client, s) for s in streams}
        if not any(pending.values()) or time.monotonic() > deadline:
            return pending
        time.sleep(0.2)


def _pending(client, stream: str) -> int:
    if not client.exists(stream):
        return 0
    return client.xpending(stream, keys.WORKER_GROUP)["pending"]


UP_START_TIMEOUT_S = 180.0


@dataclass
class UpProcess:
    """`llmfleet up` running in a test, its console going to a file."""

    process: subprocess.Popen
    out_path: Path
    url: str = ""
    key: str = ""
    started_in_s: float = 0.0  # from its start until it said it was up

    @classmethod
    def start(cls, env: dict[str, str], out_path: Path, *args: str) -> UpProcess:
        with out_path.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "cli", "up", *args],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: see `stop`
            )
        return cls(process, out_path)

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_until_up(self, timeout_s: float = UP_START_TIMEOUT_S) -> UpProcess:
        """Once it says it is up: its URL and development key."""
        started_s = time.monotonic()
        while "llmfleet is up" not in self.output:
            assert self.process.poll() is None, self.output
            assert time.monotonic() < started_s + timeout_s, self.output
            time.sleep(0.2)
        self.started_in_s = time.monotonic() - started_s
        self.url = re.search(r"llmfleet is up at (\S+)", self.output).group(1)  # type: ignore[union-attr]
        self.key = re.search(r"development API key: (lf-\S+)", self.output).group(1)  # type: ignore[union-attr]
        return self

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            # A test that failed must not leave the platform running: `up` and its children.
            os.killpg(self.process.pid, signal.SIGKILL)
            raise


@dataclass
class StreamRead:
    """What a client read of one stream, line by line as it came: for a test that acts while
    streams are under way (`started` is set once `start_after` events were read)."""

    start_after: int = 1
    request_id: str = ""
    ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    errors: list[dict] = field(default_factory=list)
    has_done: bool = False
    is_cut: bool = False  # the connection broke before the stream ended
    started: threading.Event = field(default_factory=threading.Event)

    def take(self, line: str) -> None:
        if line.startswith("id:"):
            self.ids.append(int(line[3:]))
            if len(self.ids) >= self.start_after:
                self.started.set()
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.has_done = True
        elif "error" in (chunk := json.loads(data)):
            self.errors.append(chunk["error"])
        else:
            self.texts.append(chunk["choices"][0]["text"])
            self.finish_reason = chunk["choices"][0]["finish_reason"] or self.finish_reason


def read_stream(url: str, key: str, body: dict, read: StreamRead) -> None:
    """POST a streaming completion and read it into `read` (run it on a thread)."""
    try:
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{url}/v1/completions", json=body, headers=auth(key)) as r,
        ):
            assert r.status_code == 200
            read.request_id = r.headers["x-request-id"]
            for line in r.iter_lines():
                read.take(line)
    except httpx.TransportError:
        read.is_cut = True
        raise


def journal_text(rdb, request_id: str) -> str:
    """The text of a request's events as its journal in Redis holds them."""
    entries = rdb.xrange(keys.request_events(request_id))
    events = [decode_event(fields[b"e"]) for _, fields in entries]
    return "".join(e.text for e in events if isinstance(e, TokenEvent | FinalEvent))


async def enqueue_request(
    client, deployment, i: int, prompt: list[int], max_tokens: int, tenant_id: str = "t"
) -> str:
    """A request on its tenant's stream of `deployment`, as the API leaves it (`ignore_eos`,
    a fresh id); its id. `client`: an asyncio Redis client."""
    from tests.factories import make_request

    request = make_request(i, prompt, max_tokens, tenant_id=tenant_id, ignore_eos=True)
    request = request.model_copy(
        update={"request_id": uuid.uuid4().hex, "model": deployment.model_id,
                "arrival_ts": time.time()}
    )  # fmt: skip
    await client.sadd(keys.model_tenants(deployment.name), tenant_id)
    await client.xadd(keys.tenant_stream(deployment.name, tenant_id), request.to_fields())
    return request.request_id
