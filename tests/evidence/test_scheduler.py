"""The retry scheduler (004 §3) on real Postgres: what it selects, its batch limit, its single
transaction, and two ticks at once requeueing each row exactly once."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from assets.evidence import repository as repo
from assets.evidence import service
from bench.evidence import populate

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
A, R, O = repo.file_job_artifact, repo.file_job_row, repo.evidence_outbox


def tick(engine, *, rows: int = 200, scan: int = 1000, after_lock=None, now: datetime = NOW) -> service.TickReport:
    return service.schedule_retries(engine, now=now, batch_rows=rows, scan_artifacts=scan,
                                    n2_timeout=timedelta(hours=24), n2_marks_permanent=True,
                                    monotonic=lambda: 0.0, after_lock=after_lock)


def row_with(conn, job, line: int, status: str, artifacts: list[dict]) -> uuid.UUID:
    rid = uuid.uuid4()
    conn.execute(sa.insert(R).values(id=rid, file_job_id=job, line_no=line, case_ref=f"c{line}", case_id=uuid.uuid4(),
                                     evidence_status=status))
    for i, a in enumerate(artifacts):
        conn.execute(sa.insert(A).values(id=uuid.uuid4(), file_job_id=job, file_job_row_id=rid,
                                         case_id=uuid.uuid4(), file_name=f"f{i}.pdf", s3_key=f"s3://b/{rid}/{i}", **a))
    return rid


def due(code: str = "503", retry_count: int = 0, minutes: float = -1) -> dict:
    return dict(attachment_status="FAILED", attachment_error_code=code, attempt_count=retry_count + 1,
                retry_count=retry_count, retry_status="RETRY_FAILED", next_retry_at=NOW + timedelta(minutes=minutes))


ATTACHED = dict(attachment_status="ATTACHED", attempt_count=1)


def test_selects_failed_rows_with_due_retryable_artifacts_only(engine) -> None:
    """Requeued: due NETWORK/SYSTEM failures with retries left, in PARTIALLY_FAILED/FAILED rows. Not:
    future ones, permanent codes (DATA, AUTH), spent budgets, final or attached ones, other rows."""
    job = uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(sa.insert(repo.file_job).values(id=job, source_bucket="b", source_key="k", source_etag="e",
                                                     notify_to="m@example.com"))
        want = {
            row_with(conn, job, 2, "PARTIALLY_FAILED", [due("503"), ATTACHED, due("500", minutes=30)]),
            row_with(conn, job, 3, "FAILED", [due("SYSTEM_ERROR", retry_count=1)]),
            row_with(conn, job, 4, "FAILED", [due("NETWORK_TIMEOUT"), due("CASE_NOT_FOUND")]),
        }
        skip = [
            row_with(conn, job, 5, "PARTIALLY_FAILED", [due("503", minutes=10), ATTACHED]),
            row_with(conn, job, 6, "FAILED", [due("CORRUPTED_FILE"), due("INVALID_FORMAT"), due("S3_NOT_FOUND")]),
            row_with(conn, job, 7, "FAILED", [due("CASE_NOT_FOUND"), due("UNAUTHORIZED"), due("401")]),
            row_with(conn, job, 8, "FAILED", [due("503", retry_count=2)]),
            row_with(conn, job, 9, "FAILED", [{**due("503"), "retry_status": "PERMANENT_FAILED"}]),
            row_with(conn, job, 10, "COMPLETED", [due("503")]),  # inconsistent on purpose: rows gate too
        ]
    report = tick(engine)
    assert {r.row_id for r in report.requeued} == want and not set(skip) & {r.row_id for r in report.requeued}
    with engine.connect() as conn:
        scheduled = conn.execute(sa.select(A.c.file_job_row_id, A.c.attachment_error_code, A.c.last_retry_at)
                                 .where(A.c.retry_status == "RETRY_SCHEDULED")).all()
        events = conn.execute(sa.select(O).where(O.c.event_type == "EVIDENCE_ATTACH_RETRY")).all()
    assert sorted(s.attachment_error_code for s in scheduled) == ["503", "NETWORK_TIMEOUT", "SYSTEM_ERROR"]
    assert {s.last_retry_at for s in scheduled} == {NOW}
    assert sorted(len(e.payload["artifacts"]) for e in events) == [1, 2, 3]  # Option A: the whole row
    assert {e.topic for e in events} == {"evidence.failed.requests"} and {e.status for e in events} == {"PENDING"}
    assert tick(engine).rows == 0  # nothing is due twice


def test_at_most_the_batch_per_tick(engine) -> None:
    """250 due rows with a batch of 200: 200, then 50, then none; the tick is the scheduler's heartbeat."""
    with engine.begin() as conn:
        populate(conn, tag="t", artifacts=1250, due=250, per_row=10, now=NOW)
    assert [tick(engine).rows for _ in range(3)] == [200, 50, 0]
    with engine.connect() as conn:
        ticks = conn.execute(sa.select(repo.evidence_scheduler_ticks.c.rows_requeued)
                             .order_by(repo.evidence_scheduler_ticks.c.id)).scalars().all()
        assert ticks == [200, 50, 0]
        assert conn.execute(sa.select(sa.func.count()).select_from(O)).scalar() == 250


