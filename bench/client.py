"""Client: send a workload open loop to an OpenAI-compatible server and time every chunk.

Open loop means each request is sent at its arrival time whatever the server is doing, so
a slow server builds a queue (and shows it as TTFT) instead of slowing the client down.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.workload import RequestSpec

# Beyond this many requests in flight at once the pool queues them client side; that wait
# is inside start_s..first chunk, so it shows as TTFT rather than being hidden.
MIN_NUM_CONNECTIONS = 1024


@dataclass(slots=True)
class RequestResult:
    """What one request did, in absolute `time.perf_counter()` seconds."""

    index: int
    is_ok: bool
    error: str | None
    start_s: float  # when the request was sent (time.perf_counter(), absolute)
    chunk_times_s: list[float] = field(default_factory=list)  # every chunk with non-empty text
    end_s: float = 0.0  # when [DONE] (or the error) arrived
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # from the usage chunk, else the number of text chunks
    num_computed_tokens: int = 0  # prompt, decodes and recompute (full stack: the ledger's)
    # When the server had queued it: over HTTP when the response's headers arrived (the API
    # answers once the request is admitted and enqueued); engine-direct, its arrival.
    accepted_s: float = 0.0
    request_id: str = ""  # over HTTP: the server's (X-Request-Id)
    # Full-stack scenarios: (time_s, num_tokens) of every token event as the broker
    # published it (bench/service_recorder.py), the workers' pace without the API's relay.
    published: list[tuple[float, int]] = field(default_factory=list)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.start_s if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def itl_s(self) -> list[float]:
        return [later - earlier for earlier, later in pairwise(self.chunk_times_s)]

    @property
    def tpot_s(self) -> float | None:
        # A chunk may carry several tokens, so divide by tokens, not by chunk gaps.
        if self.num_output_tokens < 2 or not self.chunk_times_s:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.num_output_tokens - 1)


async def run_http(
    base_url: str,
    api_key: str,
    model: str,
    workload: list[RequestSpec],
    *,
    max_concurrency: int | None = None,
    temperature: float = 0.0,
    timeout_s: float = 600.0,
    show_progress: bool = True,
    tenant_keys: dict[str, str] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send `workload` to `{base_url}/v1/completions`; return results in index order and the run's wall seconds.

    Every request is launched at run start + `arrival_s`, independent of completions. With
    `max_concurrency`, a launched request waits for a slot and `start_s` is taken once it
    holds one. `timeout_s` bounds each whole request. A failed request is recorded, never raised.
    `tenant_keys`: each request is sent with its tenant's key (`RequestSpec.tenant`), not
    `api_key` (multi-tenant scenarios).
    """
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    client = _make_client(base_url, api_key, max_concurrency, timeout_s)
    async with client:
        with progress_bar(len(workload), show_progress) as advance:
            sender = _Sender(client, model, temperature, timeout_s, semaphore, advance)
            sender.tenant_keys = tenant_keys or {}
            run_start_s = time.perf_counter()
            results = await asyncio.gather(*(sender.launch(s, run_start_s) for s in workload))
            duration_s = time.perf_counter() - run_start_s
    return sorted(results, key=lambda r: r.index), duration_s


def _make_client(
    base_url: str, api_key: str, max_concurrency: int | None, timeout_s: float
) -> httpx.AsyncClient:
    num_connections = max(MIN_NUM_CONNECTIONS, max_concurrency or 0)
    return httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers={"Authorization": f"Bearer {api_key}"},
        limits=httpx.Limits(
            max_connections=num_connections, max_keepalive_connections=num_connections
        ),
        timeout=httpx.Timeout(timeout_s),
        http1=True,
        http2=False,
    )


@dataclass(slots=True)
class _Sender:
    """What every request of one run shares."""

    client: httpx.AsyncClient
    model: str
    temperature: float
    timeout_s: float
    semaphore: asyncio.Semaphore | None
    advance: Callable[[], None]
    tenant_keys: dict[str, str] = field(default_factory=dict)

    async def launch(self, spec: RequestSpec, run_start_s: float) -> RequestResult:
        await asyncio.sleep(max(0.0, run_start_s + spec.arrival_s - time.perf_counter()))
        if self.semaphore is None:
            result = await self.send(spec)
        else:
            async with self.semaphore:
                result = await self.send(spec)
        self.advance()
        return result

    async def send(self, spec: RequestSpec) -> RequestResult:
        result = RequestResult(
            index=spec.index,
            is_ok=False,
            error=None,
            start_s=time.perf_counter(),
            num_prompt_tokens=len(spec.prompt_token_ids),
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._stream(spec, result)
        except Exception as exc:  # one failed request must not end the run
            _fail(result, _describe(exc))
        return result

    async def _stream(self, spec: RequestSpec, result: RequestResult) -> None:
        body = {
            "model": self.model,
            "prompt": spec.prompt_token_ids,
            "max_tokens": spec.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        key = self.tenant_keys.get(spec.tenant)
        headers = {"Authorization": f"Bearer {key}"} if key else None
        async with self.client.stream(
            "POST", "/v1/completions", json=body, headers=headers
        ) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                _fail(result, f"HTTP {response.status_code}: {text}")
                return
            result.accepted_s = time.perf_counter()
            result.request_id = response.headers.get("x-request-id", "")
            await _read_events(response, result)


async def _read_events(response: httpx.Response, result: RequestResult) -> None:
    """Fill `result` from the SSE lines until [DONE] or an error chunk."""
    usage: dict[str, Any] | None = None
    async for line in response.aiter_lines():
        now_s = time.perf_counter()  # before parsing, so JSON cost is not in the timings
        payload = _data_payload(line)
        if payload is None:
            continue
        if payload == "[DONE]":
            _finish(result, usage, now_s)
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            _fail(result, _error_message(chunk["error"]), now_s)
            return
        if _chunk_text(chunk):
            result.chunk_times_s.append(now_s)
        usage = chunk.get("usage") or usage
    _fail(result, "stream closed before [DONE]")


def _data_payload(line: str) -> str | None:
    # Comments (": ping" keep-alives), event names and blank separators carry no data.
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    return (choices[0].get("text") or "") if choices else ""


def _error_message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _finish(result: RequestResult, usage: dict[str, Any] | None, now_s: float) -> None:
    result.is_ok = True
    result.end_s = now_s
    if usage is None:
        result.num_output_tokens = len(result.chunk_times_s)
        return
    result.num_output_tokens = int(usage.get("completion_tokens", len(result.chunk_times_s)))
    result.num_prompt_tokens = int(usage.get("prompt_tokens", result.num_prompt_tokens))


def _describe(exc: Exception) -> str:
    # A timeout's str() is empty; the type name alone still says what happened.
    detail = str(exc)
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _fail(result: RequestResult, error: str, now_s: float | None = None) -> None:
    result.is_ok = False
    result.error = error
    result.end_s = time.perf_counter() if now_s is None else now_s
    result.num_output_tokens = len(result.chunk_times_s)


@contextmanager
def progress_bar(num_total: int, is_shown: bool) -> Iterator[Callable[[], None]]:
    """Yield a function that counts one completed request."""
    if not is_shown:
        yield lambda: None
        return
    columns = (TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        task_id = progress.add_task("requests", total=num_total)
        yield lambda: progress.advance(task_id)
