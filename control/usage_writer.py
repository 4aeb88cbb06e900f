"""Durable usage, written by the control process: one `InferenceRequest` and one
`UsageRecord` per finished request, in one transaction that also appends the record to its
tenant's chain (`control/ledger.py`), and the prompts and outputs a tenant's retention
policy keeps, until the purge deletes them."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.engine import Engine
from sqlmodel import col, select

from control import ledger
from shared.db import session_scope
from shared.protocol import FinishReason, UsageEvent
from shared.tables import InferenceRequest, RequestContent, UsageRecord
from shared.tenants import retention_days_in_range

_STATUS = {
    FinishReason.STOP: "completed",
    FinishReason.LENGTH: "completed",
    FinishReason.CANCELLED: "cancelled",
}


def record(engine: Engine, event: UsageEvent, ledger_key: bytes) -> bool:
    """Insert-if-absent, in one transaction: the request, its usage record chained to its
    tenant's ledger (`control/ledger.py`), and its content under a retention policy. A
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
        finish_reason=event.finish_reason.value,
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
        finish_reason=event.finish_reason.value,
        arrived_at=arrived_at,
        finished_at=finished_at,
        seq=0,  # the chain position and links: `ledger.append` fills them in
        prev_link="",
        link="",
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
        result = session.exec(delete(RequestContent).where(col(RequestContent.expires_at) <= now))
        session.commit()
        return result.rowcount
