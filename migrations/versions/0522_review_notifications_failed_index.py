"""review notifications: failed deliveries by time, for the reconciliation sensor (issue 28)

Revision ID: 0522
Revises: 0521
Create Date: 2026-11-27 23:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from redrive.db import IndexSpec, create_indexes_concurrently, drop_indexes_concurrently

revision: str = '0522'
down_revision: str | None = '0521'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, table, columns, partial predicate): built CONCURRENTLY (redrive.db), a months-old table keeps taking writes
INDEXES: list[IndexSpec] = [
    ('ix_review_deliveries_failed', 'review_deliveries', ['updated_at'], "status = 'failed'"),
]


def upgrade() -> None:
    create_indexes_concurrently(INDEXES)


def downgrade() -> None:
    drop_indexes_concurrently(INDEXES)
