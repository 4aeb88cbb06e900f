"""The chaos load: N streaming requests over the tenants, each one logged event by event.

A request whose connection breaks (its API process died, say) is resumed on the next API
with `Last-Event-ID`, as a real client would; one meant to disconnect closes its stream
after a few chunks. The log is what the pass criteria are checked against.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tests.chaos.harness import MODEL, TenantKey

MAX_RESUMES = 8
READ_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    tenant: TenantKey
    prompt: str | list[int]
    max_tokens: int
    disconnect_after_chunks: int | None = None  # close the stream early, on purpose
    is_poison: bool = False


@dataclass
class RequestLog:
    spec: RequestSpec
    request_id: str | None = None
    event_ids: list[int] = field(default_factory=list)
    chunk_ids: set[str] = field(default_factory=set)
    texts: list[str] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    error_codes: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    num_done: int = 0
    num_chunks: int = 0
    num_resumes: int = 0
    num_retries: int = 0  # the POST failed before its answer came: sent again
    is_disconnected: bool = False
    http_errors: list[str] = field(default_factory=list)
    started_s: float = 0.0
    ended_s: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def latency_s(self) -> float | None:
        return None if self.ended_s is None else self.ended_s - self.started_s


def make_specs(
    tenants: list[TenantKey], num_requests: int, *, seed: int, disconnect_every: int = 0,
    poison_every: int = 0, poison_token_id: int | None = None,
) -> list[RequestSpec]:  # fmt: skip
    rng = random.Random(seed)
    specs = []
    for i in range(num_requests):
        tenant = tenants[i % len(tenants)]
        prompt: str | list[int] = f"request {i} of tenant {tenant.name}: tell me a story"
        max_tokens = rng.randint(8, 32)
        disconnect, is_poison = None, False
        if disconnect_every and i % disconnect_every == 1:
            disconnect, max_tokens = 3, 400  # long enough that the cancel always lands first
        if poison_every and i % poison_every == 1:
            prompt, is_poison = [1, 2, poison_token_id, 3], True
        specs.append(RequestSpec(i, tenant, prompt, max_tokens, disconnect, is_poison))
    return specs


class LoadClient:
    """Sends the requests, at most `concurrency` at a time, spread over the API replicas."""

    def __init__(self, api_urls: list[str], concurrency: int) -> None:
        self._api_urls = api_urls
        self._slots = asyncio.Semaphore(concurrency)
        self.logs: list[RequestLog] = []

    def num_streaming(self, min_chunks: int, api_index: int | None = None) -> int:
        """Requests that have received at least `min_chunks` and not ended (on one API)."""
        return sum(
            1
            for log in self.logs
            if log.num_chunks >= min_chunks
            and log.ended_s is None
            and (api_index is None or log.spec.index % len(self._api_urls) == api_index)
        )

    def streaming_request_ids(self, min_chunks: int) -> list[str]:
        """Requests that have received at least `min_chunks` and not ended."""
        return [
            log.request_id
            for log in self.logs
            if log.num_chunks >= min_chunks and log.ended_s is None and log.request_id
        ]

    async def run(self, specs: list[RequestSpec]) -> list[RequestLog]:
        self.logs = [RequestLog(spec) for spec in specs]
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        timeout = httpx.Timeout(READ_TIMEOUT_S, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            await asyncio.gather(*(self._one(client, log) for log in self.logs))
        return self.logs

    async def _one(self, client: httpx.AsyncClient, log: RequestLog) -> None:
        async with self._slots:
            log.started_s = time.monotonic()
            api = log.spec.index % len(self._api_urls)
            for _ in range(MAX_RESUMES + 1):
                url = self._api_urls[api]
                try:
                    if log.request_id is None:
                        await self._post(client, url, log)
                    else:
                        await self._resume(client, url, log)
                    if log.num_done or log.is_disconnected:
                        break
                    log.http_errors.append("stream ended without [DONE]")
                except httpx.HTTPError as exc:
                    log.http_errors.append(f"{type(exc).__name__}: {exc}")
                api = (api + 1) % len(self._api_urls)
                await asyncio.sleep(0.2)
            log.ended_s = time.monotonic()

    async def _post(self, client: httpx.AsyncClient, url: str, log: RequestLog) -> None:
        spec = log.spec
        body = {
            "model": MODEL,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Authorization": f"Bearer {spec.tenant.key}"}
        if log.num_retries or log.http_errors:
            log.num_retries += 1
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            log.request_id = r.headers.get("x-request-id")
            if await _should_retry(r, log):
                return await self._post(client, url, log)
            if r.status_code != 200:
                await r.aread()
                log.http_errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                log.num_done = -1  # refused: nothing to resume
                return
            await self._read(r, log, on_chunk=self._maybe_disconnect(log))

    async def _resume(self, client: httpx.AsyncClient, url: str, log: RequestLog) -> None:
        log.num_resumes += 1
        headers = {"Authorization": f"Bearer {log.spec.tenant.key}"}
        if log.event_ids:
            headers["Last-Event-ID"] = str(log.event_ids[-1])
        path = f"{url}/v1/requests/{log.request_id}/events?include_usage=true"
        async with client.stream("GET", path, headers=headers) as r:
            if await _should_retry(r, log):
                return await self._resume(client, url, log)
            if r.status_code != 200:
                await r.aread()
                log.http_errors.append(f"resume HTTP {r.status_code}: {r.text[:200]}")
                return
            await self._read(r, log, on_chunk=None)

    def _maybe_disconnect(self, log: RequestLog) -> Callable[[], bool] | None:
        limit = log.spec.disconnect_after_chunks
        if limit is None:
            return None
        return lambda: log.num_chunks >= limit

    async def _read(
        self, response: httpx.Response, log: RequestLog, on_chunk: Callable[[], bool] | None
    ) -> None:
        event_id, data = None, []
        async for line in response.aiter_lines():
            if line.startswith("id:"):
                event_id = line[3:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
            elif line == "" and data:
                _record(log, "\n".join(data), event_id)
                event_id, data = None, []
                if on_chunk is not None and on_chunk():
                    log.is_disconnected = True
                    return  # leaving the context manager closes the connection


async def _should_retry(response: httpx.Response, log: RequestLog) -> bool:
    """A 503 (the broker is restarting): a client honours Retry-After, then sends it again."""
    if response.status_code != 503 or log.num_retries >= 20:
        return False
    await response.aread()
    log.num_retries += 1
    await asyncio.sleep(float(response.headers.get("retry-after", "1")))
    return True


def _record(log: RequestLog, data: str, event_id: str | None) -> None:
    if event_id is not None:
        log.event_ids.append(int(event_id))
    if data == "[DONE]":
        log.num_done += 1
        return
    chunk = json.loads(data)
    if "error" in chunk:
        log.error_codes.append(chunk["error"]["code"])
        return
    log.chunk_ids.add(chunk["id"])
    for choice in chunk["choices"]:
        log.num_chunks += 1
        log.texts.append(choice["text"])
        if choice["finish_reason"] is not None:
            log.finish_reasons.append(choice["finish_reason"])
    if chunk.get("usage"):
        log.completion_tokens = chunk["usage"]["completion_tokens"]
