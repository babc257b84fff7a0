"""evidence: the pruner finds finished file jobs and sent notifications by age (issue 28)

Revision ID: 0221
Revises: 0202
Create Date: 2026-11-26 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0221'
down_revision: str | None = '0202'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, table, columns, partial predicate): built CONCURRENTLY, so a months-old table keeps taking writes
INDEXES = [
    ('ix_file_job_n2_sent_at', 'file_job', ['n2_sent_at'], 'n2_sent_at IS NOT NULL'),
    ('ix_evidence_outbox_notified', 'evidence_outbox', ['consumed_at'], "status = 'CONSUMED' AND event_type IN ('EVIDENCE_N1_REQUESTED', 'EVIDENCE_N2_REQUESTED') AND (payload ->> 'to') <> 'redacted'"),
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
