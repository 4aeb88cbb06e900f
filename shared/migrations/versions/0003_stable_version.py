"""Model versions: `modeldeployment.is_stable`, the version that takes a model's traffic
outside a rollout.

Until now the newest active version of a model took all of its traffic; that version becomes
its stable one, so routing is unchanged by the upgrade.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-08 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("modeldeployment", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("is_stable", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    op.execute(
        sa.text(
            "UPDATE modeldeployment SET is_stable = true WHERE id IN ("
            " SELECT max(id) FROM modeldeployment WHERE is_active GROUP BY model_id)"
        )
    )


def downgrade() -> None:
    with op.batch_alter_table("modeldeployment", schema=None) as batch_op:
        batch_op.drop_column("is_stable")
