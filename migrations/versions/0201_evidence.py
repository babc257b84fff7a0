"""evidence attach (004 Stage 1.3): file jobs, rows, artifacts, outbox, scheduler ticks, metrics, alert state

Revision ID: 0201
Revises: 0002
Create Date: 2026-11-22 04:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0201"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = ("evidence",)
depends_on: str | Sequence[str] | None = None

UUID = postgresql.UUID(as_uuid=True)
TZ = sa.DateTime(timezone=True)
NOW = sa.text("now()")

# 004 §1.1, verbatim
ERROR_CATEGORY_SQL = (
    "CASE "
    "WHEN attachment_error_code IN ('ATTACHMENT_API_TIMEOUT', '503', 'NETWORK_TIMEOUT') THEN 'NETWORK' "
    "WHEN attachment_error_code IN ('500', 'SYSTEM_ERROR') THEN 'SYSTEM' "
    "WHEN attachment_error_code IN ('CORRUPTED_FILE', 'INVALID_FORMAT', 'S3_NOT_FOUND') THEN 'DATA' "
    "WHEN attachment_error_code IN ('401', '403', 'UNAUTHORIZED', 'CASE_NOT_FOUND') THEN 'AUTH' "
    "ELSE 'SYSTEM' END"
)
IS_RETRYABLE_SQL = f"({ERROR_CATEGORY_SQL}) IN ('NETWORK', 'SYSTEM') AND retry_count < 2"
RETRY_SCAN_PREDICATE = "retry_status IN ('PENDING', 'RETRY_FAILED') AND retry_count < 2"


def upgrade() -> None:
    op.create_table(
        "file_job",
        sa.Column("id", UUID, nullable=False),
        sa.Column("source_bucket", sa.Text(), nullable=False),
        sa.Column("source_key", sa.Text(), nullable=False),
        sa.Column("source_etag", sa.Text(), nullable=False),
        sa.Column("notify_to", sa.Text(), nullable=False),
        sa.Column("status", sa.String(20), server_default="RECEIVED", nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("row_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("artifact_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("ingested_at", TZ, nullable=True),
        sa.Column("n1_requested_at", TZ, nullable=True),
        sa.Column("n1_sent_at", TZ, nullable=True),
        sa.Column("n1_message_id", sa.Text(), nullable=True),
        sa.Column("n2_requested_at", TZ, nullable=True),
        sa.Column("n2_sent_at", TZ, nullable=True),
        sa.Column("n2_message_id", sa.Text(), nullable=True),
        sa.Column("n2_forced", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("created_at", TZ, server_default=NOW, nullable=False),
        sa.Column("updated_at", TZ, server_default=NOW, nullable=False),
        sa.CheckConstraint("status IN ('RECEIVED', 'INGESTED', 'INGEST_FAILED')", name=op.f("ck_file_job_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_file_job")),
        sa.UniqueConstraint("source_bucket", "source_key", "source_etag",
                            name=op.f("uq_file_job_source_bucket_source_key_source_etag")),
    )
    op.create_index("ix_file_job_n2_open", "file_job", ["n1_sent_at"],
                    postgresql_where=sa.text("n2_requested_at IS NULL"))

    op.create_table(
        "file_job_row",
        sa.Column("id", UUID, nullable=False),
        sa.Column("file_job_id", UUID, nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("case_ref", sa.Text(), nullable=False),
        sa.Column("case_id", UUID, nullable=True),
        sa.Column("row_status", sa.String(20), server_default="VALID", nullable=False),
        sa.Column("row_error_code", sa.String(64), nullable=True),
        sa.Column("row_error_message", sa.Text(), nullable=True),
        sa.Column("evidence_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("evidence_attached_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("evidence_failed_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("evidence_status", sa.String(20), server_default="PENDING", nullable=False),
        sa.Column("evidence_failed_files", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("evidence_completed_at", TZ, nullable=True),
        sa.Column("retry_round", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", TZ, server_default=NOW, nullable=False),
        sa.Column("updated_at", TZ, server_default=NOW, nullable=False),
        sa.CheckConstraint("row_status IN ('VALID', 'INVALID')", name=op.f("ck_file_job_row_row_status")),
        sa.CheckConstraint("evidence_status IN ('PENDING', 'COMPLETED', 'PARTIALLY_FAILED', 'FAILED')",
                           name=op.f("ck_file_job_row_evidence_status")),
        sa.ForeignKeyConstraint(["file_job_id"], ["file_job.id"], name=op.f("fk_file_job_row_file_job_id_file_job")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_file_job_row")),
        sa.UniqueConstraint("file_job_id", "line_no", name=op.f("uq_file_job_row_file_job_id_line_no")),
    )

    op.create_table(
        "file_job_artifact",
        sa.Column("id", UUID, nullable=False),
        sa.Column("file_job_id", UUID, nullable=False),
        sa.Column("file_job_row_id", UUID, nullable=False),
        sa.Column("case_id", UUID, nullable=False),
        sa.Column("file_name", sa.Text(), nullable=False),
        sa.Column("file_type", sa.Text(), nullable=True),
        sa.Column("file_size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("s3_key", sa.Text(), nullable=False),
        sa.Column("content_sha256", sa.Text(), nullable=True),
        sa.Column("attachment_status", sa.String(20), server_default="PENDING", nullable=False),
        sa.Column("attachment_error_code", sa.String(64), nullable=True),
        sa.Column("attachment_error_message", sa.Text(), nullable=True),
        sa.Column("attached_at", TZ, nullable=True),
        sa.Column("case_attachment_id", sa.Text(), nullable=True),
        sa.Column("attempt_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("retry_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("attempt_started_at", TZ, nullable=True),
        sa.Column("retry_status", sa.String(20), server_default="PENDING", nullable=False),
        sa.Column("next_retry_at", TZ, nullable=True),
        sa.Column("last_retry_at", TZ, nullable=True),
        sa.Column("error_category", sa.String(20), sa.Computed(ERROR_CATEGORY_SQL, persisted=True), nullable=True),
        sa.Column("is_retryable", sa.Boolean(), sa.Computed(IS_RETRYABLE_SQL, persisted=True), nullable=True),
        sa.Column("created_at", TZ, server_default=NOW, nullable=False),
        sa.Column("updated_at", TZ, server_default=NOW, nullable=False),
        sa.CheckConstraint("attachment_status IN ('PENDING', 'ATTACHED', 'FAILED')",
                           name=op.f("ck_file_job_artifact_attachment_status")),
        sa.CheckConstraint("retry_status IN ('PENDING', 'RETRY_SCHEDULED', 'RETRYING', 'RETRY_SUCCESS', "
                           "'RETRY_FAILED', 'PERMANENT_FAILED')", name=op.f("ck_file_job_artifact_retry_status")),
        sa.ForeignKeyConstraint(["file_job_id"], ["file_job.id"],
                                name=op.f("fk_file_job_artifact_file_job_id_file_job")),
        sa.ForeignKeyConstraint(["file_job_row_id"], ["file_job_row.id"],
                                name=op.f("fk_file_job_artifact_file_job_row_id_file_job_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_file_job_artifact")),
    )
    # 004 §1.1's three indexes
    op.create_index("idx_artifact_retry_scan", "file_job_artifact", ["next_retry_at", "retry_count"],
                    postgresql_where=sa.text(RETRY_SCAN_PREDICATE))
    op.create_index("idx_artifact_retry_cover", "file_job_artifact", ["next_retry_at", "retry_count"],
                    postgresql_include=["id", "file_job_id", "file_job_row_id", "s3_key", "case_id", "retry_status",
                                        "attachment_status"],
                    postgresql_where=sa.text(RETRY_SCAN_PREDICATE))
    op.create_index("idx_artifact_by_job_row", "file_job_artifact", ["file_job_id", "file_job_row_id"])
    # ours (§6 monitoring)
    op.create_index("ix_file_job_artifact_in_retry", "file_job_artifact", ["file_job_row_id"],
                    postgresql_where=sa.text("retry_status IN ('RETRY_FAILED', 'RETRY_SCHEDULED', 'RETRYING')"))
    op.create_index("ix_file_job_artifact_updated_at", "file_job_artifact", ["updated_at"])

    op.create_table(
        "evidence_outbox",
        sa.Column("event_id", UUID, nullable=False),
        sa.Column("seq", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("event_type", sa.String(40), nullable=False),
        sa.Column("topic", sa.Text(), nullable=False),
        sa.Column("file_job_id", UUID, nullable=False),
        sa.Column("file_job_row_id", UUID, nullable=True),
        sa.Column("case_id", UUID, nullable=True),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("status", sa.String(20), server_default="PENDING", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("created_at", TZ, server_default=NOW, nullable=False),
        sa.Column("published_at", TZ, nullable=True),
        sa.Column("consumed_at", TZ, nullable=True),
        sa.Column("updated_at", TZ, server_default=NOW, nullable=False),
        sa.CheckConstraint("status IN ('PENDING', 'PUBLISHED', 'CONSUMED', 'FAILED')",
                           name=op.f("ck_evidence_outbox_status")),
        sa.CheckConstraint("event_type IN ('EVIDENCE_ATTACH_REQUESTED', 'EVIDENCE_ATTACH_RETRY', "
                           "'EVIDENCE_N1_REQUESTED', 'EVIDENCE_N2_REQUESTED')",
                           name=op.f("ck_evidence_outbox_event_type")),
        sa.PrimaryKeyConstraint("event_id", name=op.f("pk_evidence_outbox")),
        sa.UniqueConstraint("seq", name=op.f("uq_evidence_outbox_seq")),
    )
    op.create_index("ix_evidence_outbox_pending", "evidence_outbox", ["seq"],
                    postgresql_where=sa.text("status = 'PENDING'"))
    op.create_index("ix_evidence_outbox_published", "evidence_outbox", ["published_at"],
                    postgresql_where=sa.text("status = 'PUBLISHED'"))
    op.create_index("ix_evidence_outbox_file_job", "evidence_outbox", ["file_job_id", "event_type"])

    op.create_table(
        "evidence_scheduler_ticks",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("started_at", TZ, nullable=False),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("rows_requeued", sa.Integer(), nullable=False),
        sa.Column("artifacts_requeued", sa.Integer(), nullable=False),
        sa.Column("n2_forced", sa.Integer(), nullable=False),
        sa.Column("batch_limit", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evidence_scheduler_ticks")),
    )
    op.create_index("ix_evidence_scheduler_ticks_started_at", "evidence_scheduler_ticks", ["started_at"])

    op.create_table(
        "evidence_metrics",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("measured_at", TZ, nullable=False),
        sa.Column("metrics", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evidence_metrics")),
    )
    op.create_index("ix_evidence_metrics_measured_at", "evidence_metrics", ["measured_at"])

    op.create_table(
        "evidence_alert_state",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("firing", sa.Boolean(), nullable=False),
        sa.Column("episode", sa.Integer(), nullable=False),
        sa.Column("condition_since", TZ, nullable=True),
        sa.Column("updated_at", TZ, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_evidence_alert_state")),
    )


def downgrade() -> None:
    op.drop_table("evidence_alert_state")
    op.drop_index("ix_evidence_metrics_measured_at", table_name="evidence_metrics")
    op.drop_table("evidence_metrics")
    op.drop_index("ix_evidence_scheduler_ticks_started_at", table_name="evidence_scheduler_ticks")
    op.drop_table("evidence_scheduler_ticks")
    op.drop_index("ix_evidence_outbox_file_job", table_name="evidence_outbox")
    op.drop_index("ix_evidence_outbox_published", table_name="evidence_outbox")
    op.drop_index("ix_evidence_outbox_pending", table_name="evidence_outbox")
    op.drop_table("evidence_outbox")
    op.drop_index("ix_file_job_artifact_updated_at", table_name="file_job_artifact")
    op.drop_index("ix_file_job_artifact_in_retry", table_name="file_job_artifact")
    op.drop_index("idx_artifact_by_job_row", table_name="file_job_artifact")
    op.drop_index("idx_artifact_retry_cover", table_name="file_job_artifact")
    op.drop_index("idx_artifact_retry_scan", table_name="file_job_artifact")
    op.drop_table("file_job_artifact")
    op.drop_table("file_job_row")
    op.drop_index("ix_file_job_n2_open", table_name="file_job")
    op.drop_table("file_job")
