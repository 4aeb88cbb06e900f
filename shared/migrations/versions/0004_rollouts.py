"""Canary rollouts: the `rollout` table.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-08 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
import sqlmodel.sql.sqltypes
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rollout",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("stable_deployment_id", sa.Integer(), nullable=False),
        sa.Column("canary_deployment_id", sa.Integer(), nullable=False),
        sa.Column("percent", sa.Float(), nullable=False),
        sa.Column("step_percent", sa.Float(), nullable=False),
        sa.Column("interval_s", sa.Float(), nullable=False),
        sa.Column("sticky", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("min_num_samples", sa.Integer(), nullable=True),
        sa.Column("state", sqlmodel.sql.sqltypes.AutoString(), nullable=False),
        sa.Column("cause", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("reason", sqlmodel.sql.sqltypes.AutoString(), nullable=True),
        sa.Column("started_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("stepped_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
        sa.Column("finished_at", sqlmodel.sql.sqltypes.UTCDateTime(), nullable=True),
        sa.ForeignKeyConstraint(["canary_deployment_id"], ["modeldeployment.id"]),
        sa.ForeignKeyConstraint(["stable_deployment_id"], ["modeldeployment.id"]),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("rollout", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_rollout_model_id"), ["model_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_rollout_state"), ["state"], unique=False)
    # One running rollout per model, whoever starts it.
    running = sa.text("state = 'running'")
    op.create_index(
        "ux_rollout_running_model",
        "rollout",
        ["model_id"],
        unique=True,
        sqlite_where=running,
        postgresql_where=running,
    )


def downgrade() -> None:
    op.drop_index("ux_rollout_running_model", table_name="rollout")
    with op.batch_alter_table("rollout", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollout_state"))
        batch_op.drop_index(batch_op.f("ix_rollout_model_id"))
    op.drop_table("rollout")
