"""Worker processes under real signals: SIGTERM, SIGKILL and SIGSTOP/SIGCONT against PostgreSQL and the sandbox.

Leases are 2 s here (WORKER_LEASE_TTL_SEC), so a lost worker is noticed in seconds, not minutes.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from assets.conversion import repository as repo
from redrive.clock import SystemClock
from tests.conversion.conftest import events, job, make_pdf
from tests.conversion.processes import SlowGateway, WorkerProcess, wait_for, worker_env

SANDBOX_GATEWAY = "{}/pdf/v1"


@pytest.fixture
def direct(stack) -> str:
    return SANDBOX_GATEWAY.format(os.environ["SANDBOX_URL"])


@pytest.fixture
def slow(direct: str) -> Iterator[Callable[[float], SlowGateway]]:
    made: list[SlowGateway] = []

    def build(delay: float) -> SlowGateway:
        made.append(SlowGateway(direct, delay))
        return made[-1]

    yield build
    for g in made:
        g.close()


@pytest.fixture
def spawn(db_url: str, conv_settings, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    made: list[WorkerProcess] = []

    def start(name: str, gateway_url: str, *, until_idle: float = 3.0, **knobs: object) -> WorkerProcess:
        env = worker_env(db_url, gateway_url, conv_settings.uploads_dir, conv_settings.results_dir, **knobs)
        made.append(WorkerProcess(name, env, tmp_path, until_idle=until_idle))
        return made[-1]

    yield start
    for w in made:
        w.stop()


def held_by(engine: sa.Engine, worker: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(sa.select(repo.conversion_jobs.c.id).where(
            repo.conversion_jobs.c.status == "processing", repo.conversion_jobs.c.leased_by == worker)).scalar()


def queue_real_time(engine: sa.Engine, files, n: int, owner: str = "alice") -> list[str]:
    """Jobs created on the system clock (these workers run on it), one PDF each with its own text."""
    clock = SystemClock()
    ids = []
    base = clock.now()
    rows, queued = [], []
    for i in range(n):
        body = make_pdf(f"document {i}")
        job_id = str(uuid.uuid4())
        location = files.save_source(job_id, body)
        at = base + timedelta(microseconds=i)
        rows.append({"id": job_id, "owner": owner, "filename": f"doc-{i}.pdf", "source_location": location,
                     "source_bytes": len(body), "source_sha256": hashlib.sha256(body).hexdigest(),
                     "status": "queued", "queued_at": at, "created_at": at, "updated_at": at})
        queued.append({"job_id": job_id, "event": "queued", "attempt": 0, "at": at, "meta": {"reason": "upload"}})
        ids.append(job_id)
    with engine.begin() as conn:
        conn.execute(sa.insert(repo.conversion_jobs), rows)
        conn.execute(sa.insert(repo.conversion_job_events), queued)
    return ids


def log_events(worker: WorkerProcess, name: str) -> list[dict]:
    return [e for e in worker.events() if e["event"] == name]


def test_sigterm_mid_call_finishes_the_jobs_in_flight_and_claims_nothing_more(engine, files, slow, spawn) -> None:
    """003 §3.5 with two jobs in flight: SIGTERM mid-call → both complete, the other four stay queued, exit 0."""
    ids = queue_real_time(engine, files, 6)
    gateway = slow(1.0)
    worker = spawn("w-term", gateway.url, WORKER_SHUTDOWN_GRACE_SEC=20, WORKER_CONCURRENCY=2)

    def held() -> set[str]:
        with engine.connect() as conn:
            return {str(i) for i in conn.execute(sa.select(repo.conversion_jobs.c.id).where(
                repo.conversion_jobs.c.status == "processing", repo.conversion_jobs.c.leased_by == "w-term")).scalars()}

    def two_held() -> set[str] | None:
        now_held = held()
        return now_held if len(now_held) == 2 else None

    in_flight = wait_for(two_held, 30, "the worker to hold two leases")
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert {j for j in ids if job(engine, j).status == "succeeded"} == in_flight
    rest = [job(engine, j) for j in ids if j not in in_flight]
    assert [(r.status, r.attempt_count) for r in rest] == [("queued", 0)] * 4
    stopped = log_events(worker, "worker_stopped")
    assert stopped and stopped[-1]["shutdown"] is True and stopped[-1]["succeeded"] == 2


def test_sigterm_past_the_grace_requeues_cleanly(engine, files, slow, spawn) -> None:
    """A call that outlives WORKER_SHUTDOWN_GRACE_SEC is abandoned: `queued`, lease cleared, attempt given back."""
    [only] = queue_real_time(engine, files, 1)
    gateway = slow(5.0)
    worker = spawn("w-grace", gateway.url, WORKER_SHUTDOWN_GRACE_SEC=0.3)
    wait_for(lambda: held_by(engine, "w-grace") == only, 30, "the worker to claim the job")
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    requeued = job(engine, only)
    assert (requeued.status, requeued.leased_by, requeued.lease_expires_at) == ("queued", None, None)
    assert requeued.attempt_count == 0 and requeued.lease_epoch == 1
    assert events(engine, only) == ["queued", "processing", "queued"]
    assert [e["reason"] for e in log_events(worker, "job_requeued")] == ["shutdown"]


def test_a_long_job_keeps_its_lease_and_is_not_taken_over(engine, files, slow, spawn, direct) -> None:
    """003 §5 manual test, automated: a 3.5 s call on a 2 s lease is extended, completes, and no one reclaims it."""
    [only] = queue_real_time(engine, files, 1)
    gateway = slow(3.5)
    long_runner = spawn("w-long", gateway.url)
    wait_for(lambda: held_by(engine, "w-long") == only, 30, "the worker to claim the job")
    rival = spawn("w-rival", direct)  # reclaims any expired lease it sees
    wait_for(lambda: job(engine, only).status == "succeeded", 30, "the long job to complete")
    assert long_runner.wait(30) == 0 and rival.wait(30) == 0
    assert events(engine, only) == ["queued", "processing", "complete"]
    assert len(log_events(long_runner, "lease_extended")) >= 4


def test_a_paused_worker_past_its_lease_has_its_late_completion_refused(engine, files, slow, spawn, direct,
                                                                        conv_settings) -> None:
    """SIGSTOP mid-call past the lease: another worker takes over and completes; after SIGCONT the late write is refused."""
    [only] = queue_real_time(engine, files, 1)
    gateway = slow(1.0)
    paused = spawn("w-paused", gateway.url, until_idle=30)
    wait_for(lambda: held_by(engine, "w-paused") == only, 30, "the first worker to claim the job")
    paused.signal(signal.SIGSTOP)
    taker = spawn("w-taker", direct)
    wait_for(lambda: job(engine, only).status == "succeeded", 30, "the second worker to take over and complete")
    taken = job(engine, only)
    assert taken.lease_epoch == 2
    result = (conv_settings.results_dir / taken.result_location).read_bytes()

    paused.signal(signal.SIGCONT)
    wait_for(lambda: log_events(paused, "lease_lost_write_refused"), 30, "the late write to be refused")
    wait_for(lambda: any(e["write"] == "complete" for e in log_events(paused, "lease_lost_write_refused")), 30,
             "the late completion to be refused")
    paused.signal(signal.SIGTERM)
    assert paused.wait(30) == 0 and taker.wait(30) == 0

    after = job(engine, only)
    assert (after.status, after.lease_epoch, after.result_location) == ("succeeded", 2, taken.result_location)
    assert (conv_settings.results_dir / after.result_location).read_bytes() == result
    assert sorted(p.name for p in conv_settings.results_dir.iterdir()) == [f"{only}.xml"]  # no second file, no temp
    with engine.connect() as conn:
        fenced = [e for e in repo.events(conn, only) if e["event"] == "fenced"]
    assert {e["meta"]["write"] for e in fenced} >= {"complete"}
    assert all(e["meta"]["worker"] == "w-paused" and e["meta"]["epoch"] == 1 for e in fenced)
    assert events(engine, only).count("complete") == 1


def test_four_workers_two_thousand_jobs_with_a_kill_and_a_pause(engine, files, slow, spawn, direct,
                                                                conv_settings, sandbox) -> None:
    """2,000 jobs, four processes: one SIGKILLed (its lease reclaimed by another), one SIGSTOPped past its lease
    (its late completion refused); every job ends `succeeded` with exactly one result, its own."""
    ids = queue_real_time(engine, files, 2000)
    doomed_gateway, paused_gateway = slow(0.5), slow(1.0)
    doomed = spawn("w-doomed", doomed_gateway.url)
    paused = spawn("w-paused", paused_gateway.url, until_idle=60)
    others = [spawn("w-3", direct), spawn("w-4", direct)]

    killed_job = wait_for(lambda: held_by(engine, "w-doomed"), 60, "w-doomed to hold a lease")
    doomed.signal(signal.SIGKILL)
    assert doomed.wait(10) == -signal.SIGKILL
    paused_job = wait_for(lambda: held_by(engine, "w-paused"), 60, "w-paused to hold a lease")
    paused.signal(signal.SIGSTOP)
    paused_gateway.delay = 0.0  # once resumed, it works at full speed
    wait_for(lambda: job(engine, paused_job).status == "succeeded", 60, "the paused worker's job to be taken over")
    paused.signal(signal.SIGCONT)

    def all_done() -> bool:
        with engine.connect() as conn:
            return repo.status_counts(conn) == {"succeeded": 2000}

    wait_for(all_done, 240, "all 2,000 jobs to succeed", every=0.2)
    paused.signal(signal.SIGTERM)
    for w in (paused, *others):
        assert w.wait(60) == 0

    with engine.connect() as conn:
        rows = conn.execute(sa.select(repo.conversion_jobs.c.id, repo.conversion_jobs.c.result_location,
                                      repo.conversion_jobs.c.source_sha256)).all()
        completes = conn.execute(sa.text(
            "SELECT job_id::text, count(*) FROM conversion_job_events WHERE event = 'complete' GROUP BY 1")).all()
        killed_events = repo.events(conn, killed_job)
        paused_events = repo.events(conn, paused_job)
    assert {str(r.id) for r in rows} == set(ids)
    assert sorted(n for _, n in completes) == [1] * 2000  # exactly one completion per job
    results = sorted(p.name for p in conv_settings.results_dir.iterdir())
    assert results == sorted(f"{i}.xml" for i in ids)  # exactly one result file per job, no temp files left
    for r in rows[:: 50]:  # each result is its own document's conversion
        head = (conv_settings.results_dir / r.result_location).read_text()[:200]
        assert re.search(r'sha256="([0-9a-f]+)"', head).group(1) == r.source_sha256

    expired = [e for e in killed_events if e["event"] == "expired"]
    assert expired and expired[0]["meta"]["leased_by"] == "w-doomed"  # the dead worker's lease was reclaimed
    assert [e["meta"].get("worker") for e in killed_events if e["event"] == "complete"][0] in {"w-paused", "w-3", "w-4"}
    refused = [e["meta"] for e in paused_events if e["event"] == "fenced"]
    assert any(m["write"] == "complete" and m["worker"] == "w-paused" for m in refused)
    assert any(e["write"] == "complete" for e in log_events(paused, "lease_lost_write_refused"))
    assert sandbox.count("pdf.convert") >= 2000
