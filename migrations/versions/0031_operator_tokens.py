"""operator_tokens: who may act in the dead-letter console (issue 27 §2)

Revision ID: 0031
Revises: 0030
Create Date: 2026-11-26 20:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0031'
down_revision: str | None = '0030'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('operator_tokens',
                    sa.Column('token_sha256', sa.Text(), nullable=False),
                    sa.Column('operator', sa.Text(), nullable=False),
                    sa.Column('created_at', sa.TIMESTAMP(timezone=True), server_default=sa.text('now()'),
                              nullable=False),
                    sa.Column('revoked_at', sa.TIMESTAMP(timezone=True), nullable=True),
                    sa.PrimaryKeyConstraint('token_sha256', name=op.f('pk_operator_tokens')))


def downgrade() -> None:
    op.drop_table('operator_tokens')
