"""evidence: the pruner finds finished file jobs and sent notifications by age (issue 28)

Revision ID: 0221
Revises: 0202
Create Date: 2026-11-26 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from redrive.db import IndexSpec, create_indexes_concurrently, drop_indexes_concurrently

revision: str = '0221'
down_revision: str | None = '0202'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, table, columns, partial predicate): built CONCURRENTLY (redrive.db), a months-old table keeps taking writes
INDEXES: list[IndexSpec] = [
    ('ix_file_job_n2_sent_at', 'file_job', ['n2_sent_at'], 'n2_sent_at IS NOT NULL'),
    ('ix_evidence_outbox_notified', 'evidence_outbox', ['consumed_at'], "status = 'CONSUMED' AND event_type IN ('EVIDENCE_N1_REQUESTED', 'EVIDENCE_N2_REQUESTED') AND (payload ->> 'to') <> 'redacted'"),
]


def upgrade() -> None:
    create_indexes_concurrently(INDEXES)


def downgrade() -> None:
    drop_indexes_concurrently(INDEXES)
