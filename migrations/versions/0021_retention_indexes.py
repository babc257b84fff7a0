"""retention (issue 28): partial indexes on the age of what the core pruner removes

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-26 19:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from redrive.db import IndexSpec, create_indexes_concurrently, drop_indexes_concurrently

revision: str = '0021'
down_revision: str | None = '0020'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, table, columns, partial predicate): built CONCURRENTLY (redrive.db), a months-old table keeps taking writes
INDEXES: list[IndexSpec] = [
    ('ix_work_items_finished', 'work_items', ['updated_at'], "status IN ('done', 'dead')"),
    ('ix_dead_letters_resolved', 'dead_letters', ['resolved_at'], "status = 'resolved'"),
    ('ix_alerts_created_at', 'alerts', ['created_at'], None),
    ('ix_deferred_attempts_finished', 'deferred_attempts', ['due_at'], "status <> 'waiting'"),
    ('ix_stage_checkpoints_completed_at', 'stage_checkpoints', ['completed_at'], None),
    ('ix_rehearsal_requests_completed_at', 'rehearsal_requests', ['completed_at'], 'completed_at IS NOT NULL'),
]


def upgrade() -> None:
    create_indexes_concurrently(INDEXES)


def downgrade() -> None:
    drop_indexes_concurrently(INDEXES)
