"""core tables

Revision ID: 0001
Revises: 
Create Date: 2026-11-22 03:17:17.293009
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('alerts',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('dedupe_key', sa.Text(), nullable=False),
    sa.Column('group_key', sa.Text(), nullable=False),
    sa.Column('pipeline', sa.Text(), nullable=False),
    sa.Column('kind', sa.Text(), nullable=False),
    sa.Column('entity_ref', sa.Text(), nullable=True),
    sa.Column('tenant', sa.Text(), nullable=True),
    sa.Column('error_class', sa.Text(), nullable=True),
    sa.Column('summary', sa.Text(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=True),
    sa.Column('link', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alerts')),
    sa.UniqueConstraint('dedupe_key', name=op.f('uq_alerts_dedupe_key'))
    )
    op.create_table('dead_letters',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('pipeline', sa.Text(), nullable=False),
    sa.Column('stage', sa.Text(), nullable=False),
    sa.Column('entity_ref', sa.Text(), nullable=False),
    sa.Column('tenant', sa.Text(), nullable=True),
    sa.Column('error_class', sa.Text(), nullable=False),
    sa.Column('error_message', sa.Text(), nullable=False),
    sa.Column('retryable', sa.Boolean(), nullable=False),
    sa.Column('last_stack', sa.Text(), server_default='', nullable=False),
    sa.Column('sanitized_context', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('payload_ref', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('stage_attempts', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('upstream_status', sa.Integer(), nullable=True),
    sa.Column('first_failure_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_failure_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('occurrences', sa.Integer(), server_default='1', nullable=False),
    sa.Column('status', sa.Text(), server_default='open', nullable=False),
    sa.Column('replay_count', sa.Integer(), server_default='0', nullable=False),
    sa.Column('replay_from', sa.Text(), nullable=True),
    sa.Column('remediation_evidence', sa.Text(), nullable=True),
    sa.Column('notes', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'[]'::jsonb"), nullable=False),
    sa.Column('run_id', sa.Text(), nullable=True),
    sa.Column('escalated_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('resolved_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("status IN ('open', 'replaying', 'escalated', 'resolved')", name=op.f('ck_dead_letters_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dead_letters'))
    )
    op.create_index('ix_dead_letters_triage', 'dead_letters', ['pipeline', 'status', 'error_class', 'last_failure_at'], unique=False)
    op.create_index('uq_dead_letters_active_entity', 'dead_letters', ['pipeline', 'entity_ref'], unique=True, postgresql_where=sa.text("status <> 'resolved'"))
    op.create_table('deferred_attempts',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('pipeline', sa.Text(), nullable=False),
    sa.Column('entity_ref', sa.Text(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('due_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('status', sa.Text(), server_default='waiting', nullable=False),
    sa.Column('payload', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('requested_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('waiting', 'requested', 'cancelled')", name=op.f('ck_deferred_attempts_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_deferred_attempts')),
    sa.UniqueConstraint('pipeline', 'entity_ref', 'attempt', name=op.f('uq_deferred_attempts_pipeline_entity_ref_attempt'))
    )
    op.create_index('ix_deferred_attempts_due', 'deferred_attempts', ['due_at'], unique=False, postgresql_where=sa.text("status = 'waiting'"))
    op.create_table('healthchecks',
    sa.Column('run_key', sa.Text(), nullable=False),
    sa.Column('checked_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('results', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.PrimaryKeyConstraint('run_key', name=op.f('pk_healthchecks'))
    )
    op.create_table('stage_checkpoints',
    sa.Column('pipeline', sa.Text(), nullable=False),
    sa.Column('entity_ref', sa.Text(), nullable=False),
    sa.Column('stage', sa.Text(), nullable=False),
    sa.Column('output', postgresql.JSONB(astext_type=sa.Text()), nullable=False),
    sa.Column('completed_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('pipeline', 'entity_ref', 'stage', name=op.f('pk_stage_checkpoints'))
    )
    op.create_table('alert_deliveries',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('alert_id', sa.BigInteger(), nullable=False),
    sa.Column('channel', sa.Text(), nullable=False),
    sa.Column('status', sa.Text(), server_default='pending', nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('sent_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('message_id', sa.Text(), nullable=True),
    sa.CheckConstraint("status IN ('pending', 'sent', 'failed')", name=op.f('ck_alert_deliveries_status')),
    sa.ForeignKeyConstraint(['alert_id'], ['alerts.id'], name=op.f('fk_alert_deliveries_alert_id_alerts'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alert_deliveries')),
    sa.UniqueConstraint('alert_id', 'channel', name=op.f('uq_alert_deliveries_alert_id_channel'))
    )
    op.create_index('ix_alert_deliveries_due', 'alert_deliveries', ['next_attempt_at'], unique=False, postgresql_where=sa.text("status = 'pending'"))


def downgrade() -> None:
    op.drop_index('ix_alert_deliveries_due', table_name='alert_deliveries', postgresql_where=sa.text("status = 'pending'"))
    op.drop_table('alert_deliveries')
    op.drop_table('stage_checkpoints')
    op.drop_table('healthchecks')
    op.drop_index('ix_deferred_attempts_due', table_name='deferred_attempts', postgresql_where=sa.text("status = 'waiting'"))
    op.drop_table('deferred_attempts')
    op.drop_index('uq_dead_letters_active_entity', table_name='dead_letters', postgresql_where=sa.text("status <> 'resolved'"))
    op.drop_index('ix_dead_letters_triage', table_name='dead_letters')
    op.drop_table('dead_letters')
    op.drop_table('alerts')
