"""Tenant names unique ignoring case: a unique index on lower(name).

A database that already holds two names differing only in case cannot take the index; the
upgrade stops and names them rather than renaming a tenant behind its operator's back (the
operator renames one in SQL, then starts again).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    clashes = op.get_bind().execute(
        sa.text("SELECT lower(name), count(*) FROM tenant GROUP BY lower(name) HAVING count(*) > 1")
    )
    names = sorted(row[0] for row in clashes)
    if names:
        raise RuntimeError(
            "tenant names that differ only in case must be made distinct before this "
            f"upgrade (rename all but one of each in SQL): {', '.join(names)}"
        )
    op.create_index("ux_tenant_name_lower", "tenant", [sa.text("lower(name)")], unique=True)


def downgrade() -> None:
    op.drop_index("ux_tenant_name_lower", table_name="tenant")
