"""review notifications: the pruner finds finished jobs and settled recipients by age (issue 28)

Revision ID: 0521
Revises: 0502
Create Date: 2026-11-26 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from redrive.db import IndexSpec, create_indexes_concurrently, drop_indexes_concurrently

revision: str = '0521'
down_revision: str | None = '0502'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, table, columns, partial predicate): built CONCURRENTLY (redrive.db), a months-old table keeps taking writes
INDEXES: list[IndexSpec] = [
    ('ix_review_jobs_finished', 'review_jobs', ['updated_at'], "status IN ('succeeded', 'superseded')"),
    ('ix_review_deliveries_personal', 'review_deliveries', ['updated_at'], "status IN ('sent', 'failed', 'waived', 'superseded') AND recipient NOT LIKE 'sha256:%'"),
]


def upgrade() -> None:
    create_indexes_concurrently(INDEXES)


def downgrade() -> None:
    drop_indexes_concurrently(INDEXES)
