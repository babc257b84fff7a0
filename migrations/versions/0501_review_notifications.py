"""review notifications: jobs with idempotency keys and their per-recipient outbox (002 §6, §10)

Revision ID: 0501
Revises: 0002
Create Date: 2026-11-22 04:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0501"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = ("review_notifications",)
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "review_jobs",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("changelist_id", sa.Text(), nullable=False),
        sa.Column("review_version", sa.Integer(), nullable=False),
        sa.Column("summary", sa.Text(), server_default="", nullable=False),
        sa.Column("request_digest", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("result", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_review_jobs")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_review_jobs_idempotency_key")),
        sa.UniqueConstraint("changelist_id", "review_version",
                            name=op.f("uq_review_jobs_changelist_id_review_version")),
        sa.CheckConstraint("review_version >= 1", name=op.f("ck_review_jobs_review_version")),
        sa.CheckConstraint("status IN ('pending', 'in_progress', 'retryable_failed', 'succeeded', 'superseded')",
                           name=op.f("ck_review_jobs_status")),
    )
    op.create_index("ix_review_jobs_pending", "review_jobs", ["id"], unique=False,
                    postgresql_where=sa.text("status = 'pending'"))
    op.create_table(
        "review_deliveries",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=False),
        sa.Column("changelist_id", sa.Text(), nullable=False),
        sa.Column("recipient", sa.Text(), nullable=False),
        sa.Column("review_version", sa.Integer(), nullable=False),
        sa.Column("provider_token", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("notification_id", sa.Text(), nullable=True),
        sa.Column("notified_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("reconciliations", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_review_deliveries")),
        sa.ForeignKeyConstraint(["job_id"], ["review_jobs.id"], ondelete="CASCADE",
                                name=op.f("fk_review_deliveries_job_id_review_jobs")),
        sa.UniqueConstraint("provider_token", name=op.f("uq_review_deliveries_provider_token")),
        sa.UniqueConstraint("changelist_id", "recipient", "review_version",
                            name=op.f("uq_review_deliveries_changelist_id_recipient_review_version")),
        sa.CheckConstraint("status IN ('pending', 'sending', 'sent', 'failed', 'waived', 'superseded')",
                           name=op.f("ck_review_deliveries_status")),
        sa.CheckConstraint("(status = 'sent') = (notified_at IS NOT NULL)",
                           name=op.f("ck_review_deliveries_sent_iff_notified")),
    )
    op.create_index("ix_review_deliveries_job_id_status", "review_deliveries", ["job_id", "status"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_review_deliveries_job_id_status", table_name="review_deliveries")
    op.drop_table("review_deliveries")
    op.drop_index("ix_review_jobs_pending", table_name="review_jobs", postgresql_where=sa.text("status = 'pending'"))
    op.drop_table("review_jobs")
