"""upstream retry budget (core): a retry the upstream answered well gives its share back (issue 26: after an
outage the failed entities' retries flow at the upstream's limits, not at the budget's floor)

Revision ID: 0012
Revises: 0031
Create Date: 2026-11-27 04:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from redrive.upstreams import ACQUIRE_FUNCTION

revision: str = '0012'
down_revision: str | None = '0031'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('upstream_calls', sa.Column('retries_ok', sa.Integer(), server_default='0', nullable=False))
    op.execute(ACQUIRE_FUNCTION)


def downgrade() -> None:
    op.drop_column('upstream_calls', 'retries_ok')
    op.execute(ACQUIRE_FUNCTION.replace("c.retries - c.retries_ok", "c.retries")
               .replace("CASE WHEN p_retry THEN 1 ELSE 0 END, 0)", "CASE WHEN p_retry THEN 1 ELSE 0 END)"))
