"""review notifications are drained: every unfinished job gets its work row; the pending-jobs index goes

Jobs were started by a pending-jobs sensor (one run per job); now a job is worked when its row
in the core's `work_items` falls due. Existing jobs are carried over so none is stranded:
- an unfinished job without an active dead letter: due now (a pass that finds nothing unsent
  only finalizes it again);
- a job or a failed recipient with an active dead letter: a dead row, so `redrive dlq replay`
  makes it due; one already asked to be replayed is due now, carrying its replay;
- its durable retry timers are dropped: the due row is the next attempt.

Revision ID: 0502
Revises: 0501
Create Date: 2026-11-23 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0502"
down_revision: str | None = "0501"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = "0004"  # the core's work_items

PIPELINE = "review_notifications"

# An entity's active dead letter (if any) as a work row's status and payload.
_CARRY = """
    INSERT INTO work_items (pipeline, entity_ref, status, due_at, stage, payload)
    SELECT '{pipeline}', e.ref,
           CASE WHEN dl.status = 'replaying' OR dl.id IS NULL THEN 'due' ELSE 'dead' END,
           now(), dl.stage,
           CASE WHEN dl.status = 'replaying'
                THEN jsonb_build_object('replay_of', dl.id, 'replay_from', COALESCE(dl.replay_from, 'failed_stage'))
                ELSE '{{}}'::jsonb END
    FROM ({entities}) AS e
    LEFT JOIN dead_letters dl ON dl.pipeline = '{pipeline}' AND dl.entity_ref = e.ref AND dl.status <> 'resolved'
    WHERE {where}
    ON CONFLICT (pipeline, entity_ref) DO NOTHING
"""

_JOB_REF = "j.changelist_id || ':' || 'v' || j.review_version"  # split: ':v' would read as a bind parameter


def upgrade() -> None:
    op.drop_index("ix_review_jobs_pending", table_name="review_jobs", postgresql_where=sa.text("status = 'pending'"))
    op.execute(_CARRY.format(
        pipeline=PIPELINE, where="true",
        entities=f"SELECT {_JOB_REF} AS ref FROM review_jobs j "
                 "WHERE j.status IN ('pending', 'in_progress', 'retryable_failed')"))
    op.execute(_CARRY.format(
        pipeline=PIPELINE, where="dl.id IS NOT NULL",
        entities=f"SELECT {_JOB_REF} || ':' || 'd' || d.id AS ref FROM review_deliveries d "
                 "JOIN review_jobs j ON j.id = d.job_id WHERE d.status = 'failed'"))
    op.execute(f"DELETE FROM deferred_attempts WHERE pipeline = '{PIPELINE}'")


def downgrade() -> None:
    op.execute(f"DELETE FROM work_items WHERE pipeline = '{PIPELINE}'")
    op.create_index("ix_review_jobs_pending", "review_jobs", ["id"], unique=False,
                    postgresql_where=sa.text("status = 'pending'"))
