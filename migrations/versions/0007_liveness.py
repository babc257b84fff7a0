"""liveness (core): run worker heartbeats fenced by a dead mark, and each pipeline's last progress (issue 25)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 18:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('run_heartbeats',
    sa.Column('holder', sa.Text(), nullable=False),
    sa.Column('run_id', sa.Text(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('beat_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('dead_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('dead_reason', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('holder', name=op.f('pk_run_heartbeats'))
    )
    op.create_index(op.f('ix_run_heartbeats_beat_at'), 'run_heartbeats', ['beat_at'], unique=False)
    op.create_table('pipeline_progress',
    sa.Column('pipeline', sa.Text(), nullable=False),
    sa.Column('progress', sa.BigInteger(), nullable=False),
    sa.Column('progressed_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('due', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('stalled_since', sa.DateTime(timezone=True), nullable=True),
    sa.Column('checked_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('pipeline', name=op.f('pk_pipeline_progress'))
    )


def downgrade() -> None:
    op.drop_table('pipeline_progress')
    op.drop_index(op.f('ix_run_heartbeats_beat_at'), table_name='run_heartbeats')
    op.drop_table('run_heartbeats')
