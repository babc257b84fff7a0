"""conversion: files_deleted_at, and the pruner finds finished jobs by age (issue 28)

Revision ID: 0621
Revises: 0620
Create Date: 2026-11-26 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from redrive.db import IndexSpec, create_indexes_concurrently, drop_indexes_concurrently


revision: str = '0621'
down_revision: str | None = '0620'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, table, columns, partial predicate): built CONCURRENTLY (redrive.db), a months-old table keeps taking writes
INDEXES: list[IndexSpec] = [
    ('ix_conversion_jobs_finished_files', 'conversion_jobs', ['updated_at'], "status IN ('succeeded', 'failed') AND files_deleted_at IS NULL"),
    ('ix_conversion_jobs_finished', 'conversion_jobs', ['updated_at'], "status IN ('succeeded', 'failed') AND files_deleted_at IS NOT NULL"),
    ('ix_conversion_api_tokens_revoked_at', 'conversion_api_tokens', ['revoked_at'], 'revoked_at IS NOT NULL'),
]


def upgrade() -> None:
    op.add_column('conversion_jobs', sa.Column('files_deleted_at', sa.DateTime(timezone=True), nullable=True))
    create_indexes_concurrently(INDEXES)


def downgrade() -> None:
    drop_indexes_concurrently(INDEXES)
    op.drop_column('conversion_jobs', 'files_deleted_at')
