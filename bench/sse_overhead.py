"""The CPU one SSE response costs its API process, apart from what it writes: sse-starlette's
`EventSourceResponse` against ours (`api/sse_response.py`), each writing the same three
events to an ASGI `send` that takes everything at once, 256 responses at a time, on uvloop
as uvicorn runs them.

    python -m bench.sse_overhead --json bench/results/sse-overhead-cpu-<session>.json
"""

from __future__ import annotations

import asyncio
import json
import platform
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import typer
import uvloop
from sse_starlette import EventSourceResponse

from api.broker import Interruption
from api.sse_response import SubscriptionStream
from api.streaming import ChunkFormat
from bench.platform_load import machine
from shared.protocol import FinalEvent, TokenEvent, Usage

CONCURRENCY = 256
EVENTS = (
    TokenEvent(seq=0, text="a", num_tokens=1),
    TokenEvent(seq=1, text="b", num_tokens=1),
    FinalEvent(
        seq=2, text="c", finish_reason="length", usage=Usage(prompt_tokens=4, completion_tokens=3)
    ),
)
_FMT = ChunkFormat("cmpl-1", "m", is_chat=False, include_usage=False, created=0)


class _Subscription:
    """The three events at once, as a request's subscription hands them out."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(request_id="cmpl-1")
        self.next_seq = 0
        self.is_finished = False
        self.interruption: Interruption | None = None

    async def events(self, keepalive_s: float | None = None):
        for event in EVENTS:
            self.next_seq = event.seq + 1
            self.is_finished = isinstance(event, FinalEvent)
            yield event

    def interrupt(self, reason: Interruption) -> None:
        self.interruption = self.interruption or reason

    async def close(self, *, cancel_if_unfinished: bool = True) -> None:
        pass


async def _body():
    for event in EVENTS:
        yield f"data: {event.model_dump_json()}\r\n\r\n".encode()


def _ours() -> Any:
    return SubscriptionStream(
        _Subscription(),  # type: ignore[arg-type]
        _FMT,
        send_timeout_s=30,
        keepalive_s=15,
        headers={"X-Request-Id": "cmpl-1"},
    )


def _sse_starlette() -> Any:
    return EventSourceResponse(_body(), ping=15, headers={"X-Request-Id": "cmpl-1"})


async def _cpu_per_response_us(make_response, num_responses: int) -> float:
    client_left = asyncio.Event()  # never set: every response runs to its end

    async def receive() -> dict:
        await client_left.wait()
        return {"type": "http.disconnect"}

    async def send(_message: dict) -> None:
        pass

    scope = {"type": "http", "method": "POST"}
    num_waves = max(num_responses // CONCURRENCY, 1)
    start_s = time.process_time()
    for _ in range(num_waves):
        await asyncio.gather(*(make_response()(scope, receive, send) for _ in range(CONCURRENCY)))
    return (time.process_time() - start_s) / (num_waves * CONCURRENCY) * 1e6


async def _measure(num_responses: int, repeats: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {"sse_starlette": [], "ours": []}
    await _cpu_per_response_us(_ours, CONCURRENCY)  # warm up both
    await _cpu_per_response_us(_sse_starlette, CONCURRENCY)
    for _ in range(repeats):
        results["sse_starlette"].append(await _cpu_per_response_us(_sse_starlette, num_responses))
        results["ours"].append(await _cpu_per_response_us(_ours, num_responses))
    return results


def main(
    num_responses: Annotated[int, typer.Option(help="responses per measurement")] = 20_000,
    repeats: Annotated[int, typer.Option(help="measurements of each, alternated")] = 3,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the result here")] = None,
) -> None:
    results = uvloop.run(_measure(num_responses, repeats))
    medians = {name: sorted(values)[len(values) // 2] for name, values in results.items()}
    report = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine(), "python": platform.python_version()},
        "num_responses": num_responses,
        "concurrency": CONCURRENCY,
        "cpu_per_response_us": results,
        "median_us": medians,
    }
    for name, value in medians.items():
        print(f"{name}: {value:.1f} us of CPU per response (median of {repeats})")
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
