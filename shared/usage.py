"""Usage as every process sees it: the `UsageEvent` whoever ends a request builds
(`usage_event`) and enqueues for the control process (`shared/usage_jobs.py`), which
writes it (`control/usage_writer.py`); totals for reports."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from shared.db import session_scope
from shared.protocol import FinishReason, QueuedRequest, UsageEvent
from shared.tables import ModelDeployment, UsageRecord


def usage_event(
    request: QueuedRequest,
    *,
    finish_reason: FinishReason,
    num_output_tokens: int,
    num_computed_tokens: int,
    output_text: str | None = None,
) -> UsageEvent:
    """The usage of a finished request, with its prompt and output only if its tenant keeps
    them. The output tokens are those delivered."""
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
        .join(ModelDeployment, col(ModelDeployment.id) == UsageRecord.deployment_id)
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
