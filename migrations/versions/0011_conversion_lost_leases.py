"""conversion: leases lost to an expired lease are counted apart from attempts (issue 26 §2)

An expired lease gives its attempt back (our own infrastructure lost it, not the gateway) and adds to
`lost_leases`; a job that loses its worker RETRY_MAX_ATTEMPTS times is a poison pill and fails.

Revision ID: 0011
Revises: 0602
Create Date: 2026-11-26 19:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | None = '0602'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('conversion_jobs', sa.Column('lost_leases', sa.Integer(), server_default='0', nullable=False))


def downgrade() -> None:
    op.drop_column('conversion_jobs', 'lost_leases')
