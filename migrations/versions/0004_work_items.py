"""work items (core): the drained pipelines' per-entity scheduling state

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 11:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('work_items',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('pipeline', sa.Text(), nullable=False),
    sa.Column('entity_ref', sa.Text(), nullable=False),
    sa.Column('group_key', sa.Text(), nullable=True),
    sa.Column('status', sa.Text(), server_default='due', nullable=False),
    sa.Column('due_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('stage', sa.Text(), nullable=True),
    sa.Column('attempts', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"),
              nullable=False),
    sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"),
              nullable=False),
    sa.Column('lease_owner', sa.Text(), nullable=True),
    sa.Column('lease_epoch', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("status IN ('due', 'leased', 'done', 'dead')", name=op.f('ck_work_items_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_work_items')),
    sa.UniqueConstraint('pipeline', 'entity_ref', name=op.f('uq_work_items_pipeline_entity_ref')),
    )
    op.create_index('ix_work_items_claim', 'work_items', ['pipeline', 'due_at'], unique=False,
                    postgresql_where=sa.text("status IN ('due', 'leased')"))
    op.create_index('ix_work_items_group_claim', 'work_items', ['pipeline', 'group_key', 'due_at'], unique=False,
                    postgresql_where=sa.text("status IN ('due', 'leased') AND group_key IS NOT NULL"))


def downgrade() -> None:
    op.drop_index('ix_work_items_group_claim', table_name='work_items')
    op.drop_index('ix_work_items_claim', table_name='work_items')
    op.drop_table('work_items')
