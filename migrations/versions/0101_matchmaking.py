"""matchmaking: users, per-user jobs (ADR-0004) and offers

Revision ID: 0101
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0101"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = ("matchmaking",)
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "matchmaking_users",
        sa.Column("id", sa.Uuid(as_uuid=False), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("timezone", sa.Text(), nullable=False),
        sa.Column("active", sa.Boolean(), server_default=sa.true(), nullable=False),
        sa.Column("region", sa.Text(), nullable=True),
        sa.Column("gender", sa.Text(), nullable=True),
        sa.Column("seeking", postgresql.ARRAY(sa.Text()), server_default=sa.text("'{}'::text[]"), nullable=False),
        sa.Column("birth_date", sa.Date(), nullable=True),
        sa.Column("age_min", sa.SmallInteger(), nullable=True),
        sa.Column("age_max", sa.SmallInteger(), nullable=True),
        sa.Column("latitude", sa.Double(), nullable=True),
        sa.Column("longitude", sa.Double(), nullable=True),
        sa.Column("max_distance_km", sa.SmallInteger(), nullable=True),
        sa.Column("interests", postgresql.ARRAY(sa.SmallInteger()), server_default=sa.text("'{}'::smallint[]"),
                  nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_matchmaking_users")),
    )
    op.create_index("ix_matchmaking_users_pool", "matchmaking_users", ["timezone", "region", "id"],
                    postgresql_where=sa.text("active"))

    op.create_table(
        "matchmaking_jobs",
        sa.Column("id", sa.Uuid(as_uuid=False), server_default=sa.text("gen_random_uuid()"), nullable=False),
        sa.Column("date", sa.Date(), nullable=False),
        sa.Column("timezone", sa.Text(), nullable=False),
        sa.Column("user_id", sa.Uuid(as_uuid=False), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("offers", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("retry_count", sa.Integer(), server_default="0", nullable=False),
        sa.CheckConstraint("status IN ('pending', 'running', 'completed', 'failed')",
                           name=op.f("ck_matchmaking_jobs_status")),
        sa.ForeignKeyConstraint(["user_id"], ["matchmaking_users.id"], ondelete="CASCADE",
                                name=op.f("fk_matchmaking_jobs_user_id_matchmaking_users")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_matchmaking_jobs")),
        sa.UniqueConstraint("date", "user_id", name=op.f("uq_matchmaking_jobs_date_user_id")),
    )
    op.create_index("idx_matchmaking_jobs_status", "matchmaking_jobs", ["status"])
    op.create_index("idx_matchmaking_jobs_date_timezone", "matchmaking_jobs", ["date", "timezone"])

    op.create_table(
        "matchmaking_offers",
        sa.Column("id", sa.Uuid(as_uuid=False), nullable=False),
        sa.Column("date", sa.Date(), nullable=False),
        sa.Column("timezone", sa.Text(), nullable=False),
        sa.Column("user_id", sa.Uuid(as_uuid=False), nullable=False),
        sa.Column("candidate_id", sa.Uuid(as_uuid=False), nullable=False),
        sa.Column("rank", sa.SmallInteger(), nullable=False),
        sa.Column("compatibility_score", sa.Double(), nullable=False),
        sa.Column("algorithm_version", sa.Text(), nullable=False),
        sa.Column("offered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("user_id <> candidate_id", name=op.f("ck_matchmaking_offers_not_self")),
        sa.CheckConstraint("rank >= 1", name=op.f("ck_matchmaking_offers_rank")),
        sa.CheckConstraint("compatibility_score >= 0 AND compatibility_score <= 1",
                           name=op.f("ck_matchmaking_offers_score")),
        sa.CheckConstraint("expires_at > offered_at", name=op.f("ck_matchmaking_offers_window")),
        sa.ForeignKeyConstraint(["candidate_id"], ["matchmaking_users.id"], ondelete="CASCADE",
                                name=op.f("fk_matchmaking_offers_candidate_id_matchmaking_users")),
        sa.ForeignKeyConstraint(["date", "user_id"], ["matchmaking_jobs.date", "matchmaking_jobs.user_id"],
                                ondelete="CASCADE", name=op.f("fk_matchmaking_offers_date_matchmaking_jobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_matchmaking_offers")),
        sa.UniqueConstraint("date", "user_id", "rank", name=op.f("uq_matchmaking_offers_date_user_id_rank")),
    )
    op.create_index("ix_matchmaking_offers_candidate_id", "matchmaking_offers", ["candidate_id"])


def downgrade() -> None:
    op.drop_table("matchmaking_offers")
    op.drop_table("matchmaking_jobs")
    op.drop_table("matchmaking_users")
