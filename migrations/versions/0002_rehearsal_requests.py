"""rehearsal requests

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 03:21:26.642795
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('rehearsal_requests',
    sa.Column('request_id', sa.Text(), nullable=False),
    sa.Column('artifact_path', sa.Text(), nullable=False),
    sa.Column('prompt', sa.Text(), nullable=False),
    sa.Column('result', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('request_id', name=op.f('pk_rehearsal_requests'))
    )


def downgrade() -> None:
    op.drop_table('rehearsal_requests')
