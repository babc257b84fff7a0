"""circuit breaker (core): one state row per breaker and the window of its calls

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 04:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('circuit_breakers',
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('state', sa.Text(), server_default='closed', nullable=False),
    sa.Column('opened_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('closed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_probe_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('open_count', sa.Integer(), server_default='0', nullable=False),
    sa.Column('open_seconds_total', sa.Float(), server_default='0', nullable=False),
    sa.Column('window_floor', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("state = 'closed' OR opened_at IS NOT NULL", name=op.f('ck_circuit_breakers_open_has_opened_at')),
    sa.CheckConstraint("state IN ('closed', 'open')", name=op.f('ck_circuit_breakers_state')),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_circuit_breakers'))
    )
    op.create_table('circuit_breaker_calls',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('breaker', sa.Text(), nullable=False),
    sa.Column('ok', sa.Boolean(), nullable=False),
    sa.Column('duration_ms', sa.Float(), nullable=True),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_circuit_breaker_calls'))
    )
    op.create_index('ix_circuit_breaker_calls_breaker_id', 'circuit_breaker_calls', ['breaker', 'id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_circuit_breaker_calls_breaker_id', table_name='circuit_breaker_calls')
    op.drop_table('circuit_breaker_calls')
    op.drop_table('circuit_breakers')
