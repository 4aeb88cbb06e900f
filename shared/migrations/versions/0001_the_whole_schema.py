"""The whole schema: tenants, keys, deployments, requests, the usage ledger, retained content.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 06:30:54.071933
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "chainheadexport",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("document", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("signature", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "modeldeployment",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("version", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("source", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("max_context_tokens", sa.Integer(), nullable=False),
        sa.Column("is_active", sa.Boolean(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("model_id", "version"),
    )
    with op.batch_alter_table("modeldeployment", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_modeldeployment_model_id"), ["model_id"], unique=False)

    op.create_table(
        "tenant",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("name", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("tier", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Integer(), nullable=False),
        sa.Column("max_requests_in_flight", sa.Integer(), nullable=True),
        sa.Column("max_requests_queued", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("max_tokens_per_request", sa.Integer(), nullable=True),
        sa.Column("content_retention_days", sa.Integer(), nullable=True),
        sa.Column("is_disabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("updated_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tenant_name"), ["name"], unique=True)

    op.create_table(
        "apikey",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("key_hash", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("prefix", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("revoked_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenant.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("apikey", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_apikey_key_hash"), ["key_hash"], unique=True)
        batch_op.create_index(batch_op.f("ix_apikey_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "inferencerequest",
        sa.Column("id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("tenant_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("kind", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("sampling_json", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("num_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("finish_reason", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("arrived_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("finished_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["modeldeployment.id"],
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenant.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("inferencerequest", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_inferencerequest_tenant_id"), ["tenant_id"], unique=False
        )

    op.create_table(
        "usagechainhead",
        sa.Column("tenant_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("link", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenant.id"],
        ),
        sa.PrimaryKeyConstraint("tenant_id"),
    )
    op.create_table(
        "requestcontent",
        sa.Column("request_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("tenant_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("prompt_token_ids_json", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("output", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("expires_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["inferencerequest.id"],
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenant.id"],
        ),
        sa.PrimaryKeyConstraint("request_id"),
    )
    with op.batch_alter_table("requestcontent", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_requestcontent_expires_at"), ["expires_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_requestcontent_tenant_id"), ["tenant_id"], unique=False
        )

    op.create_table(
        "usagerecord",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("request_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("tenant_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("deployment_id", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("computed_tokens", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("arrived_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("finished_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("created_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("prev_link", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("link", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.ForeignKeyConstraint(
            ["deployment_id"],
            ["modeldeployment.id"],
        ),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["inferencerequest.id"],
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenant.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "seq"),
    )
    with op.batch_alter_table("usagerecord", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_usagerecord_request_id"), ["request_id"], unique=True)
        batch_op.create_index(batch_op.f("ix_usagerecord_tenant_id"), ["tenant_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("usagerecord", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_usagerecord_tenant_id"))
        batch_op.drop_index(batch_op.f("ix_usagerecord_request_id"))

    op.drop_table("usagerecord")
    with op.batch_alter_table("requestcontent", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_requestcontent_tenant_id"))
        batch_op.drop_index(batch_op.f("ix_requestcontent_expires_at"))

    op.drop_table("requestcontent")
    op.drop_table("usagechainhead")
    with op.batch_alter_table("inferencerequest", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_inferencerequest_tenant_id"))

    op.drop_table("inferencerequest")
    with op.batch_alter_table("apikey", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_apikey_tenant_id"))
        batch_op.drop_index(batch_op.f("ix_apikey_key_hash"))

    op.drop_table("apikey")
    with op.batch_alter_table("tenant", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tenant_name"))

    op.drop_table("tenant")
    with op.batch_alter_table("modeldeployment", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_modeldeployment_model_id"))

    op.drop_table("modeldeployment")
    op.drop_table("chainheadexport")
