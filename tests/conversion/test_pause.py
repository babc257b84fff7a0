"""Issue 26 §2 (found by the chaos run): a worker paused or cut off from its database past its leases writes
what its slots finished before it reclaims anything, and fails no job whose conversion succeeded."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from assets.conversion import policy
from devstack.postgres import with_database
from redrive.schema import dead_letters
from tests.conversion.test_worker import job

# the keeper extends nothing during the test: the pause froze it along with the main loop
KNOBS = {"worker_concurrency": 4, "worker_lease_extend_sec": 600, "retry_max_attempts": 3}


def _last_attempt_next(engine: sa.Engine) -> None:
    """Every job has spent two attempts: the next claim is its last (the chaos run's failed job)."""
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE conversion_jobs SET attempt_count = 2"))


def _wait_finished(worker, n: int) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 20
    while worker.slots.finished.qsize() + len(worker._unwritten) < n:
        assert time.monotonic() < deadline, "the slots did not finish"
        time.sleep(0.02)


def _events(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT event FROM conversion_job_events ORDER BY id")).scalars())


def test_a_worker_frozen_past_its_leases_records_every_finished_result(engine, submit, make_worker, clock,
                                                                       conv_settings) -> None:
    """4 jobs on their last attempt; the worker's loop freezes 10 s (leases are 2 s) while its 4 slots finish:
    its next turn completes all 4, and no job is reclaimed, fenced or failed."""
    ids = [submit() for _ in range(4)]
    _last_attempt_next(engine)
    worker = make_worker(settings=conv_settings.model_copy(update=KNOBS))
    assert worker.turn() == "busy"
    _wait_finished(worker, 4)
    clock.advance(10)  # frozen: every lease ran out meanwhile
    worker.turn()
    assert {job(engine, i).status for i in ids} == {"succeeded"}
    assert worker.report.succeeded == 4 and worker.report.fenced == 0 and worker.report.failed == 0
    assert "expired" not in _events(engine) and "fenced" not in _events(engine)


def test_a_database_outage_longer_than_the_lease_fails_no_succeeded_job(engine, db_url, admin_url, submit,
                                                                       make_worker, clock, conv_settings,
                                                                       sandbox) -> None:
    """The database goes away while 4 jobs (on their last attempt) are converting, and stays away past their
    leases; one conversion is still running when it comes back. The worker writes the 3 finished ones, keeps
    its lease on the running one (no self-reclaim), and writes it too: 4 succeeded, nothing expired."""
    sandbox.script("pdf.convert", {"kind": "ok"}, {"kind": "ok"}, {"kind": "ok"}, {"kind": "delay", "seconds": 2.5})
    ids = [submit() for _ in range(4)]
    _last_attempt_next(engine)
    worker = make_worker(settings=conv_settings.model_copy(update=KNOBS))
    name = db_url.rsplit("/", 1)[1].split("?")[0]
    admin = sa.create_engine(with_database(admin_url, "postgres"), isolation_level="AUTOCOMMIT")
    try:
        worker.turn(claim=True)  # 4 claimed and started; returns when the first finished
        with admin.connect() as conn:  # the database goes away
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
                         {"d": name})
        _wait_finished(worker, 3)
        with pytest.raises(Exception) as away:  # noqa: PT011 - what the loop catches and waits out
            worker.turn()
        assert policy.classify(away.value).retryable
        clock.advance(10)  # the outage outlasted every lease
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()
    engine.dispose()  # the pool's connections were terminated
    for _ in range(10):
        if not worker.in_flight and not worker._unwritten:
            break
        worker.turn(claim=False)
    assert {job(engine, i).status for i in ids} == {"succeeded"}
    assert worker.report.succeeded == 4 and worker.report.failed == 0 and worker.report.fenced == 0
    assert "expired" not in _events(engine) and "fenced" not in _events(engine)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar_one() == 0
