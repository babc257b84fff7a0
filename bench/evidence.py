"""What a tick of the evidence retry scheduler (004 §3) costs: it must follow the due rows, not the table.

    python -m bench evidence                       # under the bench stack (make bench runs all)
    python -m bench.evidence                       # standalone (DATABASE_URL or the embedded PostgreSQL)
    BENCH_EVIDENCE_ARTIFACTS=100000 python -m bench.evidence   # smaller, while developing

Two artifact tables in one database, built with INSERT … SELECT generate_series:
- **large**: 1,000,000 artifacts, 1 % due: 10,000 one-artifact rows whose artifact is due, spread
  evenly among 99,000 rows of 10 artifacts that are attached or not due (every 13th row holds a
  failure due in 30 minutes and a final CASE_NOT_FOUND);
- **baseline**: 10,000 artifacts, the same 10,000 due one-artifact rows and nothing else.
The due rows have the same shape in both, so a tick does the same work; only the table differs.
Each tick is `repository.requeue_due` (lock ≤ 200 due rows SKIP LOCKED, mark their artifacts
RETRY_SCHEDULED, write one outbox event per row) in its own committed transaction, exactly as the
sensor runs it; the median over TICKS ticks is reported for both, with the ratio large / baseline,
and EXPLAIN shows the due-rows index doing the selection.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import UTC, datetime

import sqlalchemy as sa

from assets.evidence import repository as repo
from redrive.db import engine_for, normalize_url
from resources.database import resolve_database_url
from orchestration.registry import all_metadata
from redrive.settings import Settings

TICKS = int(os.environ.get("BENCH_EVIDENCE_TICKS", "15"))
BATCH_ROWS = 200
SCAN = 1000  # EvidenceSettings.scheduler_scan_artifacts
DB_NAME = "redrive_bench_evidence"
TABLES = ["file_job", "file_job_row", "file_job_artifact", "evidence_outbox", "evidence_scheduler_ticks",
          "evidence_metrics", "evidence_alert_state"]

_JOBS = """
INSERT INTO file_job (id, source_bucket, source_key, source_etag, notify_to, status, created_at, updated_at)
SELECT md5(:tag || ':job:' || j)::uuid, 'bench', 'inbox/' || :tag || '/' || j || '.zip', 'etag',
       'bench@example.com', 'INGESTED', :now, :now
FROM generate_series(0, (:rows - 1) / 1000) AS j
"""
# Row r is a due row iff floor(r·due/rows) steps up at r: exactly `due` rows, evenly spread over the table.
_SHAPE = """
SELECT r, ((r * CAST(:due AS bigint)) / :rows > ((r - 1) * CAST(:due AS bigint)) / :rows) AS due_row
FROM generate_series(1, :rows) AS r
"""
_ROWS = f"""
INSERT INTO file_job_row (id, file_job_id, line_no, case_ref, case_id, evidence_count, evidence_status,
                          created_at, updated_at)
SELECT md5(:tag || ':row:' || r)::uuid, md5(:tag || ':job:' || ((r - 1) / 1000))::uuid, r, 'case-' || r,
       md5(:tag || ':case:' || r)::uuid, CASE WHEN due_row THEN 1 ELSE :per_row END,
       CASE WHEN due_row OR r % 13 = 0 THEN 'PARTIALLY_FAILED' ELSE 'COMPLETED' END, :now, :now
FROM ({_SHAPE}) AS shape
"""
# A due row holds one artifact, due (503, RETRY_FAILED, next_retry_at passed); the other rows hold
# `per_row` artifacts, attached, except in every 13th row one failure not due for 30 minutes and one
# CASE_NOT_FOUND (final): the kinds of rows the scheduler must walk past without reading them.
_ARTIFACTS = f"""
INSERT INTO file_job_artifact (id, file_job_id, file_job_row_id, case_id, file_name, s3_key, attachment_status,
                               attachment_error_code, attempt_count, retry_count, retry_status, next_retry_at,
                               attached_at, created_at, updated_at)
SELECT md5(:tag || ':art:' || r || ':' || k)::uuid, md5(:tag || ':job:' || ((r - 1) / 1000))::uuid,
       md5(:tag || ':row:' || r)::uuid, md5(:tag || ':case:' || r)::uuid,
       'evidence-' || k || '.pdf', 's3://bench/' || :tag || '/' || r || '/' || k,
       CASE WHEN kind = 'attached' THEN 'ATTACHED' ELSE 'FAILED' END,
       CASE kind WHEN 'due' THEN '503' WHEN 'later' THEN 'SYSTEM_ERROR' WHEN 'final' THEN 'CASE_NOT_FOUND' END,
       1, 0,
       CASE kind WHEN 'due' THEN 'RETRY_FAILED' WHEN 'later' THEN 'RETRY_FAILED' WHEN 'final' THEN 'PERMANENT_FAILED'
                 ELSE 'PENDING' END,
       CASE kind WHEN 'due' THEN CAST(:now AS timestamptz) - make_interval(secs => 60 + r % 3000)
                 WHEN 'later' THEN CAST(:now AS timestamptz) + interval '30 minutes' END,
       CASE WHEN kind = 'attached' THEN CAST(:now AS timestamptz) END, :now, :now
