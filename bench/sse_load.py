"""The load generator of `llmfleet bench --platform-load`: thousands of concurrent SSE streams
from one process, at little cost to the machine it shares with the platform it measures.

Each stream is an asyncio `Protocol` on a raw loopback socket (uvloop's event loop): one
HTTP/1.1 POST with `Connection: close`, then the answer read as lines. With `keep_alive`
(closed loop only), each of the `concurrency` lanes keeps its connection and sends its next
request on it once the answer's chunked body has ended, as a pooling client (the OpenAI
SDK's httpx) or a load balancer's upstream pool does; a lane whose answer was not a 200
stream, or whose connection broke, opens a new one. A stream costs a
socket and this small parser, not an HTTP client's connection and a task iterating over
lines. Only the status line and the `data:` lines are looked at: the chunked transfer's
size lines never start with `data:`, and uvicorn writes each SSE event as one chunk, so a
data line is never cut by the framing. Each content chunk's arrival is timestamped with
`time.perf_counter()` (CLOCK_MONOTONIC on Linux: one clock for every process of the
machine, so several client processes and the orchestrator compare); JSON is parsed only
for the usage chunk and an error.

Requests start at `start_at_s`, paced at `ramp_per_s` (open loop: each at its time,
whatever the server does) and/or bounded by `concurrency` (closed loop: a new one when one
ends). Run as a child process, so that the client can use more than one core:

    python -m bench.sse_load CONFIG.json OUT.json

It writes its records and its own CPU time (user + system) to OUT.json, so what the client
costs is known next to what the platform costs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import uvloop


@dataclass(frozen=True, slots=True)
class LoadConfig:
    host: str
    port: int
    api_key: str
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    num_requests: int
    start_at_s: float  # `time.perf_counter()` time of the first request
    ramp_per_s: float | None = None  # requests started a second; None: no pacing
    concurrency: int | None = None  # requests open at once at most; None: no bound
    timeout_s: float = 600.0  # each request's whole life
    keep_alive: bool = False  # lanes that reuse their connections (needs `concurrency`)

    def request_bytes(self) -> bytes:
        body = json.dumps(
            {
                "model": self.model,
                "prompt": self.prompt_token_ids,
                "max_tokens": self.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {self.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"Connection: {'keep-alive' if self.keep_alive else 'close'}\r\n\r\n"
        )
        return head.encode() + body


@dataclass(slots=True)
class StreamRecord:
    """One request, in `time.perf_counter()` seconds."""

    sent_s: float
    accepted_s: float = 0.0  # its 200 status line: admitted and enqueued
    end_s: float = 0.0  # `[DONE]`, its error, or the connection's end
    token_times_s: list[float] = field(default_factory=list)  # each content chunk's arrival
    num_completion_tokens: int = -1  # from the usage chunk; -1: none came
    error: str | None = None
    request_id: str = ""  # its `X-Request-Id`

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.end_s > 0

    @property
    def is_accepted(self) -> bool:
        return self.accepted_s > 0


class SSEStream(asyncio.Protocol):
    """Reads one streamed completion into its record; `done` resolves at its end. With
    `keep_alive`, the connection stays open after `[DONE]` and `reusable` resolves once the
    chunked body's last chunk has come too (`next` then reads the next answer on it)."""

    def __init__(
        self, record: StreamRecord, done: asyncio.Future[None], *, keep_alive: bool = False
    ) -> None:
        self._keep_alive = keep_alive
        self._transport: asyncio.Transport | None = None
        self.is_lost = False
        self.next(record, done)

    def next(self, record: StreamRecord, done: asyncio.Future[None]) -> None:
        self._record = record
        self._done = done
        self._buffer = b""
        self._status: int | None = None
        self._is_body = False
        self._error_body: bytes | None = None  # a non-200 answer's body, as it comes
        self._content_length: int | None = None
        self._last_chunk_seen = False
        self.reusable: asyncio.Future[None] = done.get_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def write(self, request: bytes) -> None:
        assert self._transport is not None
        self._transport.write(request)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        now_s = time.perf_counter()
        if self._error_body is not None:
            self._error_body += data
            self._end_if_error_body_whole()
            return
        lines = (self._buffer + data).split(b"\n")
        self._buffer = lines.pop()
        for index, line in enumerate(lines):
            line = line.removesuffix(b"\r")
            if self._done.done():
                self._after_done(line)
            else:
                self._line(line, now_s)
            if self._error_body is not None:  # a non-200 answer's head ended: its body
                self._error_body = b"\n".join([*lines[index + 1 :], self._buffer])
                self._buffer = b""
                self._end_if_error_body_whole()
                return

    def _end_if_error_body_whole(self) -> None:
        assert self._error_body is not None
        if self._content_length is not None and len(self._error_body) >= self._content_length:
            self._end_with_error_body()

    def _end_with_error_body(self) -> None:
        body = (self._error_body or b"").decode(errors="replace")
        self._end(f"HTTP {self._status}: {body[:200]}")

    def _after_done(self, line: bytes) -> None:
        # After `[DONE]`: the chunked body's last chunk (`0`, then an empty line) ends it.
        if line == b"0":
            self._last_chunk_seen = True
        elif line == b"" and self._last_chunk_seen and not self.reusable.done():
            self.reusable.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_lost = True
        if self._status is not None and self._status != 200:
            self._end_with_error_body()
        else:
            self._end("closed before [DONE]")
        if not self.reusable.done():
            self.reusable.set_exception(ConnectionError("the connection closed"))
            self.reusable.exception()  # retrieved: a lane that did not wait is not warned

    def _line(self, line: bytes, now_s: float) -> None:
        if self._status is None:
            self._status = int(line.split(b" ", 2)[1])
        elif not self._is_body:
            name, _, value = line.partition(b":")
            name = name.lower()
            if name == b"content-length":
                self._content_length = int(value)
            elif name == b"x-request-id":
                self._record.request_id = value.strip().decode()
            if line == b"":
                self._is_body = True
                if self._status == 200:
                    self._record.accepted_s = now_s
                else:
                    self._error_body = b""
        elif line.startswith(b"data: "):
            self._data(line[len(b"data: ") :], now_s)
        elif line == b"0":  # a chunk size: only the last chunk's is a bare 0
            self._last_chunk_seen = True
        elif line == b"" and self._last_chunk_seen:  # the body ended without [DONE]
            self._end("closed before [DONE]", now_s)

    def _data(self, data: bytes, now_s: float) -> None:
        if data == b"[DONE]":
            self._end(None, now_s)
        elif data.startswith(b'{"error"'):
            error = json.loads(data)["error"]
            self._end(f"error event: {error.get('code') or error.get('message')}", now_s)
        elif b'"choices": []' in data:  # the usage chunk
            self._record.num_completion_tokens = json.loads(data)["usage"]["completion_tokens"]
        else:
            self._record.token_times_s.append(now_s)

    def _end(self, error: str | None, now_s: float | None = None) -> None:
        if self._done.done():
            return
        self._record.error = error
        self._record.end_s = time.perf_counter() if now_s is None else now_s
        self._done.set_result(None)
        # A connection is kept only after a whole 200 stream.
        if self._transport is not None and (not self._keep_alive or error is not None):
            self._transport.close()


