"""Issue 13 §10: the claim reads due jobs from indexes, also behind many jobs scheduled in the future."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from assets.conversion import repository as repo

NOW = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
FUTURE, DUE_RETRIES, FRESH = 20_000, 30, 30


def _load(engine: sa.Engine) -> None:
    """20,000 queued jobs waiting for a retry tomorrow, created *before* the due ones, then due retries and
    fresh jobs: a claim walking queued jobs in created order would read (and filter out) the 20,000 first."""
    with engine.begin() as conn:
        conn.execute(sa.text("""
            INSERT INTO conversion_jobs (id, owner, filename, source_location, source_bytes, source_sha256, status,
                                         retry_after, attempt_count, queued_at, created_at, updated_at)
            SELECT md5('future-' || g)::uuid, 'u', 'future.pdf', 'x', 1, 'h', 'queued', :tomorrow, 1, :old, :old + g * interval '1 ms',
                   :old FROM generate_series(1, :n) g"""), {"tomorrow": NOW + timedelta(days=1), "n": FUTURE,
                                                             "old": NOW - timedelta(hours=2)})
        conn.execute(sa.text("""
            INSERT INTO conversion_jobs (id, owner, filename, source_location, source_bytes, source_sha256, status,
                                         retry_after, attempt_count, queued_at, created_at, updated_at)
            SELECT md5('retry-' || g)::uuid, 'u', 'retry.pdf', 'x', 1, 'h', 'queued', :due, 1, :t, :t, :t
            FROM generate_series(1, :n) g"""), {"due": NOW - timedelta(minutes=1), "n": DUE_RETRIES,
                                                "t": NOW - timedelta(hours=1)})
        conn.execute(sa.text("""
            INSERT INTO conversion_jobs (id, owner, filename, source_location, source_bytes, source_sha256, status,
                                         queued_at, created_at, updated_at)
            SELECT md5('fresh-' || g)::uuid, 'u', 'fresh.pdf', 'x', 1, 'h', 'queued', :t, :t, :t
            FROM generate_series(1, :n) g"""), {"n": FRESH, "t": NOW - timedelta(minutes=5)})
        conn.execute(sa.text("ANALYZE conversion_jobs"))


def _plan(engine: sa.Engine, limit: int) -> dict:
    sql = repo.CLAIM_SQL.replace("LIMIT 1", "LIMIT :limit")
    params = {"now": NOW, "worker": "w", "lease_expires_at": NOW + timedelta(seconds=90), "breaker": "pdf-gateway",
              "limit": limit, "window": limit * 4 + 64}
    with engine.begin() as conn:
        [[plan]] = conn.execute(sa.text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql), params).all()
        conn.rollback()
    return plan[0] if isinstance(plan, list) else json.loads(plan)[0]


def _nodes(node: dict) -> list[dict]:
    return [node, *[n for child in node.get("Plans", []) for n in _nodes(child)]]


def test_the_claim_reads_due_jobs_through_the_status_retry_after_index(engine) -> None:
    """The plan's scans of conversion_jobs are index scans, the (status, retry_after) index among them (003 §3.2);
    none reads the 20,000 future jobs and filters them out."""
    _load(engine)
    plan = _plan(engine, limit=20)
    scans = [n for n in _nodes(plan["Plan"]) if n.get("Relation Name") == "conversion_jobs"]
    indexes = {n.get("Index Name") for n in scans}
    assert "ix_conversion_jobs_status_retry_after" in indexes
    assert not [n for n in scans if n["Node Type"] == "Seq Scan"]
    assert sum(n.get("Rows Removed by Filter", 0) for n in scans) < 100  # never the 20,000 future ones
    assert max(n.get("Actual Rows", 0) for n in scans) <= 20 * 4 + 64


def test_the_claim_takes_the_oldest_due_jobs_and_none_scheduled_later(engine) -> None:
    """What the two ranges claim is what 003 §3.4 says: due retries and fresh jobs, oldest first."""
    _load(engine)
    with engine.begin() as conn:
        leases = repo.claim_many(conn, "w", NOW, 90, "pdf-gateway", 40)
    with engine.connect() as conn:
        kinds = [conn.execute(sa.text("SELECT filename FROM conversion_jobs WHERE id = :i"), {"i": lease.job_id})
                 .scalar_one() for lease in leases]
    # the 30 due retries (created an hour ago) and the 10 oldest fresh jobs; no job scheduled for tomorrow
    assert sorted(kinds).count("retry.pdf") == DUE_RETRIES and kinds.count("fresh.pdf") == 10
    assert "future.pdf" not in kinds
