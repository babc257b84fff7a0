"""matching: documents with 000's four matching_* columns, match edges, candidate-retrieval indexes

000's own migration adds matching_status / matching_error / matching_attempts /
matching_failed_at to an existing `document` table; redrive has no such table yet, so this
branch creates it with those columns (and the fields matching needs) in one step.

Revision ID: 0301
Revises: 0002
Create Date: 2026-02-26 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0301"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = ("matching",)
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "document",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("doc_type", sa.Text(), nullable=False),
        sa.Column("counterparty", sa.Text(), server_default="", nullable=False),
        sa.Column("reference_numbers", postgresql.ARRAY(sa.Text()), server_default=sa.text("'{}'::text[]"),
                  nullable=False),
        sa.Column("amount", sa.Numeric(18, 2), nullable=True),
        sa.Column("currency", sa.Text(), nullable=True),
        sa.Column("document_date", sa.Date(), nullable=True),
        sa.Column("text", sa.Text(), server_default="", nullable=False),
        sa.Column("searchable_text", sa.Text(), nullable=True),
        sa.Column("normalized_counterparty", sa.Text(), nullable=True),
        sa.Column("normalized_references", postgresql.ARRAY(sa.Text()), nullable=True),
        sa.Column("embedding", sa.LargeBinary(), nullable=True),
        sa.Column("embedding_bands", postgresql.ARRAY(sa.Integer()), nullable=True),
        sa.Column("cluster_id", sa.Text(), nullable=True),
        sa.Column("matching_status", sa.Text(), nullable=True),
        sa.Column("matching_error", sa.Text(), nullable=True),
        sa.Column("matching_attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("matching_failed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("matching_started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "matching_status IN ('pending', 'in-progress', 'succeeded', 'failed')",
            name=op.f("ck_document_matching_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_document")),
    )
    op.create_index("ix_document_tenant_normalized_counterparty", "document", ["tenant", "normalized_counterparty"])
    op.create_index("ix_document_normalized_references", "document", ["normalized_references"],
                    postgresql_using="gin", postgresql_with={"fastupdate": "off"})
    op.create_index("ix_document_embedding_bands", "document", ["embedding_bands"], postgresql_using="gin",
                    postgresql_with={"fastupdate": "off"})
    # Each LSH band value is rare (about N/4096 rows); with the default statistics target the planner
    # overestimates `&&` on 16 of them and scans the table. A longer element list keeps the GIN index.
    op.execute("ALTER TABLE document ALTER COLUMN embedding_bands SET STATISTICS 1000")
    op.execute("ALTER TABLE document ALTER COLUMN normalized_references SET STATISTICS 1000")
    op.create_index("ix_document_tenant_cluster_id", "document", ["tenant", "cluster_id"])
    op.create_index("ix_document_tenant_matching_status", "document", ["tenant", "matching_status"])
    op.create_index("ix_document_in_progress_started", "document", ["matching_started_at"],
                    postgresql_where=sa.text("matching_status = 'in-progress'"))

    op.create_table(
        "document_match",
        sa.Column("document_a_id", sa.Text(), nullable=False),
        sa.Column("document_b_id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("confidence", sa.Float(), nullable=False),
        sa.Column("reason", sa.Text(), server_default="", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("document_a_id < document_b_id", name=op.f("ck_document_match_ordered")),
        sa.ForeignKeyConstraint(["document_a_id"], ["document.id"], ondelete="CASCADE",
                                name=op.f("fk_document_match_document_a_id_document")),
        sa.ForeignKeyConstraint(["document_b_id"], ["document.id"], ondelete="CASCADE",
                                name=op.f("fk_document_match_document_b_id_document")),
        sa.PrimaryKeyConstraint("document_a_id", "document_b_id", name=op.f("pk_document_match")),
    )
    op.create_index("ix_document_match_document_b_id", "document_match", ["document_b_id"])


def downgrade() -> None:
    op.drop_index("ix_document_match_document_b_id", table_name="document_match")
    op.drop_table("document_match")
    op.drop_index("ix_document_in_progress_started", table_name="document",
                  postgresql_where=sa.text("matching_status = 'in-progress'"))
    op.drop_index("ix_document_tenant_matching_status", table_name="document")
    op.drop_index("ix_document_tenant_cluster_id", table_name="document")
    op.drop_index("ix_document_embedding_bands", table_name="document", postgresql_using="gin")
    op.drop_index("ix_document_normalized_references", table_name="document", postgresql_using="gin")
    op.drop_index("ix_document_tenant_normalized_counterparty", table_name="document")
    op.drop_table("document")