def test_events_and_retry_fields_commit_together(engine, monkeypatch) -> None:
    """If writing the outbox events fails, no artifact is left RETRY_SCHEDULED: one transaction."""
    with engine.begin() as conn:
        populate(conn, tag="t", artifacts=30, due=10, per_row=10, now=NOW)

    def broken(*args, **kwargs):
        raise RuntimeError("outbox insert failed")

    monkeypatch.setattr(repo, "_event_values", broken)
    with pytest.raises(RuntimeError):
        tick(engine)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).where(A.c.retry_status == "RETRY_SCHEDULED")).scalar() == 0
        assert conn.execute(sa.select(sa.func.max(R.c.retry_round))).scalar() == 0
    monkeypatch.undo()
    assert tick(engine).rows == 10


def test_two_ticks_at_once_requeue_each_row_once(engine) -> None:
    """Two scheduler ticks started together (two deployments) on 300 due rows: every row gets exactly one
    retry event and its artifact is scheduled once; SKIP LOCKED splits the rows between them."""
    with engine.begin() as conn:
        populate(conn, tag="t", artifacts=1500, due=300, per_row=10, now=NOW)
    for _ in range(3):  # three rounds of racing pairs (the later rounds find what the first left)
        barrier = threading.Barrier(2)
        reports: list[service.TickReport] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                barrier.wait()
                reports.append(tick(engine, rows=200))
            except BaseException as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
    with engine.connect() as conn:
        per_row = Counter(conn.execute(sa.select(O.c.file_job_row_id)).scalars())
        rounds = conn.execute(sa.select(R.c.retry_round).where(R.c.evidence_status == "PARTIALLY_FAILED")).scalars().all()
        scheduled = conn.execute(sa.select(sa.func.count()).where(A.c.retry_status == "RETRY_SCHEDULED")).scalar()
    assert len(per_row) == 300 and set(per_row.values()) == {1}
    assert Counter(rounds)[1] == 300 and scheduled == 300


def test_a_tick_holding_rows_makes_the_other_skip_them(engine) -> None:
    """Tick A has locked its rows and not committed; tick B, meanwhile, takes only the other rows."""
    with engine.begin() as conn:
        populate(conn, tag="t", artifacts=60, due=60, per_row=10, now=NOW)
    locked, release = threading.Event(), threading.Event()
    held: list[uuid.UUID] = []

    def hold(rows: list[uuid.UUID]) -> None:
        held.extend(rows)
        locked.set()
        assert release.wait(30)

    first: list[service.TickReport] = []
    a = threading.Thread(target=lambda: first.append(tick(engine, rows=25, after_lock=hold)))
    a.start()
    assert locked.wait(30)
    second = tick(engine, rows=200)
    release.set()
    a.join(30)
    assert len(held) == 25 and second.rows == 35
    assert not {r.row_id for r in second.requeued} & set(held)
    assert {r.row_id for r in first[0].requeued} == set(held)


def test_selection_reads_the_due_rows_index(engine) -> None:
    """EXPLAIN of the selection on a table mostly not due: the due-rows partial index drives it."""
    with engine.begin() as conn:
        populate(conn, tag="t", artifacts=20_000, due=100, per_row=10, now=NOW)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE file_job_artifact"))
        conn.execute(sa.text("ANALYZE file_job_row"))
        sql = str(repo.due_rows_query(NOW, rows=200, scan=1000).compile(engine, compile_kwargs={"literal_binds": True}))
        plan = "\n".join(conn.execute(sa.text(f"EXPLAIN {sql}")).scalars())
    assert "idx_artifact_retry" in plan, plan
    assert "Seq Scan on file_job_artifact" not in plan, plan
