"""Durable usage: one `InferenceRequest` and one `UsageRecord` per finished request, in one transaction."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy.engine import Engine
from sqlmodel import select

from shared.db import session_scope
from shared.protocol import QueuedRequest
from shared.tables import InferenceRequest, UsageRecord

_STATUS = {"stop": "completed", "length": "completed", "cancelled": "cancelled"}


def record(
    engine: Engine,
    request: QueuedRequest,
    *,
    finish_reason: str,
    num_output_tokens: int,
    num_computed_tokens: int,
) -> None:
    """Insert-if-absent: a request delivered twice, or ended by two parties, is recorded once.

    `finish_reason`: stop, length, cancelled (completed or cancelled requests), or error
    (failed: refused, lost with its worker, poisoned); the output tokens are those delivered.
    """
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
                num_prompt_tokens=len(request.prompt_token_ids),
                status=_STATUS.get(finish_reason, "failed"),
                finish_reason=finish_reason,
                arrived_at=datetime.fromtimestamp(request.arrival_ts, UTC),
            )
        )
        session.add(
            UsageRecord(
                request_id=request.request_id,
                tenant_id=request.tenant_id,
                deployment_id=request.deployment_id,
                input_tokens=len(request.prompt_token_ids),
                output_tokens=num_output_tokens,
                computed_tokens=num_computed_tokens,
                finish_reason=finish_reason,
            )
        )
        session.commit()
