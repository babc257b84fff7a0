"""criticizer: the pruner finds done requests by age, before and after their personal fields went (issue 28)

Revision ID: 0421
Revises: 0401
Create Date: 2026-11-26 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from redrive.db import IndexSpec, create_indexes_concurrently, drop_indexes_concurrently

revision: str = '0421'
down_revision: str | None = '0401'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, table, columns, partial predicate): built CONCURRENTLY (redrive.db), a months-old table keeps taking writes
INDEXES: list[IndexSpec] = [
    ('ix_criticizer_requests_done_personal', 'criticizer_requests', ['completed_at'], "status = 'done' AND artifact_url <> ''"),
    ('ix_criticizer_requests_done', 'criticizer_requests', ['completed_at'], "status = 'done'"),
]


def upgrade() -> None:
    create_indexes_concurrently(INDEXES)


def downgrade() -> None:
    drop_indexes_concurrently(INDEXES)
