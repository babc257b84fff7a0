"""Candidate retrieval: by counterparty, shared reference or LSH band, through indexes, tenant-scoped."""

from __future__ import annotations

import sqlalchemy as sa

from assets.matching import policy, repository
from tests.matching.conftest import TENANT, doc, ingest, prepare, row


def candidates_for(engine, doc_id: str) -> list[str]:
    target = row(engine, doc_id)
    prepared = policy.prepare(target)
    with engine.connect() as conn:
        found = repository.retrieve_candidates(conn, doc_id, target["tenant"], prepared)
    return [c.id for c in policy.rank_candidates(prepared, found, 10)]


def test_each_signal_finds_its_candidate_and_other_tenants_stay_out(engine, queue) -> None:
    """Same normalized counterparty, a shared reference, or a near-duplicate text (LSH) each retrieve;
    tenants never mix."""
    ingest(
        engine, queue,
        doc("q", counterparty="Globex Corporation", references=["PO-991"], text="steel beams, 40 pieces"),
        doc("by-counterparty", counterparty="GLOBEX corp.", references=["X-1"], text="unrelated words entirely"),
        doc("by-reference", counterparty="Initech", references=["po 991"], text="something else"),
        # a re-typed copy: counterparty spelled apart (normalizes to "glob ex"), other reference, other type
        doc("by-text", counterparty="Glob-ex Corporation", references=["Z-77"], doc_type="delivery_note",
            amount=None, text="steel beams, 40 pieces"),
        doc("stranger", counterparty="Umbrella", references=["U-5"], text="medical supplies", amount="3.10",
            currency="USD", document_date="2025-03-01", doc_type="receipt"),
        doc("other-tenant", tenant="someone-else", counterparty="Globex Corporation", references=["PO-991"],
            text="steel beams, 40 pieces"),
    )
    prepare(engine, "by-counterparty", "by-reference", "by-text", "stranger", "other-tenant")
    found = candidates_for(engine, "q")
    assert {"by-counterparty", "by-reference", "by-text"} <= set(found)
    assert "other-tenant" not in found and "q" not in found
    assert found.index("by-text") < found.index("stranger") if "stranger" in found else True


def test_documents_not_yet_preprocessed_are_not_candidates(engine, queue) -> None:
    """Only documents with persisted searchable fields are retrieved (the rest have no embedding yet)."""
    ingest(engine, queue, doc("q"), doc("raw"))
    assert candidates_for(engine, "q") == []


BULK = """
INSERT INTO document (id, tenant, doc_type, counterparty, normalized_counterparty, normalized_references,
                      embedding, embedding_bands)
SELECT 'bulk-' || i, :tenant, 'invoice', 'vendor ' || (i % 2000), 'vendor ' || (i % 2000),
       ARRAY['REF' || i, 'PO' || (i % 5000)], decode(repeat('00', 1024), 'hex'),
       ARRAY(SELECT (b << 12) | ((i * 7919 + b * 104729) % 4096)::int FROM generate_series(0, 15) AS b)
FROM generate_series(1, :n) AS i
"""


def test_retrieval_query_uses_its_indexes_not_a_scan(engine, queue) -> None:
    """On 20,000 documents the plan reads the counterparty and reference indexes and the band table's key
    (index only, filled by the insert trigger), never a table scan."""
    with engine.begin() as conn:
        conn.execute(sa.text(BULK), {"tenant": TENANT, "n": 20000})
        conn.execute(sa.text("ANALYZE document"))
        conn.execute(sa.text("ANALYZE document_band"))
    ingest(engine, queue, doc("q", counterparty="vendor 7", references=["PO 7"]))
    prepared = policy.prepare(row(engine, "q"))
    with engine.connect() as conn:
        plan = "\n".join(r[0] for r in conn.execute(
            sa.text("EXPLAIN " + str(repository._RETRIEVE)),
            {"id": "q", "tenant": TENANT, "counterparty": prepared.normalized_counterparty,
             "references": prepared.normalized_references, "bands": prepared.bands,
             "k_counterparty": 100, "k_references": 100, "k_embedding": 100, "per_band": repository.PER_BAND}))
        found = repository.retrieve_candidates(conn, "q", TENANT, prepared)
    for index in ("ix_document_tenant_normalized_counterparty", "ix_document_normalized_references",
                  "Index Only Scan using pk_document_band"):
        assert index in plan, plan
    assert "Seq Scan on document" not in plan, plan  # neither documents nor bands
    assert {"bulk-7", "bulk-2007"} <= {c.id for c in found}  # same counterparty and reference PO7
    assert len(found) <= repository.BY_COUNTERPARTY + repository.BY_REFERENCES + repository.BY_EMBEDDING


def test_lsh_neighbours_share_bands_and_strangers_rarely_do() -> None:
    """Near-duplicate texts share LSH band values; unrelated texts share far fewer."""
    e = policy.DEFAULT_EMBEDDER
    base = "invoice | ACME GmbH | INV-1001 | 1200.00 EUR | 2026-01-05 | consulting services January"
    near = base.replace("January", "Jan.")
    far = "receipt | Umbrella | R-9 | 3.10 USD | 2025-03-01 | medical supplies"
    shared = lambda a, b: len(set(policy.lsh_bands(e.embed(a))) & set(policy.lsh_bands(e.embed(b))))  # noqa: E731
    assert shared(base, near) >= 2
    assert shared(base, far) < shared(base, near)


def test_band_table_follows_the_documents_bands(engine, queue) -> None:
    """The triggers keep document_band equal to embedding_bands: filled by pre-processing, replaced when the
    bands change, untouched by status updates, gone with the document."""
    ingest(engine, queue, doc("q", text="steel beams, 40 pieces"))
    bands = lambda: sorted(r[0] for r in conn.execute(  # noqa: E731
        sa.text("SELECT band FROM document_band WHERE document_id = 'q'")))
    with engine.begin() as conn:
        assert bands() == []
    prepare(engine, "q")
    with engine.begin() as conn:
        assert bands() == sorted(row(engine, "q")["embedding_bands"]) and len(bands()) == policy.LSH_BANDS
        conn.execute(sa.text("UPDATE document SET embedding_bands = ARRAY[1, 2] WHERE id = 'q'"))
        assert bands() == [1, 2]
        conn.execute(sa.text("UPDATE document SET matching_status = 'succeeded' WHERE id = 'q'"))
        assert bands() == [1, 2]
        conn.execute(sa.text("DELETE FROM document WHERE id = 'q'"))
        assert bands() == []
