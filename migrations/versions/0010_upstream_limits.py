"""upstream limits (core): concurrency slots with leases, a GCRA rate, Retry-After pauses and a retry budget
per upstream, shared by every process (issue 26), and the one-round-trip acquire function

Revision ID: 0010
Revises: 0006
Create Date: 2026-11-26 19:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from redrive.upstreams import ACQUIRE_FUNCTION

revision: str = '0010'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('upstream_limits',
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('max_concurrent', sa.Integer(), nullable=True),
    sa.Column('rate_per_second', sa.Float(), nullable=True),
    sa.Column('rate_burst', sa.Integer(), server_default='1', nullable=False),
    sa.Column('tat', sa.DateTime(timezone=True), nullable=True),
    sa.Column('paused_until', sa.DateTime(timezone=True), nullable=True),
    sa.Column('pauses', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('retry_share', sa.Float(), nullable=True),
    sa.Column('retry_floor_per_second', sa.Float(), server_default='1', nullable=False),
    sa.Column('retry_window_seconds', sa.Integer(), server_default='10', nullable=False),
    sa.Column('retries_denied', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('budget_episodes', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('budget_last_denied_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_upstream_limits'))
    )
    op.create_table('upstream_slots',
    sa.Column('upstream', sa.Text(), nullable=False),
    sa.Column('slot', sa.Integer(), nullable=False),
    sa.Column('holder', sa.Text(), nullable=True),
    sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('upstream', 'slot', name=op.f('pk_upstream_slots'))
    )
    op.create_table('upstream_calls',
    sa.Column('upstream', sa.Text(), nullable=False),
    sa.Column('second', sa.BigInteger(), nullable=False),
    sa.Column('calls', sa.Integer(), server_default='0', nullable=False),
    sa.Column('retries', sa.Integer(), server_default='0', nullable=False),
    sa.PrimaryKeyConstraint('upstream', 'second', name=op.f('pk_upstream_calls'))
    )
    op.create_table('upstream_waiters',
    sa.Column('upstream', sa.Text(), nullable=False),
    sa.Column('waiter', sa.Text(), nullable=False),
    sa.Column('until', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('upstream', 'waiter', name=op.f('pk_upstream_waiters'))
    )
    op.execute(ACQUIRE_FUNCTION)


def downgrade() -> None:
    op.execute("DROP FUNCTION IF EXISTS redrive_upstream_acquire(text, text, timestamptz, double precision, "
               "boolean, boolean)")
    op.drop_table('upstream_waiters')
    op.drop_table('upstream_calls')
    op.drop_table('upstream_slots')
    op.drop_table('upstream_limits')
