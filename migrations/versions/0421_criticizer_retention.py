"""criticizer: the pruner finds done requests by age, before and after their personal fields went (issue 28)

Revision ID: 0421
Revises: 0401
Create Date: 2026-11-26 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0421'
down_revision: str | None = '0401'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, table, columns, partial predicate): built CONCURRENTLY, so a months-old table keeps taking writes
INDEXES = [
    ('ix_criticizer_requests_done_personal', 'criticizer_requests', ['completed_at'], "status = 'done' AND artifact_url <> ''"),
    ('ix_criticizer_requests_done', 'criticizer_requests', ['completed_at'], "status = 'done'"),
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
