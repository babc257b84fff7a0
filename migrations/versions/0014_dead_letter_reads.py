"""dead letters read by what is open, not by how many were ever written (issue 28): a scrape's and
the backlog sensor's open letters from the index alone; the replays the replay sensor starts; every letter of
an entity (the reconciliation's probe: one lookup per failure, not a walk over the pipeline's letters)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27 23:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from redrive.db import IndexSpec, create_indexes_concurrently, drop_indexes_concurrently

revision: str = '0014'
down_revision: str | None = '0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, table, columns, partial predicate): built CONCURRENTLY (redrive.db), a months-old table keeps taking writes
INDEXES: list[IndexSpec] = [
    ('ix_dead_letters_open', 'dead_letters', ['pipeline', 'error_class', 'first_failure_at'], "status <> 'resolved'"),
    ('ix_dead_letters_replaying', 'dead_letters', ['updated_at', 'id'], "status = 'replaying'"),
    ('ix_dead_letters_entity', 'dead_letters', ['pipeline', 'entity_ref', 'last_failure_at'], None),
]


def upgrade() -> None:
    create_indexes_concurrently(INDEXES)


def downgrade() -> None:
    drop_indexes_concurrently(INDEXES)
