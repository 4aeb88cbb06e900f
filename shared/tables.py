"""The SQL tables: tenants and their keys, model deployments, requests and their usage.

`Sequence` (a request's in-flight generation state and KV-cache blocks) is deliberately
not here: it lives only in a worker's memory.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy import Index, column, func, text
from sqlmodel import Field, SQLModel, UniqueConstraint

from shared.keys import deployment_name


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:16]}"


class Tenant(SQLModel, table=True):
    # Names are unique ignoring case too: `Acme` and `acme` would be two tenants an operator
    # cannot tell apart in a listing (migration 0002).
    __table_args__ = (Index("ux_tenant_name_lower", func.lower(column("name")), unique=True),)

    id: str = Field(default_factory=lambda: new_id("ten"), primary_key=True)
    name: str = Field(unique=True, index=True)
    tier: int = 1  # priority tier: higher wins contested admission into the batch
    weight: int = 1  # share of the batch under weighted fair queuing (charged in tokens)
    # Admission limits, enforced in Redis by the API; None means unlimited.
    max_requests_in_flight: int | None = None  # admitted and not yet finished
    max_requests_queued: int | None = None  # admitted and not yet pulled by a worker
    tokens_per_minute: int | None = None  # prompt + max_tokens reserved, settled on completion
    requests_per_minute: int | None = None
    max_tokens_per_request: int | None = None  # cap on a request's `max_tokens`
    # Days a request's prompt and output are kept (`RequestContent`); None: never stored.
    content_retention_days: int | None = None
    is_disabled: bool = False
    created_at: datetime = Field(default_factory=utcnow)
    updated_at: datetime = Field(default_factory=utcnow)


class ApiKey(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    tenant_id: str = Field(foreign_key="tenant.id", index=True)
    key_hash: str = Field(
        unique=True, index=True
    )  # HMAC-SHA256(pepper, key); the key is never stored
    prefix: str  # first characters, to tell keys apart in listings
    created_at: datetime = Field(default_factory=utcnow)
    revoked_at: datetime | None = None


class ModelDeployment(SQLModel, table=True):
    """One version of a model. Requests for the model id go to its stable version, and to a
    canary version while a `Rollout` runs (`shared/routing.py`)."""

    __table_args__ = (UniqueConstraint("model_id", "version"),)

    id: int | None = Field(default=None, primary_key=True)
    model_id: str = Field(index=True)
    version: str = "1"
    source: str  # "smollm2-135m", a local HF directory, or a .gguf file
    max_context_tokens: int
    is_active: bool = True
    # The version that takes the model's traffic outside a rollout: one per model, set for
    # its first version and moved by a promoted rollout (migration 0003).
    is_stable: bool = False
    created_at: datetime = Field(default_factory=utcnow)

    @property
    def name(self) -> str:
        """`model@version`: the name of this version in Redis keys, metrics and logs."""
        return deployment_name(self.model_id, self.version)


class Rollout(SQLModel, table=True):
    """A canary rollout of a model's version: its share of the model's requests over time, and
    how it ended (`shared/rollouts.py`; the control process moves it, `control/rollouts.py`).
    At most one per model is `running`: a unique index over the running ones, so two
    starts racing cannot both insert (migration 0004)."""

    __table_args__ = (
        Index(
            "ux_rollout_running_model",
            "model_id",
            unique=True,
            sqlite_where=text("state = 'running'"),
            postgresql_where=text("state = 'running'"),
        ),
    )

    id: int | None = Field(default=None, primary_key=True)
    model_id: str = Field(index=True)
    stable_deployment_id: int = Field(foreign_key="modeldeployment.id")
    canary_deployment_id: int = Field(foreign_key="modeldeployment.id")
    percent: float  # the canary's share of the model's requests now, 0-100
    step_percent: float = 0.0  # added every `interval_s` while healthy; 0: held there
    interval_s: float = 60.0
    sticky: str = "none"  # none | tenant | user: how a request's point is drawn
    # Requests each version needs in the window before the canary is judged; None: the
    # setting `rollout_min_num_samples`.
    min_num_samples: int | None = None
    state: str = Field(default="running", index=True)  # running|promoted|rolled_back|aborted
    cause: str | None = None  # a rollback's: ttft_p99 | itl_p99 | error_rate
    reason: str | None = None  # why it ended, with the figures
    started_at: datetime = Field(default_factory=utcnow)
    stepped_at: datetime = Field(default_factory=utcnow)  # its percent last changed
    finished_at: datetime | None = None


class InferenceRequest(SQLModel, table=True):
    id: str = Field(primary_key=True)  # the request id clients see
    tenant_id: str = Field(foreign_key="tenant.id", index=True)
    deployment_id: int = Field(foreign_key="modeldeployment.id")
    kind: str  # "completion" | "chat"
    sampling_json: str
    num_prompt_tokens: int
    status: str  # "completed" | "cancelled" | "failed"
    finish_reason: str | None = None
    arrived_at: datetime
    finished_at: datetime = Field(default_factory=utcnow)


class UsageRecord(SQLModel, table=True):
    """One billed request, and one link of its tenant's tamper-evident chain (`control/ledger.py`)."""

    __table_args__ = (UniqueConstraint("tenant_id", "seq"),)

    id: int | None = Field(default=None, primary_key=True)
    request_id: str = Field(foreign_key="inferencerequest.id", unique=True, index=True)
    tenant_id: str = Field(foreign_key="tenant.id", index=True)
    deployment_id: int = Field(foreign_key="modeldeployment.id")
    input_tokens: int
    output_tokens: int  # delivered: what is billed
    computed_tokens: int = 0  # prompt, decodes and recompute after preemptions: the cost
    finish_reason: str
    arrived_at: datetime
    finished_at: datetime
    created_at: datetime = Field(default_factory=utcnow)
    seq: int  # position in the tenant's chain: 1, 2, 3... without gaps
    prev_link: str  # the previous record's `link` ("" for the first)
    link: str  # HMAC(ledger secret, canonical record + seq + prev_link), hex


class UsageChainHead(SQLModel, table=True):
    """The last link of a tenant's chain, updated with each append (and locked by it)."""

    tenant_id: str = Field(foreign_key="tenant.id", primary_key=True)
    seq: int
    link: str


class ChainHeadExport(SQLModel, table=True):
    """A signed snapshot of every chain head; the same document is written to a file to ship
    off the box, so that a rewrite of a whole chain after it is detectable."""

    id: int | None = Field(default=None, primary_key=True)
    document: str  # canonical JSON: {"exported_at", "heads": [{tenant_id, seq, link}]}
    signature: str  # HMAC(ledger secret, document), hex
    created_at: datetime = Field(default_factory=utcnow)


class RequestContent(SQLModel, table=True):
    """A request's prompt and output, kept only under its tenant's retention policy."""

    request_id: str = Field(foreign_key="inferencerequest.id", primary_key=True)
    tenant_id: str = Field(foreign_key="tenant.id", index=True)
    prompt_token_ids_json: str  # JSON list: the worker that ends a request has no tokenizer
    output: str
    expires_at: datetime = Field(index=True)