FROM (
  SELECT r, k, CASE WHEN due_row THEN 'due'
                    WHEN r % 13 = 0 AND k = 1 THEN 'later'
                    WHEN r % 13 = 0 AND k = 2 THEN 'final'
                    ELSE 'attached' END AS kind
  FROM ({_SHAPE}) AS shape,
       LATERAL generate_series(0, CASE WHEN due_row THEN 0 ELSE :per_row - 1 END) AS k
) AS t
"""


def populate(conn: sa.Connection, *, tag: str, artifacts: int, due: int, per_row: int, now: datetime) -> None:
    """`due` one-artifact rows whose artifact is due, spread evenly among rows of `per_row` artifacts
    that are not due, `artifacts` artifacts in all; built by the database, not by Python loops."""
    other_rows = (artifacts - due) // per_row
    params = {"tag": tag, "rows": due + other_rows, "due": due, "per_row": per_row, "now": now}
    for statement in (_JOBS, _ROWS, _ARTIFACTS):
        conn.execute(sa.text(statement), params)


def _fresh_database(settings: Settings) -> sa.Engine:
    base = normalize_url(settings.database_url) if settings.database_url else resolve_database_url(settings)
    admin = engine_for(str(sa.engine.make_url(base).set(database="postgres")))
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)"))
        conn.execute(sa.text(f"CREATE DATABASE {DB_NAME}"))
    engine = engine_for(str(sa.engine.make_url(base).set(database=DB_NAME)))
    metadata = all_metadata()
    metadata.create_all(engine, tables=[metadata.tables[t] for t in TABLES])  # the evidence tables only
    return engine


def _explain(engine: sa.Engine, now: datetime) -> str:
    query = repo.due_rows_query(now, rows=BATCH_ROWS, scan=SCAN)
    sql = str(query.compile(engine, compile_kwargs={"literal_binds": True}))
    with engine.begin() as conn:
        plan = conn.execute(sa.text(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {sql}")).scalars().all()
        conn.rollback()
    return "\n".join(plan)


def _ticks(engine: sa.Engine, now: datetime, n: int) -> list[float]:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        with engine.begin() as conn:
            requeued = repo.requeue_due(conn, now=now, rows=BATCH_ROWS, scan=SCAN)
        times.append((time.perf_counter() - started) * 1000)
        assert len(requeued) == BATCH_ROWS, f"expected a full batch, got {len(requeued)}"
    return times


def _selections(engine: sa.Engine, now: datetime, n: int) -> list[float]:
    """The row selection alone (lock ≤ 200 due rows, SKIP LOCKED), rolled back: what the index decides."""
    times = []
    for _ in range(n):
        with engine.connect() as conn, conn.begin() as tx:
            started = time.perf_counter()
            rows = conn.execute(repo.due_rows_query(now, rows=BATCH_ROWS, scan=SCAN)).all()
            times.append((time.perf_counter() - started) * 1000)
            tx.rollback()
        assert len(rows) == BATCH_ROWS
    return times


def main() -> int:
    artifacts = int(os.environ.get("BENCH_EVIDENCE_ARTIFACTS", "1000000"))
    due = int(os.environ.get("BENCH_EVIDENCE_DUE", str(artifacts // 100)))
    engine = _fresh_database(Settings())
    now = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
    figures, selection = {}, {}
    for name, size in (("baseline", due), ("large", artifacts)):
        started = time.perf_counter()
        with engine.begin() as conn:
            for t in TABLES[:3]:
                conn.execute(sa.text(f"TRUNCATE {t} CASCADE"))
            populate(conn, tag=name, artifacts=size, due=due, per_row=10, now=now)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE file_job_row"))
            conn.execute(sa.text("VACUUM ANALYZE file_job_artifact"))
            total = conn.execute(sa.text("SELECT count(*) FROM file_job_artifact")).scalar_one()
            due_now = conn.execute(sa.text("SELECT count(*) FROM file_job_artifact WHERE retry_status = 'RETRY_FAILED' "
                                           "AND next_retry_at <= :now AND is_retryable"), {"now": now}).scalar_one()
        built = time.perf_counter() - started
        plan = _explain(engine, now)
        _ticks(engine, now, 2)  # warm caches and connections
        selection[name] = statistics.median(_selections(engine, now, TICKS))
        times = _ticks(engine, now, TICKS)
        figures[name] = statistics.median(times)
        uses_index = "idx_artifact_retry" in plan or name == "baseline"  # all due: a scan is the right plan
        print(f"{name:>8}: {total:>9,} artifacts, {due_now:>6,} due (built in {built:.1f}s); "
              f"tick of {BATCH_ROWS} rows: median {figures[name]:.1f} ms "
              f"(min {min(times):.1f}, max {max(times):.1f}, {TICKS} ticks), of which the row selection "
              f"{selection[name]:.1f} ms; due-rows index used: {uses_index}")
        if name == "large" or os.environ.get("BENCH_EVIDENCE_PLANS"):
            print("  EXPLAIN (ANALYZE) of the row selection:")
            print("\n".join("    " + line for line in plan.splitlines()))
        if name == "large" and not uses_index:
            print("  ERROR: the scheduler's selection did not use the due-rows index", file=sys.stderr)
            return 1
    ratio = figures["large"] / figures["baseline"]
    print(f"ratio large/baseline: tick {ratio:.2f}×, row selection {selection['large'] / selection['baseline']:.2f}×, "
          f"for {artifacts // due}× the artifacts with the same {due:,} due (1.0× = cost follows the due rows only)")
    engine.dispose()
    return 0


if __name__ == "__main__":
    from devstack.stack import local_stack

    with local_stack("bench", migrate=False):  # starts only what DATABASE_URL etc. do not name
        status = main()
    sys.exit(status)
