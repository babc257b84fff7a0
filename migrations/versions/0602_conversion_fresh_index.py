"""conversion: a partial index of fresh queued jobs, so the claim is two index ranges (issue 13 §10)

Revision ID: 0602
Revises: 0601
Create Date: 2026-11-23 13:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0602'
down_revision: str | None = '0601'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index('ix_conversion_jobs_fresh', 'conversion_jobs', ['created_at', 'id'], unique=False,
                    postgresql_where=sa.text("status = 'queued' AND retry_after IS NULL"))


def downgrade() -> None:
    op.drop_index('ix_conversion_jobs_fresh', table_name='conversion_jobs',
                  postgresql_where=sa.text("status = 'queued' AND retry_after IS NULL"))
