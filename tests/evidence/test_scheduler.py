"""The retry schedule (004 §3) as due times on the core's work queue, on real Postgres: one retry round
per file job, permanent codes never scheduled, the retry event and the due time in one transaction,
and two drains of one file job at once working each row once."""

from __future__ import annotations

import threading
from collections import Counter

import sqlalchemy as sa

from assets.evidence import repository as repo
from redrive.schema import work_items

A, R, O, W = repo.file_job_artifact, repo.file_job_row, repo.evidence_outbox, work_items


def work_rows(engine, job) -> list:
    with engine.connect() as conn:
        return conn.execute(sa.select(W).where(W.c.pipeline == "evidence", W.c.group_key == str(job))
                            .order_by(W.c.entity_ref)).all()


def test_ingest_enqueues_one_due_work_row_per_attachable_row(engine, seed_job, clock) -> None:
    """Ingest writes, with the rows, one due work item per row that has something to attach, grouped by
    its file job; a malformed row has none."""
    from tests.evidence.helpers import case_uuid, make_zip, pdf

    data = make_zip([[case_uuid("q", 1), "a.pdf"], ["not-a-uuid", "b.pdf"], [case_uuid("q", 2), "c.pdf"]],
                    {"a.pdf": pdf("a"), "b.pdf": pdf("b"), "c.pdf": pdf("c")})
    job, events, rows = seed_job("q", data=data)
    assert len(rows) == 2
    items = work_rows(engine, job)
    assert {i.entity_ref for i in items} == {f"{job}/{r}" for r in rows}
    assert {(i.status, i.due_at) for i in items} == {("due", clock.now())}


def test_a_file_jobs_failures_fall_due_together_with_their_retry_events(engine, seed_job, drain, clock,
                                                                        sandbox) -> None:
    """A pass over 40 rows with 30 % transient faults: every row with a retry left is due again at one time
    (the retry round of the file job, 5 min ± 20 %), equal to its artifacts' next_retry_at, and has exactly
    one EVIDENCE_ATTACH_RETRY event naming all its artifacts; finished rows are done."""
    job, _, _ = seed_job("round", rows=40, per_row=2)
    sandbox.random_faults("case.attach", seed=7, rates={"503": 0.3})
    report = drain(job)
    assert report.claimed == 40 and report.retried > 0 and report.done > 0
    items = work_rows(engine, job)
    waiting = [i for i in items if i.status == "due"]
    assert len(waiting) == report.retried and sum(i.status == "done" for i in items) == report.done
    due_times = {i.due_at for i in waiting}
    assert len(due_times) == 1
    [due_at] = due_times
    assert 4 * 60 <= (due_at - clock.now()).total_seconds() <= 6 * 60
    with engine.connect() as conn:
        next_retry = set(conn.execute(sa.select(A.c.next_retry_at).where(A.c.file_job_id == job,
                                                                         A.c.retry_status == "RETRY_FAILED"))
                         .scalars())
        events = conn.execute(sa.select(O).where(O.c.file_job_id == job, O.c.event_type == "EVIDENCE_ATTACH_RETRY")).all()
    assert next_retry == {due_at}
    assert Counter(str(e.file_job_row_id) for e in events) == Counter(i.entity_ref.split("/")[1] for i in waiting)
    assert all(len(e.payload["artifacts"]) == 2 for e in events)
    assert drain(job).claimed == 0  # nothing is due before its time


def test_permanent_codes_are_never_scheduled(engine, seed_job, drain, clock, sandbox) -> None:
    """CASE_NOT_FOUND and a file the archive lacks (S3_NOT_FOUND) are final at once: no retry event, no due
    time; the row with an operational failure is dead, the DATA-only row done."""
    from tests.evidence.helpers import case_uuid, make_zip, pdf

    gone, fine = case_uuid("p", 1), case_uuid("p", 2)
    data = make_zip([[gone, "a.pdf"], [fine, "b.pdf;missing.pdf"]], {"a.pdf": pdf("a"), "b.pdf": pdf("b")})
    job, _, rows = seed_job("p", data=data)
    sandbox.mark_cases_missing(gone)
    report = drain(job)
    assert (report.dead_lettered, report.done, report.retried) == (1, 1, 0)
    assert sorted(i.status for i in work_rows(engine, job)) == ["dead", "done"]
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).where(O.c.event_type == "EVIDENCE_ATTACH_RETRY")).scalar() == 0
    clock.advance(7200)
    assert drain(job).claimed == 0


def test_retry_event_and_due_time_commit_together(engine, seed_job, drain, clock, sandbox, monkeypatch) -> None:
    """If writing the retry event fails, the row is not rescheduled either (its lease stands and runs out);
    the next pass after the lease settles both."""
    job, _, [row] = seed_job("tx", per_row=1)
    sandbox.script("case.attach", {"status": 503}, {"status": 503})  # the second, if the retry is due by then
    real = repo.schedule_row_retry

    def broken(*args, **kwargs):
        raise RuntimeError("outbox insert failed")

    monkeypatch.setattr(repo, "schedule_row_retry", broken)
    report = drain(job)
    assert report.retried == 0 and report.errors == {"unsettled": 1}
    [item] = work_rows(engine, job)
    assert item.status == "leased"
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).where(O.c.event_type == "EVIDENCE_ATTACH_RETRY")).scalar() == 0
        assert conn.execute(sa.select(R.c.retry_round)).scalar() == 0
    monkeypatch.setattr(repo, "schedule_row_retry", real)
    clock.advance(301)  # the lease ran out: the row is due again
    assert drain(job).retried == 1
    [item] = work_rows(engine, job)
    with engine.connect() as conn:
        [event] = conn.execute(sa.select(O).where(O.c.event_type == "EVIDENCE_ATTACH_RETRY")).all()
        next_retry = conn.execute(sa.select(A.c.next_retry_at)).scalar()
    assert item.status == "due" and item.due_at == next_retry > clock.now() and event.payload["retry_round"] == 1


def test_two_drains_of_one_file_job_work_each_row_once(engine, seed_job, drain, sandbox, settings, clock) -> None:
    """Two drain runs of one file job started together (a UI launch beside the sensor's run): SKIP LOCKED
    splits the rows, every artifact is attached exactly once and every row is done."""
    from resources.evidence import CaseApiResource

    job, _, _ = seed_job("two", rows=30, per_row=2)
    drains = 2
    barrier, reports, errors = threading.Barrier(drains), [], []

    def run() -> None:
        try:
            with CaseApiResource(base_url=settings.case_url, token="t").session() as api:
                barrier.wait()
                reports.append(drain(job, api=api))
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(drains)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    # SKIP LOCKED split the rows: each claimed once; a row that met the other drain's lock on the file job
    # (DB_TRANSIENT: our database, not the row's failure, so no attempt spent) is due again, never lost, and a
    # later pass finishes it
    assert sum(r.claimed for r in reports) == 30, reports
    assert sum(r.done + r.retried + r.infrastructure for r in reports) == 30, reports
    assert all(r.dead_lettered == 0 for r in reports), reports
    for _ in range(5):
        if {i.status for i in work_rows(engine, job)} == {"done"}:
            break
        clock.advance(3600)
        with CaseApiResource(base_url=settings.case_url, token="t").session() as api:
            drain(job, api=api)
    keys = Counter(e["idempotency_key"] for e in sandbox.effects("case.attach"))
    assert len(keys) == 60 and set(keys.values()) == {1}
    assert {i.status for i in work_rows(engine, job)} == {"done"}
