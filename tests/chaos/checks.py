"""The pass criteria, checked from the client's log against Redis and SQL once faults stop,
and the summary table of a scenario."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

import redis
from sqlalchemy import create_engine, text

from shared import keys
from shared.protocol import ErrorEvent, FinalEvent, TokenEvent, decode_event
from tests.chaos.client import RequestLog

COMPLETED = {"stop", "length"}
EXPIRED_ERRORS = {"queue_timeout"}


@dataclass(frozen=True, slots=True)
class UsageRow:
    output_tokens: int
    finish_reason: str


def final_state(log: RequestLog, usage: UsageRow | None) -> str:
    """completed | expired | cancelled | failed:<code> | broken:<why>."""
    if log.is_disconnected:
        return (
            "cancelled"
            if usage is not None and usage.finish_reason == "cancelled"
            else (f"broken:disconnected-but-{usage.finish_reason if usage else 'no-usage'}")
        )
    ends = [*log.finish_reasons, *log.error_codes]
    if log.num_done != 1 or len(ends) != 1:
        return f"broken:{len(ends)}-ends-{log.num_done}-done"
    (end,) = ends
    if log.error_codes:
        return "expired" if end in EXPIRED_ERRORS else f"failed:{end}"
    if end in COMPLETED:
        return "completed"
    return "expired" if end == "deadline" else f"ended:{end}"


def usage_rows(db_path) -> dict[str, list[UsageRow]]:
    engine = create_engine(f"sqlite:///{db_path}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT request_id, output_tokens, finish_reason FROM usagerecord")
            ).all()
    finally:
        engine.dispose()
    by_request: dict[str, list[UsageRow]] = {}
    for request_id, output_tokens, finish_reason in rows:
        by_request.setdefault(request_id, []).append(UsageRow(output_tokens, finish_reason))
    return by_request


def journal(client: redis.Redis, request_id: str) -> list:
    entries = client.xrange(keys.request_events(request_id))
    return [decode_event(fields[b"e"]) for _, fields in entries]


def check_request(
    log: RequestLog, events: list, usage: list[UsageRow], allowed_errors: set[str]
) -> list[str]:
    """What is wrong with one request (empty: nothing)."""
    rid, problems = log.request_id, []
    state = final_state(log, usage[0] if usage else None)
    if state.startswith(("broken", "ended")):
        problems.append(f"{rid}: {state} {log.http_errors[-3:]}")
    if state.startswith("failed:") and state[7:] not in allowed_errors:
        problems.append(f"{rid}: unexpected error {state[7:]}")
    if log.spec.is_poison and state != "failed:model_error":
        problems.append(f"{rid}: a poison prompt ended {state}")
    if not log.spec.is_poison and state == "failed:model_error":
        problems.append(f"{rid}: model_error for a prompt without the poison token")
    if log.chunk_ids - {rid}:
        problems.append(f"{rid}: chunks of other requests {log.chunk_ids - {rid}}")
    if len(usage) != 1:
        problems.append(f"{rid}: {len(usage)} usage records")
    if state == "completed" and usage and usage[0].output_tokens != log.completion_tokens:
        problems.append(f"{rid}: usage {usage[0].output_tokens} != {log.completion_tokens} got")
    problems += _check_against_journal(log, events, is_complete=not log.is_disconnected)
    return problems


def _check_against_journal(log: RequestLog, events: list, *, is_complete: bool) -> list[str]:
    """The client got exactly the journal's events, in order, none twice, none missing
    (a token event with no text yet makes no SSE event, so it has no `id:`)."""
    rid = log.request_id
    expected_ids = [e.seq for e in events if not (isinstance(e, TokenEvent) and e.text == "")]
    expected_text = "".join(e.text for e in events if isinstance(e, TokenEvent | FinalEvent))
    got_ids = log.event_ids
    if is_complete:
        if got_ids != expected_ids:
            return [f"{rid}: ids {_brief(got_ids)} != journal {_brief(expected_ids)}"]
        if log.text != expected_text:
            return [f"{rid}: text differs from the journal's"]
        if not events or not isinstance(events[-1], FinalEvent | ErrorEvent):
            return [f"{rid}: the journal has no end"]
        return []
    if got_ids != expected_ids[: len(got_ids)] or not expected_text.startswith(log.text):
        return [f"{rid}: the stream before the disconnect differs from the journal"]
    return []


def _brief(ids: list[int]) -> str:
    return str(ids) if len(ids) < 12 else f"[{ids[0]}..{ids[-1]}] ({len(ids)})"


def summary(name: str, logs: list[RequestLog], states: list[str], wall_s: float) -> str:
    """One scenario's line of the table (see `SUMMARY_HEADER`)."""
    counts = Counter(states)
    failed = ",".join(f"{s[7:]}={n}" for s, n in sorted(counts.items()) if s.startswith("failed:"))
    latencies = sorted(log.latency_s for log in logs if log.latency_s is not None)
    p50 = statistics.median(latencies) if latencies else 0.0
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0.0
    broken = sum(n for s, n in counts.items() if s.startswith(("broken", "ended")))
    return (
        f"{name:<20} {len(logs):>5} {counts['completed']:>5} {failed or '-':<22} "
        f"{counts['cancelled']:>5} {counts['expired']:>5} {broken:>6} "
        f"{sum(1 for log in logs if log.num_resumes):>7} {p50:>6.2f} {p99:>6.2f} {wall_s:>6.1f}"
    )


SUMMARY_HEADER = (
    f"{'scenario':<20} {'reqs':>5} {'done':>5} {'failed (code=n)':<22} {'cancl':>5} "
    f"{'expir':>5} {'broken':>6} {'resumed':>7} {'p50_s':>6} {'p99_s':>6} {'wall_s':>6}"
)
