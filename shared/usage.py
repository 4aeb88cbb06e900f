"""Durable usage: one `InferenceRequest` and one `UsageRecord` per finished request, in one transaction."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.engine import Engine
from sqlmodel import select

from shared.db import session_scope
from shared.protocol import QueuedRequest
from shared.tables import InferenceRequest, UsageRecord
from worker.sequence import SequenceOutput

_STATUS = {"stop": "completed", "length": "completed", "cancelled": "cancelled"}


def record(engine: Engine, request: QueuedRequest, final: SequenceOutput) -> None:
    """Insert-if-absent: a request delivered twice is recorded once."""
    assert final.finish_reason is not None
    with session_scope(engine) as session:
        existing = session.exec(
            select(UsageRecord.id).where(UsageRecord.request_id == request.request_id)
        ).first()
        if existing is not None:
            return
        session.add(
            InferenceRequest(
                id=request.request_id,
                tenant_id=request.tenant_id,
                deployment_id=request.deployment_id,
                kind=request.kind,
                sampling_json=request.sampling.model_dump_json(),
                num_prompt_tokens=final.num_prompt_tokens,
                status=_STATUS.get(final.finish_reason, "failed"),
                finish_reason=final.finish_reason,
                arrived_at=datetime.fromtimestamp(request.arrival_ts, UTC),
            )
        )
        session.add(
            UsageRecord(
                request_id=request.request_id,
                tenant_id=request.tenant_id,
                deployment_id=request.deployment_id,
                input_tokens=final.num_prompt_tokens,
                output_tokens=final.num_output_tokens,
                computed_tokens=final.num_computed_tokens,
                finish_reason=final.finish_reason,
            )
        )
        session.commit()
