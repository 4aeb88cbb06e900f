"""Durable usage: one `InferenceRequest` and one `UsageRecord` per finished request, in one
transaction that also appends the record to its tenant's chain (`shared/ledger.py`); the
prompts and outputs a tenant's retention policy keeps; totals for reports.

Whoever ends a request builds its `UsageEvent` (`usage_event`) and enqueues it for the
control process (`shared/control.py`), which calls `record`."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlmodel import select

from shared import ledger
from shared.db import session_scope
from shared.protocol import QueuedRequest, UsageEvent
from shared.tables import InferenceRequest, ModelDeployment, RequestContent, UsageRecord
from shared.tenants import retention_days_in_range

_STATUS = {"stop": "completed", "length": "completed", "cancelled": "cancelled"}


def usage_event(
    request: QueuedRequest,
    *,
    finish_reason: str,
    num_output_tokens: int,
    num_computed_tokens: int,
    output_text: str | None = None,
) -> UsageEvent:
    """The usage of a finished request, with its prompt and output only if its tenant keeps
    them. `finish_reason`: stop, length, cancelled, deadline, or error (failed: refused, lost
    with its worker, poisoned); the output tokens are those delivered."""
    is_kept = request.content_retention_days is not None
    return UsageEvent(
        request_id=request.request_id,
        tenant_id=request.tenant_id,
        deployment_id=request.deployment_id,
        kind=request.kind,
        sampling=request.sampling,
        input_tokens=len(request.prompt_token_ids),
        output_tokens=num_output_tokens,
        computed_tokens=num_computed_tokens,
        finish_reason=finish_reason,
        arrival_ts=request.arrival_ts,
        finished_ts=time.time(),
        content_retention_days=request.content_retention_days,
        prompt_token_ids=request.prompt_token_ids if is_kept else None,
        output_text=(output_text or "") if is_kept else None,
    )


def record(engine: Engine, event: UsageEvent, ledger_key: bytes) -> bool:
    """Insert-if-absent, in one transaction: the request, its usage record chained to its
    tenant's ledger (`shared/ledger.py`), and its content under a retention policy. A
    request delivered twice, or ended by two parties, is recorded once: False the second
    time."""
    arrived_at = datetime.fromtimestamp(event.arrival_ts, UTC)
    finished_at = datetime.fromtimestamp(event.finished_ts, UTC)
    with session_scope(engine) as session:
        ledger.lock_chain(session, event.tenant_id)
        existing = session.exec(
            select(UsageRecord.id).where(UsageRecord.request_id == event.request_id)
        ).first()
        if existing is not None:
            return False
        session.add(_request_row(event, arrived_at, finished_at))
        session.flush()  # the rows below reference it
        ledger.append(session, ledger_key, _usage_row(event, arrived_at, finished_at))
        if event.content_retention_days is not None:
            session.add(_content_row(event, finished_at))
        session.commit()
    return True


def _request_row(event: UsageEvent, arrived_at: datetime, finished_at: datetime):
    return InferenceRequest(
        id=event.request_id,
        tenant_id=event.tenant_id,
        deployment_id=event.deployment_id,
        kind=event.kind,
        sampling_json=event.sampling.model_dump_json(),
        num_prompt_tokens=event.input_tokens,
        status=_STATUS.get(event.finish_reason, "failed"),
        finish_reason=event.finish_reason,
        arrived_at=arrived_at,
        finished_at=finished_at,
    )


def _usage_row(event: UsageEvent, arrived_at: datetime, finished_at: datetime) -> UsageRecord:
    return UsageRecord(
        request_id=event.request_id,
        tenant_id=event.tenant_id,
        deployment_id=event.deployment_id,
        input_tokens=event.input_tokens,
        output_tokens=event.output_tokens,
        computed_tokens=event.computed_tokens,
        finish_reason=event.finish_reason,
        arrived_at=arrived_at,
        finished_at=finished_at,
    )


def _content_row(event: UsageEvent, finished_at: datetime) -> RequestContent:
    return RequestContent(
        request_id=event.request_id,
        tenant_id=event.tenant_id,
        prompt_token_ids_json=json.dumps(event.prompt_token_ids or []),
        output=event.output_text or "",
        expires_at=_expires_at(finished_at, event.content_retention_days or 0),
    )


def _expires_at(finished_at: datetime, retention_days: int) -> datetime:
    # Tenant settings are capped, but an event may carry a value stored before the cap (or
    # written straight into SQL): `timedelta` overflows past 999,999,999 days, a datetime
    # past year 9999, and a job that raised would leave the request unbilled.
    return finished_at + timedelta(days=retention_days_in_range(retention_days))


def purge_expired_content(engine: Engine, now: datetime | None = None) -> int:
    """Delete the prompts and outputs past their retention; how many."""
    now = now or datetime.now(UTC)
    with session_scope(engine) as session:
        result = session.execute(delete(RequestContent).where(RequestContent.expires_at <= now))
        session.commit()
        return result.rowcount


@dataclass(frozen=True, slots=True)
class UsageTotal:
    """One tenant's usage of one model deployment on one day (UTC, by finish time)."""

    tenant_id: str
    model_id: str
    version: str
    day: date
    num_requests: int
    input_tokens: int
    output_tokens: int
    computed_tokens: int


def totals(
    engine: Engine, start: date, end: date, tenant_id: str | None = None
) -> list[UsageTotal]:
    """Totals per tenant, model and day for requests finished from `start` to `end`, both
    days included; only `tenant_id`'s when given."""
    query = (
        select(UsageRecord, ModelDeployment.model_id, ModelDeployment.version)
        .join(ModelDeployment, ModelDeployment.id == UsageRecord.deployment_id)
        .where(UsageRecord.finished_at >= _midnight(start))
    )
    # The last day `date` holds (9999-12-31) has no next day to stop before: `end + 1 day`
    # raised OverflowError there. Nothing finishes after it, so no upper bound is the same.
    if end < date.max:
        query = query.where(UsageRecord.finished_at < _midnight(end + timedelta(days=1)))
    if tenant_id is not None:
        query = query.where(UsageRecord.tenant_id == tenant_id)
    sums: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    with session_scope(engine) as session:
        for record, model_id, version in session.exec(query):
            day = record.finished_at.astimezone(UTC).date()
            counts = sums[(record.tenant_id, model_id, version, day)]
            counts[0] += 1
            counts[1] += record.input_tokens
            counts[2] += record.output_tokens
            counts[3] += record.computed_tokens
    return [UsageTotal(*group, *counts) for group, counts in sorted(sums.items())]


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=UTC)
