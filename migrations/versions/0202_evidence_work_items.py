"""evidence rows onto the core's work queue: one work item per attachable row already recorded

Rows ingested before evidence moved to drain runs (issue 12) have no work item, so no drain run
would ever retry them and a replay of their dead letters would go nowhere. This data migration
gives each row with artifacts its work item, grouped by file job: due at its earliest retry while
something is still in flight, dead while it has an unresolved dead letter, done otherwise.

Revision ID: 0202
Revises: 0201
Create Date: 2026-11-23 12:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0202"
down_revision: str | None = "0201"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = ("0004",)

BACKFILL = """
INSERT INTO work_items (pipeline, entity_ref, group_key, status, due_at, payload, created_at, updated_at)
SELECT 'evidence', r.file_job_id::text || '/' || r.id::text, r.file_job_id::text,
       CASE WHEN bool_or(a.attachment_status <> 'ATTACHED' AND a.retry_status <> 'PERMANENT_FAILED') THEN 'due'
            WHEN EXISTS (SELECT 1 FROM dead_letters d WHERE d.pipeline = 'evidence' AND d.status <> 'resolved'
                         AND d.entity_ref = r.file_job_id::text || '/' || r.id::text) THEN 'dead'
            ELSE 'done' END,
       COALESCE(min(a.next_retry_at) FILTER (WHERE a.attachment_status <> 'ATTACHED'
                                             AND a.retry_status <> 'PERMANENT_FAILED'), now()),
       '{}'::jsonb, now(), now()
FROM file_job_row r JOIN file_job_artifact a ON a.file_job_row_id = r.id AND a.file_job_id = r.file_job_id
GROUP BY r.id, r.file_job_id
ON CONFLICT (pipeline, entity_ref) DO NOTHING
"""


def upgrade() -> None:
    op.execute(sa.text(BACKFILL))


def downgrade() -> None:
    op.execute(sa.text("DELETE FROM work_items WHERE pipeline = 'evidence'"))
