"""upstream limits (core): a rate grant is dated when its caller got the rate's row lock, not when it asked
(issue 26: callers queued behind that lock on a busy database were each told to wait as long as they had
already waited; sent that much late, they reached the provider bunched and over its 1 s window)

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 11:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from redrive.upstreams import ACQUIRE_FUNCTION

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

AFTER_LOCK = "        v_now := coalesce(p_now, clock_timestamp());  -- after the lock: waiting for it never dates a grant back\n"


def upgrade() -> None:
    op.execute(ACQUIRE_FUNCTION)


def downgrade() -> None:
    assert AFTER_LOCK in ACQUIRE_FUNCTION
    op.execute(ACQUIRE_FUNCTION.replace(AFTER_LOCK, ""))