async def run(config: LoadConfig) -> list[StreamRecord]:
    """Every request of `config`, each recorded, never raised."""
    request = config.request_bytes()
    if config.keep_alive:
        return await _run_lanes(config, request)
    slots = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    tasks = []
    for index in range(config.num_requests):
        offset_s = index / config.ramp_per_s if config.ramp_per_s else 0.0
        await _sleep_until(config.start_at_s + offset_s)
        if slots is not None:
            await slots.acquire()
        tasks.append(asyncio.create_task(_request(config, request, slots)))
    return list(await asyncio.gather(*tasks))


async def _request(
    config: LoadConfig, request: bytes, slots: asyncio.Semaphore | None
) -> StreamRecord:
    loop = asyncio.get_running_loop()
    record = StreamRecord(sent_s=time.perf_counter())
    done: asyncio.Future[None] = loop.create_future()
    transport: asyncio.BaseTransport | None = None
    try:
        async with asyncio.timeout(config.timeout_s):
            transport, _ = await loop.create_connection(
                lambda: SSEStream(record, done), config.host, config.port
            )
            transport.write(request)
            await done
    except TimeoutError:
        record.error, record.end_s = "timeout", time.perf_counter()
    except OSError as exc:
        record.error, record.end_s = f"connect: {exc.strerror or exc}", time.perf_counter()
    finally:
        if transport is not None:
            transport.close()
        if slots is not None:
            slots.release()
    return record


async def _run_lanes(config: LoadConfig, request: bytes) -> list[StreamRecord]:
    """Closed loop over kept-alive connections: `concurrency` lanes, each sending its next
    request once its last answer has ended, on the same connection while it holds."""
    if not config.concurrency or config.ramp_per_s:
        raise ValueError("keep_alive runs a closed loop: concurrency, without a ramp")
    await _sleep_until(config.start_at_s)
    records: list[StreamRecord] = []
    num_lanes = min(config.concurrency, config.num_requests)

    async def lane() -> None:
        loop = asyncio.get_running_loop()
        stream: SSEStream | None = None
        while len(records) < config.num_requests:
            record = StreamRecord(sent_s=time.perf_counter())
            records.append(record)
            done: asyncio.Future[None] = loop.create_future()
            try:
                async with asyncio.timeout(config.timeout_s):
                    if stream is None or stream.is_lost:
                        _, stream = await loop.create_connection(
                            functools.partial(SSEStream, record, done, keep_alive=True),
                            config.host,
                            config.port,
                        )
                    else:
                        stream.next(record, done)
                    stream.write(request)
                    await done
                    if record.error is None:
                        await stream.reusable
                    else:
                        stream = None  # closed by itself
            except TimeoutError:
                record.error, record.end_s = record.error or "timeout", time.perf_counter()
                _close(stream)
                stream = None
            except OSError as exc:  # connect, or the kept connection closed
                if not record.end_s:
                    record.error, record.end_s = f"connect: {exc}", time.perf_counter()
                _close(stream)
                stream = None

    await asyncio.gather(*(lane() for _ in range(num_lanes)))
    return records


def _close(stream: SSEStream | None) -> None:
    if stream is not None:
        stream.close()


async def _sleep_until(at_s: float) -> None:
    if (delay_s := at_s - time.perf_counter()) > 0:
        await asyncio.sleep(delay_s)


def cpu_s() -> float:
    """This process's CPU time so far (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(config_path: str, out_path: str) -> None:
    config = LoadConfig(**json.loads(Path(config_path).read_text()))
    records = uvloop.run(run(config))
    payload = {"cpu_s": cpu_s(), "records": [asdict(r) for r in records]}
    Path(out_path).write_text(json.dumps(payload))


if __name__ == "__main__":
    main(*sys.argv[1:3])
