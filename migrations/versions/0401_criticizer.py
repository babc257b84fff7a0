"""criticizer: critique requests and their deliveries

Revision ID: 0401
Revises: 0002
Create Date: 2026-11-22 04:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0401"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = ("criticizer",)
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "criticizer_requests",
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=True),
        sa.Column("artifact_url", sa.Text(), nullable=False),
        sa.Column("rubric", sa.Text(), nullable=False),
        sa.Column("webhook_url", sa.Text(), nullable=False),
        sa.Column("webhook_headers", postgresql.JSONB(astext_type=sa.Text()),
                  server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("fingerprint", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), server_default="submitted", nullable=False),
        sa.Column("stage_attempts", postgresql.JSONB(astext_type=sa.Text()),
                  server_default=sa.text("'{}'::jsonb"), nullable=False),
        sa.Column("failing_since", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_failure_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("critique", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("critique_sha256", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("status IN ('submitted', 'processing', 'done')", name=op.f("ck_criticizer_requests_status")),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_criticizer_requests")),
    )
    op.create_index(
        "ix_criticizer_requests_submitted",
        "criticizer_requests",
        ["created_at"],
        unique=False,
        postgresql_where=sa.text("status = 'submitted'"),
    )
    op.create_table(
        "criticizer_deliveries",
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("upstream_status", sa.Integer(), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("target IN ('webhook', 'slack')", name=op.f("ck_criticizer_deliveries_target")),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["criticizer_requests.request_id"],
            name=op.f("fk_criticizer_deliveries_request_id_criticizer_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("request_id", "target", "idempotency_key", name=op.f("pk_criticizer_deliveries")),
    )


def downgrade() -> None:
    op.drop_table("criticizer_deliveries")
    op.drop_index("ix_criticizer_requests_submitted", table_name="criticizer_requests",
                  postgresql_where=sa.text("status = 'submitted'"))
    op.drop_table("criticizer_requests")
