"""What finding an evidence file job's due rows costs: it must follow the due rows, not the table.

    python -m bench evidence                       # under the bench stack (make bench runs all)
    python -m bench.evidence                       # standalone (DATABASE_URL or the embedded PostgreSQL)
    BENCH_EVIDENCE_ROWS=100000 python -m bench.evidence   # smaller, while developing

Retries are due times on the core's work queue (`work_items`, one row per file_job_row, grouped by
file job), so 004 §3's scheduler scan is now the drain's claim: `work.claim(group_key=<file job>)`
leases up to a batch of the file job's due rows (SKIP LOCKED). Two queues in one database, built
with INSERT … SELECT generate_series:
- **large**: 1,000,000 work rows in 5,000 file jobs of 200 rows; 1 % due (10,000 rows: every row of
  50 file jobs), the rest done or due in 30 minutes;
- **baseline**: the same 10,000 due rows and nothing else.
Each claim of 50 rows of one due file job is timed in its own transaction and rolled back (so every
claim finds the same work); the median over CLAIMS claims is reported for both, with the ratio
large / baseline, and EXPLAIN shows the group's partial index doing the selection.
`populate` (artifact tables) is kept for the monitor's tests.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from datetime import UTC, datetime

import sqlalchemy as sa

from redrive import work
from redrive.db import engine_for, normalize_url
from redrive.schema import work_items
from resources.database import resolve_database_url
from orchestration.registry import all_metadata
from redrive.settings import Settings

CLAIMS = int(os.environ.get("BENCH_EVIDENCE_CLAIMS", "30"))
BATCH = 50  # DrainConfig.batch_size
JOB_ROWS = 200
DB_NAME = "redrive_bench_evidence"
TABLES = ["work_items"]

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


_WORK = """
INSERT INTO work_items (pipeline, entity_ref, group_key, status, due_at, created_at, updated_at)
SELECT 'evidence', :tag || '/row-' || r, :tag || '-job-' || (r / :job_rows),
       CASE WHEN r < :due THEN 'due' WHEN r % 3 = 0 THEN 'due' ELSE 'done' END,
       CASE WHEN r < :due THEN CAST(:now AS timestamptz) - make_interval(secs => r % 300)
            ELSE CAST(:now AS timestamptz) + interval '30 minutes' END,
       :now, :now
FROM generate_series(0, :rows - 1) AS r
"""


def populate_work(conn: sa.Connection, *, tag: str, rows: int, due: int, now: datetime) -> None:
    """`rows` work rows in file jobs of JOB_ROWS; the first `due` (whole file jobs) are due, a third of the
    rest waits 30 minutes, the others are done."""
    conn.execute(sa.text(_WORK), {"tag": tag, "rows": rows, "due": due, "job_rows": JOB_ROWS, "now": now})


def _fresh_database(settings: Settings) -> sa.Engine:
    base = normalize_url(settings.database_url) if settings.database_url else resolve_database_url(settings)
    admin = engine_for(str(sa.engine.make_url(base).set(database="postgres")))
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)"))
        conn.execute(sa.text(f"CREATE DATABASE {DB_NAME}"))
    engine = engine_for(str(sa.engine.make_url(base).set(database=DB_NAME)))
    metadata = all_metadata()
    metadata.create_all(engine, tables=[metadata.tables[t] for t in TABLES])
    return engine


def _claim_sql(engine: sa.Engine, group: str, now: datetime) -> str:
    q = (sa.select(work_items.c.id).where(work_items.c.pipeline == "evidence", work_items.c.group_key == group,
                                          work_items.c.status.in_(("due", "leased")), work_items.c.due_at <= now)
         .order_by(work_items.c.due_at).limit(BATCH))
    return str(q.compile(engine, compile_kwargs={"literal_binds": True}))


def _claims(engine: sa.Engine, tag: str, due_jobs: int, now: datetime, n: int) -> list[float]:
    times = []
    for i in range(n):
        group = f"{tag}-job-{i % due_jobs}"
        with engine.connect() as conn, conn.begin() as tx:
            started = time.perf_counter()
            items = work.claim(conn, "evidence", owner="bench", limit=BATCH, lease_seconds=300, now=now,
                               group_key=group)
            times.append((time.perf_counter() - started) * 1000)
            tx.rollback()
        assert len(items) == BATCH, f"expected a full batch, got {len(items)}"
    return times


def main() -> int:
    rows = int(os.environ.get("BENCH_EVIDENCE_ROWS", "1000000"))
    due = int(os.environ.get("BENCH_EVIDENCE_DUE", str(rows // 100)))
    due -= due % JOB_ROWS
    engine = _fresh_database(Settings())
    now = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
    figures = {}
    for name, size in (("baseline", due), ("large", rows)):
        started = time.perf_counter()
        with engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE work_items"))
            populate_work(conn, tag=name, rows=size, due=due, now=now)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM ANALYZE work_items"))
            total = conn.execute(sa.text("SELECT count(*) FROM work_items")).scalar_one()
            plan = "\n".join(conn.execute(sa.text(f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) "
                                                   f"{_claim_sql(engine, name + '-job-0', now)}")).scalars())
        built = time.perf_counter() - started
        _claims(engine, name, due // JOB_ROWS, now, 3)  # warm caches and connections
        times = _claims(engine, name, due // JOB_ROWS, now, CLAIMS)
        figures[name] = statistics.median(times)
        uses_index = "ix_work_items_group_claim" in plan
        print(f"{name:>8}: {total:>9,} work rows, {due:>6,} due in {due // JOB_ROWS} file jobs (built in {built:.1f}s); "
              f"claim of {BATCH} rows of one file job: median {figures[name]:.2f} ms "
              f"(min {min(times):.2f}, max {max(times):.2f}, {CLAIMS} claims); group index used: {uses_index}")
        if name == "large":
            print("  EXPLAIN (ANALYZE) of the claim's selection:")
            print("\n".join("    " + line for line in plan.splitlines()))
            if not uses_index:
                print("  ERROR: the claim did not use the group's due-rows index", file=sys.stderr)
                return 1
    print(f"ratio large/baseline: claim {figures['large'] / figures['baseline']:.2f}× for {rows // due}× the work "
          f"rows with the same {due:,} due (1.0× = cost follows the due rows only)")
    engine.dispose()
    return 0


if __name__ == "__main__":
    from devstack.stack import local_stack

    with local_stack("bench", migrate=False):  # starts only what DATABASE_URL etc. do not name
        status = main()
    sys.exit(status)
