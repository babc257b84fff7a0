"""matching: LSH bands in a btree side table, so band retrieval ranks without reading documents

The GIN index on `document.embedding_bands` finds every row sharing a band, but ranking them by
the number of shared bands reads each row from the heap: at 100,000 documents about 2,000 heap
reads per query, growing with the corpus. `document_band (tenant, band, document_id)` answers the
same question from its primary key alone (an index-only scan and a count), and takes at most a
bounded number of rows per band. Triggers keep it equal to `embedding_bands` whoever writes the
document (pre-processing, COPY, a backfill); the GIN index is dropped.

Revision ID: 0302
Revises: 0301
Create Date: 2026-11-23 00:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0302"
down_revision: str | None = "0301"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FUNCTIONS = """
CREATE FUNCTION matching_document_band_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO document_band (tenant, band, document_id)
    SELECT DISTINCT n.tenant, b, n.id FROM new_rows AS n, unnest(n.embedding_bands) AS b WHERE b IS NOT NULL;
    RETURN NULL;
END $$;

CREATE FUNCTION matching_document_band_update() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM document_band WHERE document_id = NEW.id AND NOT (band = ANY (coalesce(NEW.embedding_bands, '{}')));
    INSERT INTO document_band (tenant, band, document_id)
    SELECT DISTINCT NEW.tenant, b, NEW.id FROM unnest(NEW.embedding_bands) AS b WHERE b IS NOT NULL
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;

-- statement level for inserts: a COPY of 100,000 documents is one INSERT … SELECT, not 100,000
CREATE TRIGGER matching_document_band_insert AFTER INSERT ON document
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION matching_document_band_insert();
-- row level, and only when the bands change: status and cluster updates never pay for it
CREATE TRIGGER matching_document_band_update AFTER UPDATE OF embedding_bands ON document
    FOR EACH ROW WHEN (OLD.embedding_bands IS DISTINCT FROM NEW.embedding_bands)
    EXECUTE FUNCTION matching_document_band_update();
"""


def upgrade() -> None:
    op.create_table(
        "document_band",
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("band", sa.Integer(), nullable=False),
        sa.Column("document_id", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["document_id"], ["document.id"], ondelete="CASCADE",
                                name=op.f("fk_document_band_document_id_document")),
        sa.PrimaryKeyConstraint("tenant", "band", "document_id", name=op.f("pk_document_band")),
    )
    op.create_index("ix_document_band_document_id", "document_band", ["document_id"])
    op.execute("INSERT INTO document_band (tenant, band, document_id) "
               "SELECT DISTINCT tenant, b, id FROM document, unnest(embedding_bands) AS b WHERE b IS NOT NULL")
    op.execute(_FUNCTIONS)
    op.drop_index("ix_document_embedding_bands", table_name="document", postgresql_using="gin")


def downgrade() -> None:
    op.create_index("ix_document_embedding_bands", "document", ["embedding_bands"], postgresql_using="gin",
                    postgresql_with={"fastupdate": "off"})
    op.execute("DROP TRIGGER matching_document_band_update ON document")
    op.execute("DROP TRIGGER matching_document_band_insert ON document")
    op.execute("DROP FUNCTION matching_document_band_update()")
    op.execute("DROP FUNCTION matching_document_band_insert()")
    op.drop_index("ix_document_band_document_id", table_name="document_band")
    op.drop_table("document_band")
