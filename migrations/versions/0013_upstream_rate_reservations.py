"""upstream limits (core): a rate grant due within the next second is reserved and sent at its time (issue 26:
waiters no longer all ask again at each grant's instant, which cost the drain's machine ~30 ms of CPU an entity)

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 11:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

from redrive.upstreams import ACQUIRE_FUNCTION

revision: str = '0013'
down_revision: str | None = '0012'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 0012's rate branch: a grant not yet due is denied with how long to wait
DENIED = """        IF v_now < due THEN
            INSERT INTO upstream_waiters AS w VALUES (p_name, p_holder, v_now + interval '30 seconds')
                ON CONFLICT (upstream, waiter) DO UPDATE SET until = excluded.until;
            RETURN QUERY SELECT NULL::integer, extract(epoch FROM due - v_now)::float8, 'rate'::text, false;
            RETURN;
        END IF;
"""


def upgrade() -> None:
    op.execute(ACQUIRE_FUNCTION)


def downgrade() -> None:
    head, rest = ACQUIRE_FUNCTION.split("        IF due > v_now + make_interval(secs => reserve_ahead) THEN\n", 1)
    _, tail = rest.split("        ahead := greatest(extract(epoch FROM due - v_now)::float8, 0.0);\n", 1)
    op.execute(head + DENIED + tail)
