"""conversion jobs, their events and API tokens (003)

Revision ID: 0601
Revises: 0002
Create Date: 2026-11-22 04:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0601'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = ('conversion',)
depends_on: str | Sequence[str] | None = None

CODES = "'EXPIRED', 'FORBIDDEN', 'GW_4XX', 'GW_5XX', 'GW_TIMEOUT', 'IO_ERROR', 'NOT_PDF', 'NOT_READY', 'TOO_LARGE', 'UNKNOWN'"


def upgrade() -> None:
    op.create_table('conversion_jobs',
    sa.Column('id', postgresql.UUID(as_uuid=False), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('owner', sa.Text(), nullable=False),
    sa.Column('filename', sa.Text(), nullable=False),
    sa.Column('source_location', sa.Text(), nullable=False),
    sa.Column('source_bytes', sa.BigInteger(), nullable=False),
    sa.Column('source_sha256', sa.Text(), nullable=False),
    sa.Column('result_location', sa.Text(), nullable=True),
    sa.Column('status', sa.Text(), server_default='queued', nullable=False),
    sa.Column('attempt_count', sa.Integer(), server_default='0', nullable=False),
    sa.Column('last_attempt_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('retry_after', sa.DateTime(timezone=True), nullable=True),
    sa.Column('leased_by', sa.Text(), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('lease_epoch', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('queued_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error_code', sa.Text(), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('dead_letter', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('attempt_count >= 0', name=op.f('ck_conversion_jobs_attempt_count')),
    sa.CheckConstraint(f'error_code IS NULL OR error_code IN ({CODES})',
                       name=op.f('ck_conversion_jobs_canonical_error_code')),
    sa.CheckConstraint("status <> 'processing' OR (leased_by IS NOT NULL AND lease_expires_at IS NOT NULL)",
                       name=op.f('ck_conversion_jobs_processing_is_leased')),
    sa.CheckConstraint("status IN ('queued', 'processing', 'succeeded', 'failed')", name=op.f('ck_conversion_jobs_status')),
    sa.CheckConstraint("status <> 'succeeded' OR result_location IS NOT NULL",
                       name=op.f('ck_conversion_jobs_succeeded_has_result')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_conversion_jobs'))
    )
    op.create_index('ix_conversion_jobs_status_retry_after', 'conversion_jobs', ['status', 'retry_after'], unique=False)
    op.create_index('ix_conversion_jobs_queued_created', 'conversion_jobs', ['created_at'], unique=False,
                    postgresql_where=sa.text("status = 'queued'"))
    op.create_index('ix_conversion_jobs_lease', 'conversion_jobs', ['lease_expires_at'], unique=False,
                    postgresql_where=sa.text("status = 'processing'"))
    op.create_index('ix_conversion_jobs_owner_created', 'conversion_jobs', ['owner', 'created_at'], unique=False)
    op.create_table('conversion_job_events',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('job_id', postgresql.UUID(as_uuid=False), nullable=False),
    sa.Column('event', sa.Text(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=True),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('meta', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.CheckConstraint("event IN ('queued', 'processing', 'retry', 'complete', 'failed', 'expired', 'fenced')",
                       name=op.f('ck_conversion_job_events_event')),
    sa.ForeignKeyConstraint(['job_id'], ['conversion_jobs.id'],
                            name=op.f('fk_conversion_job_events_job_id_conversion_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_conversion_job_events'))
    )
    op.create_index('ix_conversion_job_events_job_id_id', 'conversion_job_events', ['job_id', 'id'], unique=False)
    op.create_index('ix_conversion_job_events_event_at', 'conversion_job_events', ['event', 'at'], unique=False)
    op.create_table('conversion_api_tokens',
    sa.Column('token_sha256', sa.Text(), nullable=False),
    sa.Column('owner', sa.Text(), nullable=False),
    sa.Column('label', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('token_sha256', name=op.f('pk_conversion_api_tokens'))
    )


def downgrade() -> None:
    op.drop_table('conversion_api_tokens')
    op.drop_index('ix_conversion_job_events_event_at', table_name='conversion_job_events')
    op.drop_index('ix_conversion_job_events_job_id_id', table_name='conversion_job_events')
    op.drop_table('conversion_job_events')
    op.drop_index('ix_conversion_jobs_owner_created', table_name='conversion_jobs')
    op.drop_index('ix_conversion_jobs_lease', table_name='conversion_jobs')
    op.drop_index('ix_conversion_jobs_queued_created', table_name='conversion_jobs')
    op.drop_index('ix_conversion_jobs_status_retry_after', table_name='conversion_jobs')
    op.drop_table('conversion_jobs')
