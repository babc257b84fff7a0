"""Lease fencing: a worker whose lease was reclaimed can neither complete, fail, retry, extend nor requeue the job."""

from __future__ import annotations

import logging
import time

import psycopg2
import pytest
import sqlalchemy as sa

from assets.conversion import repository as repo
from redrive import logs
from tests.conversion.conftest import events, files_under, job


def test_every_late_write_of_a_reclaimed_lease_is_refused_logged_and_counted(engine, submit, make_worker, clock,
                                                                              files, caplog) -> None:
    """After B took the job over, each of A's writes changes nothing, leaves a `fenced` event and a JSON log line."""
    job_id = submit()
    a, b = make_worker(worker_id="a"), make_worker(worker_id="b")
    stale = a.claim()
    assert stale is not None and stale.epoch == 1
    clock.advance(3)  # lease TTL 2 s: A looks dead
    assert [r.job_id for r in b.reclaim()] == [job_id]
    fresh = b.claim()
    assert fresh is not None and fresh.epoch == 2

    caplog.set_level(logging.INFO, logger="redrive.conversion.worker")
    with engine.begin() as conn:
        assert not repo.complete(conn, stale, "x.xml", clock.now(), {})
        assert not repo.fail(conn, stale, "GW_4XX", "late", clock.now(), {})
        assert not repo.schedule_retry(conn, stale, "GW_5XX", "late", clock.now(), clock.now(), {})
        assert not repo.requeue(conn, stale, clock.now(), "shutdown")
    assert a.extend(stale) is False
    assert a._complete(stale, b"<document sha256=\"0\"/>", 1.0, None) == "fenced"
    held = job(engine, job_id)
    assert (held.status, held.leased_by, held.lease_epoch) == ("processing", "b", 2)
    assert files_under(files.results) == []  # A's staged result was discarded, never published

    assert b._complete(fresh, b"<document sha256=\"1\"/>", 1.0, None) == "succeeded"
    assert a.requeue(stale, "shutdown") is False  # still refused after B finished
    assert job(engine, job_id).status == "succeeded"
    assert files_under(files.results) == [f"{job_id}.xml"]

    with engine.connect() as conn:
        fenced = [e["meta"] for e in repo.events(conn, job_id) if e["event"] == "fenced"]
    assert [(m["write"], m["worker"], m["epoch"]) for m in fenced] == [("extend", "a", 1), ("complete", "a", 1),
                                                                      ("requeue", "a", 1)]
    lines = [logs.record_fields(r) for r in caplog.records if r.getMessage() == "lease_lost_write_refused"]
    assert [(line["write"], line["job_id"], line["epoch"]) for line in lines] == [
        ("extend", job_id, 1), ("complete", job_id, 1), ("requeue", job_id, 1)]
    assert events(engine, job_id).count("complete") == 1


def test_a_job_whose_worker_is_lost_every_time_fails_for_good(engine, submit, make_worker, clock, sandbox) -> None:
    """Three claims whose workers all vanished: the reclaim fails the job (UNKNOWN), dead letter and alert once;
    the first two lost leases gave their attempt back (counted in lost_leases, not as gateway attempts)."""
    job_id = submit()
    worker = make_worker()
    for _ in range(3):
        assert worker.claim() is not None
        clock.advance(3)
        worker.reclaim()
    failed = job(engine, job_id)
    assert (failed.status, failed.error_code, failed.dead_letter, failed.attempt_count) == ("failed", "UNKNOWN", True, 1)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT lost_leases FROM conversion_jobs")).scalar_one() == 3
    assert events(engine, job_id) == ["queued", "processing", "expired", "processing", "expired", "processing",
                                      "failed"]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT error_class FROM dead_letters")).scalars().all() == ["UNKNOWN"]
    assert sandbox.count("slack.message") == 1


def test_a_lease_being_written_is_not_reclaimed(engine, submit, make_worker, clock) -> None:
    """A row locked by its holder's completion is skipped by the reclaim (SKIP LOCKED), so the completion stands."""
    job_id = submit()
    worker = make_worker()
    lease = worker.claim()
    clock.advance(3)
    with engine.begin() as holder:
        holder.execute(sa.text("SELECT 1 FROM conversion_jobs WHERE id = :i FOR UPDATE"), {"i": job_id})
        assert worker.reclaim() == []
        assert repo.complete(holder, lease, f"{job_id}.xml", clock.now(), {})
    assert job(engine, job_id).status == "succeeded"


def test_a_turn_whose_commit_was_lost_counts_only_its_own_completions(engine, submit, make_worker, clock) -> None:
    """`completed_before` (a worker's turn retried after its COMMIT was lost in transit) recognises a job as done
    by *this* lease only: when another holder took the job over and already succeeded, the late lease's completion
    is not accepted as its own (issue 25: caught before only by a 41-second multi-process test)."""
    job_id = submit()
    a, b = make_worker(worker_id="a"), make_worker(worker_id="b")
    stale = a.claim()
    clock.advance(3)  # lease TTL 2 s: A looks dead
    assert [r.job_id for r in b.reclaim()] == [job_id]
    fresh = b.claim()
    assert stale is not None and fresh is not None and fresh.epoch == stale.epoch + 1
    with engine.connect() as conn:
        assert repo.completed_before(conn, [stale, fresh]) == set()  # nobody has completed it yet
    assert b._complete(fresh, b"<document sha256=\"1\"/>", 1.0, None) == "succeeded"
    with engine.connect() as conn:
        assert repo.completed_before(conn, [stale]) == set()  # B's success is not A's
        assert repo.completed_before(conn, [fresh]) == {job_id}


def test_a_worker_frozen_inside_its_turn_does_not_keep_its_jobs_locked(engine, submit, make_worker, clock) -> None:
    """A worker stopped between its turn's statement and COMMIT (SIGSTOP, a frozen VM) held its rows locked for as
    long as it was away, so the reclaim skipped them however long their leases had expired (CI: a paused worker's
    jobs never taken over). Its transaction now carries the lease as PostgreSQL's idle-in-transaction limit: the
    server ends it, the locks go, another worker takes the jobs over, and the frozen worker's COMMIT fails."""
    first, second = submit(), submit()
    a, b = make_worker(worker_id="a"), make_worker(worker_id="b")
    done, pending = a.claim(), a.claim()
    assert {done.job_id, pending.job_id} == {first, second}
    completion = repo.Completion(done, f"{done.job_id}.xml", 1.0, {"worker": "a", "epoch": done.epoch})
    cycle = a.hot.cycle([completion], 0, clock.now(), "a", clock.now())  # BEGIN; …; EXECUTE: the rows are locked
    assert cycle.completed == {done.job_id}
    clock.advance(3)  # lease TTL 2 s: both leases look expired, but A is still inside its transaction

    deadline = time.monotonic() + 60  # PostgreSQL's own timer (2 s here) ends A's transaction; real time
    taken: set[str] = set()
    while taken != {first, second} and time.monotonic() < deadline:
        taken |= {r.job_id for r in b.reclaim()}
        time.sleep(0.1)
    assert taken == {first, second}
    with pytest.raises(psycopg2.OperationalError):
        a.hot.commit()  # A wakes up: its session is gone, its completion with it
    a.hot.reset()
    for job_id in (first, second):
        after = job(engine, job_id)
        assert (after.status, after.leased_by, after.lease_epoch) == ("queued", None, 1)
        assert "complete" not in events(engine, job_id)
