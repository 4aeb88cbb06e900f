"""Structured logs: JSON lines with the request's fields, uvicorn's access line as fields (the
running platform's log lines: tests/e2e/test_logs.py)."""

from __future__ import annotations

import asyncio
import io
import json
import logging

from shared import logs


def _capture(logger_name: str = "llmfleet.test") -> tuple[logging.Logger, io.StringIO]:
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger(logger_name)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, buffer


def _lines(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_a_record_is_one_json_object_with_its_extra_fields():
    logger, buffer = _capture()
    logger.info("request %s", "finished", extra={"finish_reason": "stop", "num_output_tokens": 3})
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    first, second = _lines(buffer)
    assert first["message"] == "request finished" and first["level"] == "INFO"
    assert first["logger"] == "llmfleet.test" and first["num_output_tokens"] == 3
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc"]


async def test_bound_request_fields_follow_the_request_into_its_tasks_only():
    logger, buffer = _capture()

    async def handle(request_id: str) -> None:
        logs.bind_request(request_id, "ten_1", "m")
        await asyncio.create_task(asyncio.sleep(0))  # a task started later inherits them
        logger.info("streaming")

    await asyncio.gather(asyncio.create_task(handle("r1")), asyncio.create_task(handle("r2")))
    logger.info("outside")
    lines = _lines(buffer)
    assert sorted(line["request_id"] for line in lines[:2]) == ["r1", "r2"]
    assert all(line["tenant_id"] == "ten_1" and line["model"] == "m" for line in lines[:2])
    assert "request_id" not in lines[2]


def test_uvicorn_access_line_becomes_fields():
    logger, buffer = _capture("uvicorn.access")
    logger.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "POST", "/v1/completions", "1.1", 429)
    (line,) = _lines(buffer)
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/completions", 429)


def test_text_format_for_terminals():
    config = logs.logging_config("DEBUG", "text")
    assert config["formatters"]["default"] == {"format": logs.TEXT_FORMAT}
    assert config["root"]["level"] == "DEBUG"
    assert logs.logging_config()["formatters"]["default"]["()"] == "shared.logs.JsonFormatter"
