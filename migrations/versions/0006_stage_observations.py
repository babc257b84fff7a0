"""stage observations (core): outcome counters and latency buckets every pipeline adds to (issue 16 §3)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 15:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('stage_observations',
    sa.Column('pipeline', sa.Text(), nullable=False),
    sa.Column('stage', sa.Text(), nullable=False),
    sa.Column('outcome', sa.Text(), nullable=False),
    sa.Column('error_class', sa.Text(), server_default='', nullable=False),
    sa.Column('count', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('buckets', postgresql.ARRAY(sa.BigInteger()), nullable=False),
    sa.Column('sum_seconds', sa.Float(), server_default='0', nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("outcome IN ('ok', 'retry', 'failed', 'done')",
                       name=op.f('ck_stage_observations_outcome')),
    sa.PrimaryKeyConstraint('pipeline', 'stage', 'outcome', 'error_class', name=op.f('pk_stage_observations'))
    )


def downgrade() -> None:
    op.drop_table('stage_observations')
