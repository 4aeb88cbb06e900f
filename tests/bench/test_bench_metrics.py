"""bench.metrics and bench.report on hand-made results; bench.client against a fake SSE server."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from bench.client import RequestResult, run_http
from bench.metrics import percentiles, summarize
from bench.report import format_table, plot, write_json
from bench.workload import make_workload
from tests.bench.servers import serving

API_KEY = "test-key"
NUM_USAGE_TOKENS = 7  # differs from the 3 text chunks, so the test sees usage win


def result(
    index: int, start_s: float, chunk_times_s: list[float], end_s: float, *,
    num_output_tokens: int, num_prompt_tokens: int = 10, is_ok: bool = True,
) -> RequestResult:  # fmt: skip
    return RequestResult(
        index=index,
        is_ok=is_ok,
        error=None if is_ok else "boom",
        start_s=start_s,
        chunk_times_s=chunk_times_s,
        end_s=end_s,
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
    )


def hand_made_results() -> list[RequestResult]:
    """Per request: TTFT, ITL gaps, TPOT, E2E, and whether it meets TTFT 2 s / TPOT 0.2 s."""
    return [
        # TTFT 0.5, ITL [0.1, 0.2], TPOT 0.3/3 = 0.1, E2E 0.9: within SLO
        result(0, 0.0, [0.5, 0.6, 0.8], 0.9, num_output_tokens=4, num_prompt_tokens=10),
        # TTFT 2.5 (too slow), ITL [0.1], TPOT 0.1, E2E 2.7
        result(1, 1.0, [3.5, 3.6], 3.7, num_output_tokens=2, num_prompt_tokens=20),
        # TTFT 0.1, ITL [0.5], TPOT 0.5 (too slow), E2E 0.7
        result(2, 2.0, [2.1, 2.6], 2.7, num_output_tokens=2, num_prompt_tokens=5),
        # TTFT 0.3, no ITL, no TPOT (one token), E2E 0.4: within SLO on TTFT alone
        result(3, 0.0, [0.3], 0.4, num_output_tokens=1, num_prompt_tokens=3),
        # failed: counted, but none of its timings or tokens are
        result(4, 0.0, [0.2], 0.5, num_output_tokens=1, num_prompt_tokens=7, is_ok=False),
    ]


def test_percentiles_interpolate_linearly():
    stats = percentiles([5.0, 1.0, 3.0, 2.0, 4.0])
    assert stats == pytest.approx({"p50": 3.0, "p90": 4.6, "p99": 4.96, "max": 5.0, "mean": 3.0})


def test_percentiles_of_nothing_are_zero():
    assert percentiles([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "mean": 0.0}


def test_request_result_properties():
    r = hand_made_results()[0]
    assert r.ttft_s == pytest.approx(0.5)
    assert r.itl_s == pytest.approx([0.1, 0.2])
    assert r.tpot_s == pytest.approx(0.1)
    assert r.e2e_s == pytest.approx(0.9)
    no_text = result(9, 1.0, [], 2.0, num_output_tokens=0)
    assert (no_text.ttft_s, no_text.tpot_s, no_text.itl_s) == (None, None, [])


def test_summarize_counts_only_successful_requests():
    summary = summarize(hand_made_results(), 4.0, slo_ttft_s=2.0, slo_tpot_s=0.2)
    assert summary["num_requests"] == 5
    assert summary["num_ok"] == 4
    assert summary["num_failed"] == 1
    assert summary["duration_s"] == 4.0
    assert summary["total_output_tokens"] == 9
    assert summary["total_prompt_tokens"] == 38
    assert summary["output_tokens_per_s"] == pytest.approx(9 / 4)
    assert summary["requests_per_s"] == pytest.approx(4 / 4)
    assert summary["goodput_requests_per_s"] == pytest.approx(2 / 4)
    assert summary["slo"] == {"ttft_s": 2.0, "tpot_s": 0.2, "num_within_slo": 2}


def test_summarize_latency_percentiles():
    summary = summarize(hand_made_results(), 4.0)
    # TTFT [0.1, 0.3, 0.5, 2.5]; ITL pooled [0.1, 0.1, 0.2, 0.5]; TPOT [0.1, 0.1, 0.5]
    assert summary["ttft_s"] == pytest.approx(
        {"p50": 0.4, "p90": 1.9, "p99": 2.44, "max": 2.5, "mean": 0.85}
    )
    assert summary["itl_s"]["p50"] == pytest.approx(0.15)
    assert summary["itl_s"]["mean"] == pytest.approx(0.225)
    assert summary["itl_s"]["max"] == pytest.approx(0.5)
    assert summary["tpot_s"]["p50"] == pytest.approx(0.1)
    assert summary["tpot_s"]["mean"] == pytest.approx(0.7 / 3)
    assert summary["e2e_s"]["p50"] == pytest.approx(0.8)
    assert summary["e2e_s"]["max"] == pytest.approx(2.7)


def test_summarize_with_no_time_has_zero_rates():
    summary = summarize([], 0.0)
    assert summary["num_requests"] == 0
    assert summary["output_tokens_per_s"] == 0.0
    assert summary["goodput_requests_per_s"] == 0.0


def test_summary_is_strict_json(tmp_path):
    summary = summarize(hand_made_results(), 4.0)
    path = tmp_path / "out" / "summary.json"
    write_json(path, {"runs": {"a": summary}})
    assert json.loads(path.read_text()) == {"runs": {"a": summary}}
    json.dumps(summarize([], 1.0), allow_nan=False)


def test_format_table_has_a_row_per_name():
    summary = summarize(hand_made_results(), 4.0)
    table = format_table({"llmfleet": summary, "vllm-baseline": summary})
    lines = table.splitlines()
    assert len(lines) == 4  # header, rule, two rows
    assert "TTFT p50" in lines[0]
    assert lines[2].startswith("llmfleet")
    assert lines[3].startswith("vllm-baseline")
    assert "400.0" in lines[2]  # TTFT p50 in ms
    assert len({len(line) for line in lines}) == 1  # fixed width


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "plots" / "run.png"
    plot({"a": hand_made_results(), "b": hand_made_results()[:2], "empty": []}, path)
    assert path.read_bytes().startswith(b"\x89PNG")


# -- bench.client against a fake OpenAI-compatible server over real loopback HTTP ----------


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def fake_openai_app(bodies: list[dict]) -> Starlette:
    """Streams an empty chunk, 3 text chunks, usage and [DONE]; prompt [0] gets a 500."""

    async def events(body: dict) -> Any:
        yield ": ping\n\n"
        yield sse({"choices": [{"index": 0, "text": "", "finish_reason": None}]})
        for text in ("a", "b", "c"):
            await asyncio.sleep(0.01)
            yield sse({"choices": [{"index": 0, "text": text, "finish_reason": None}]})
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": NUM_USAGE_TOKENS}
        yield sse({"choices": [], "usage": usage})
        yield "data: [DONE]\n\n"

    async def completions(request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return PlainTextResponse("no key", status_code=401)
        body = await request.json()
        bodies.append(body)
        if body["prompt"] == [0]:
            return PlainTextResponse("boom", status_code=500)
        return StreamingResponse(events(body), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def test_run_http_against_fake_server():
    workload = make_workload(
        5, seed=0, arrival="burst", burst_window_s=0.2, prompt_tokens_min=3,
        prompt_tokens_max=6, output_tokens_mean=3.0, output_tokens_max=3,
    )  # fmt: skip
    workload[2] = dataclasses.replace(workload[2], prompt_token_ids=[0])
    bodies: list[dict] = []
    with serving(fake_openai_app(bodies)) as base_url:
        results, duration_s = asyncio.run(
            run_http(base_url, API_KEY, "tiny", workload, show_progress=False, timeout_s=10.0)
        )

    assert [r.index for r in results] == [0, 1, 2, 3, 4]
    assert duration_s >= workload[-1].arrival_s
    failed = [r for r in results if not r.is_ok]
    assert [r.index for r in failed] == [2]
    assert "500" in failed[0].error and "boom" in failed[0].error
    for spec, r in zip(workload, results, strict=True):
        if r.is_ok:
            assert r.error is None
            assert r.num_output_tokens == NUM_USAGE_TOKENS
            assert r.num_prompt_tokens == len(spec.prompt_token_ids)
            assert len(r.chunk_times_s) == 3  # the empty chunk is not timed
            assert r.start_s < r.chunk_times_s[0] < r.chunk_times_s[1] < r.chunk_times_s[2]
            assert r.chunk_times_s[2] <= r.end_s

    assert len(bodies) == 5
    for body in bodies:
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["model"] == "tiny" and body["temperature"] == 0.0
    sent_max_tokens = sorted(b["max_tokens"] for b in bodies)
    assert sent_max_tokens == sorted(spec.max_tokens for spec in workload)
    assert summarize(results, duration_s)["num_ok"] == 4
