"""matchmaking: the pruner finds finished jobs by age (issue 28)

Revision ID: 0121
Revises: 0101
Create Date: 2026-11-26 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0121'
down_revision: str | None = '0101'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, table, columns, partial predicate): built CONCURRENTLY, so a months-old table keeps taking writes
INDEXES = [
    ('ix_matchmaking_jobs_finished', 'matchmaking_jobs', ['completed_at'], "status IN ('completed', 'failed')"),
]


def upgrade() -> None:
    with op.get_context().autocommit_block():
        for name, table, columns, where in INDEXES:
            op.create_index(name, table, columns, unique=False, postgresql_concurrently=True, if_not_exists=True,
                            postgresql_where=sa.text(where) if where else None)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        for name, table, _, _ in reversed(INDEXES):
            op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)
