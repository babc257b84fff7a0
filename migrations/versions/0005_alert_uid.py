"""alerts get a globally unique uid for provider idempotency tokens (issue 13 item 4)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 11:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # gen_random_uuid() is built in since PostgreSQL 13; existing rows get one each.
    op.add_column('alerts', sa.Column('uid', postgresql.UUID(as_uuid=False),
                                      server_default=sa.text('gen_random_uuid()'), nullable=False))
    op.create_unique_constraint(op.f('uq_alerts_uid'), 'alerts', ['uid'])


def downgrade() -> None:
    op.drop_constraint(op.f('uq_alerts_uid'), 'alerts', type_='unique')
    op.drop_column('alerts', 'uid')
