"""Worker processes under real signals: SIGTERM, SIGKILL and SIGSTOP/SIGCONT against PostgreSQL and the sandbox.

Waits for a worker to claim allow 120 s: a worker process starts in seconds, but much slower on a loaded machine.

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
from tests.conversion.conftest import events, files_under, job, make_pdf
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


def held_all(engine: sa.Engine, worker: str) -> set[str]:
    with engine.connect() as conn:
        return {str(i) for i in conn.execute(sa.select(repo.conversion_jobs.c.id).where(
            repo.conversion_jobs.c.status == "processing", repo.conversion_jobs.c.leased_by == worker)).scalars()}


def holding(engine: sa.Engine, worker: str, at_least: int) -> Callable[[], set[str] | None]:
    """A wait_for predicate: the worker's leases once it holds ``at_least`` of them (several jobs in flight)."""

    def check() -> set[str] | None:
        held = held_all(engine, worker)
        return held if len(held) >= at_least else None

    return check


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

    in_flight = wait_for(two_held, 120, "the worker to hold two leases")
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
    wait_for(lambda: held_by(engine, "w-grace") == only, 120, "the worker to claim the job")
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
    wait_for(lambda: held_by(engine, "w-long") == only, 120, "the worker to claim the job")
    rival = spawn("w-rival", direct)  # reclaims any expired lease it sees
    wait_for(lambda: job(engine, only).status == "succeeded", 120, "the long job to complete")
    assert long_runner.wait(30) == 0 and rival.wait(30) == 0
    assert events(engine, only) == ["queued", "processing", "complete"]
    assert len(log_events(long_runner, "lease_extended")) >= 4


def test_a_paused_worker_past_its_lease_has_its_late_completions_refused(engine, files, slow, spawn, direct,
                                                                         conv_settings) -> None:
    """SIGSTOP with four jobs in flight, past the lease: another worker takes all four over and completes them;
    after SIGCONT each late completion is refused, and each job keeps one result, the taker's."""
    ids = queue_real_time(engine, files, 4)
    gateway = slow(1.0)
    paused = spawn("w-paused", gateway.url, until_idle=30, WORKER_CONCURRENCY=4)
    assert wait_for(holding(engine, "w-paused", 4), 120, "the first worker to hold four leases") == set(ids)
    paused.signal(signal.SIGSTOP)
    taker = spawn("w-taker", direct, WORKER_CONCURRENCY=4)
    wait_for(lambda: all(job(engine, j).status == "succeeded" for j in ids), 120,
             "the second worker to take over and complete all four")
    taken = {j: job(engine, j) for j in ids}
    assert {t.lease_epoch for t in taken.values()} == {2}
    results = {j: (conv_settings.results_dir / t.result_location).read_bytes() for j, t in taken.items()}

    paused.signal(signal.SIGCONT)

    def refused_completions() -> set[str] | None:
        done = {e["job_id"] for e in log_events(paused, "lease_lost_write_refused") if e["write"] == "complete"}
        return done if done == set(ids) else None

    wait_for(refused_completions, 30, "all four late completions to be refused")
    paused.signal(signal.SIGTERM)
    assert paused.wait(30) == 0 and taker.wait(30) == 0

    assert files_under(conv_settings.results_dir) == sorted(f"{j}.xml" for j in ids)
    for j in ids:
        after = job(engine, j)
        assert (after.status, after.lease_epoch, after.result_location) == ("succeeded", 2, taken[j].result_location)
        assert (conv_settings.results_dir / after.result_location).read_bytes() == results[j]
        with engine.connect() as conn:
            history = repo.events(conn, j)
        fenced = [e["meta"] for e in history if e["event"] == "fenced"]
        assert {m["write"] for m in fenced} >= {"complete"}
        assert all(m["worker"] == "w-paused" and m["epoch"] == 1 for m in fenced)
        assert [e["meta"]["worker"] for e in history if e["event"] == "complete"] == ["w-taker"]


def test_four_workers_two_thousand_jobs_with_a_kill_and_a_pause(engine, files, slow, spawn, direct,
                                                                conv_settings, sandbox) -> None:
    """2,000 jobs, four processes: one SIGKILLed (its lease reclaimed by another), one SIGSTOPped past its lease
    (its late completion refused); every job ends `succeeded` with exactly one result, its own."""
    ids = queue_real_time(engine, files, 2000)
    doomed_gateway, paused_gateway = slow(0.5), slow(1.0)
    doomed = spawn("w-doomed", doomed_gateway.url, WORKER_CONCURRENCY=4)
    paused = spawn("w-paused", paused_gateway.url, until_idle=60, WORKER_CONCURRENCY=4)
    others = [spawn("w-3", direct, WORKER_CONCURRENCY=4), spawn("w-4", direct, WORKER_CONCURRENCY=4)]

    killed_jobs = wait_for(holding(engine, "w-doomed", 3), 180, "w-doomed to hold several leases")
    doomed.signal(signal.SIGKILL)
    assert doomed.wait(10) == -signal.SIGKILL
    paused_jobs = wait_for(holding(engine, "w-paused", 3), 180, "w-paused to hold several leases")
    paused.signal(signal.SIGSTOP)
    paused_gateway.delay = 0.0  # once resumed, it works at full speed
    wait_for(lambda: all(job(engine, j).status == "succeeded" for j in paused_jobs), 60,
             "the paused worker's jobs to be taken over")
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
        killed_events = {j: repo.events(conn, j) for j in killed_jobs}
        paused_events = {j: repo.events(conn, j) for j in paused_jobs}
    assert {str(r.id) for r in rows} == set(ids)
    assert sorted(n for _, n in completes) == [1] * 2000  # exactly one completion per job
    results = files_under(conv_settings.results_dir)
    assert results == sorted(f"{i}.xml" for i in ids)  # exactly one result file per job, no temp files left
    for r in rows[:: 50]:  # each result is its own document's conversion
        head = (conv_settings.results_dir / r.result_location).read_text()[:200]
        assert re.search(r'sha256="([0-9a-f]+)"', head).group(1) == r.source_sha256

    for history in killed_events.values():  # every lease the dead worker held was reclaimed, its job done by another
        expired = [e for e in history if e["event"] == "expired"]
        assert expired and expired[0]["meta"]["leased_by"] == "w-doomed"
        assert [e["meta"].get("worker") for e in history if e["event"] == "complete"][0] in {"w-paused", "w-3", "w-4"}
    for history in paused_events.values():  # every job paused past its lease: taken over, the late write refused
        refused = [e["meta"] for e in history if e["event"] == "fenced"]
        assert refused and all(m["worker"] == "w-paused" for m in refused)
        assert [e["meta"].get("worker") for e in history if e["event"] == "complete"] in (["w-3"], ["w-4"])
    late = {e["job_id"] for e in log_events(paused, "lease_lost_write_refused") if e["write"] == "complete"}
    assert late == paused_jobs
    assert sandbox.count("pdf.convert") >= 2000


@pytest.fixture
def cut_role(engine: sa.Engine) -> Iterator[str]:
    """A login role of its own for one worker, so a test can refuse it new connections (NOLOGIN) and end its
    backends — a worker cut off from PostgreSQL while the rest of the system is not."""
    role = f"conv_cut_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD 'cut'"))
        conn.execute(sa.text(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}"))
        conn.execute(sa.text(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}"))
    yield role
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :r"), {"r": role})
        conn.execute(sa.text(f"DROP OWNED BY {role}"))
        conn.execute(sa.text(f"DROP ROLE {role}"))


def as_client(db_url: str, name: str, role: str | None = None) -> str:
    """The test database's URL with an application_name (to find the backends) and, optionally, another role."""
    url = sa.engine.make_url(db_url)
    url = url.update_query_dict({"application_name": name})
    if role is not None:
        url = url.set(username=role, password="cut")
    return url.render_as_string(hide_password=False)


def terminate_backends(engine: sa.Engine, *names: str) -> int:
    with engine.connect() as conn:
        return len(conn.execute(sa.text(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = ANY(:names)"),
            {"names": list(names)}).all())


def test_backends_terminated_mid_run_lose_nothing_and_refuse_late_completions(
        engine, files, slow, spawn, conv_settings, sandbox, db_url, cut_role) -> None:
    """pg_terminate_backend on two workers with four jobs in flight each. w-steady reconnects at once and completes
    its own four; w-cut may not log in again until its leases expired and w-steady finished its four too, so its
    late completions are refused. 8 jobs: 0 lost, one completion and one result file each, 12 conversions."""
    cut_gateway, steady_gateway = slow(0.2), slow(0.2)
    cut_gateway.gate.clear()  # the calls are held until both workers are cut off, whatever their start-up takes
    steady_gateway.gate.clear()
    ids = queue_real_time(engine, files, 4)
    held_calls = {"WORKER_CONCURRENCY": 4, "GATEWAY_TIMEOUT_MS": 300_000}  # a held call is slow, not timed out
    cut = spawn("w-cut", cut_gateway.url, until_idle=60, DATABASE_URL=as_client(db_url, "w-cut", cut_role),
                **held_calls)
    cut_jobs = wait_for(holding(engine, "w-cut", 4), 120, "w-cut to hold four leases")
    ids += queue_real_time(engine, files, 4)
    steady = spawn("w-steady", steady_gateway.url, until_idle=60, DATABASE_URL=as_client(db_url, "w-steady"),
                   **held_calls)
    steady_jobs = wait_for(holding(engine, "w-steady", 4), 120, "w-steady to hold four leases")
    assert cut_jobs | steady_jobs == set(ids)

    with engine.begin() as conn:
        conn.execute(sa.text(f"ALTER ROLE {cut_role} NOLOGIN"))
    assert terminate_backends(engine, "w-cut", "w-steady") >= 2  # mid-call: every job of both is in flight
    cut_gateway.gate.set()
    steady_gateway.gate.set()

    def all_succeeded() -> bool:
        with engine.connect() as conn:
            return repo.status_counts(conn) == {"succeeded": 8}

    wait_for(all_succeeded, 60, "w-steady to complete its own jobs and take over w-cut's")
    with engine.begin() as conn:
        conn.execute(sa.text(f"ALTER ROLE {cut_role} LOGIN"))

    def refused() -> set[str] | None:
        late = {e["job_id"] for e in log_events(cut, "lease_lost_write_refused") if e["write"] == "complete"}
        return late if late == cut_jobs else None

    wait_for(refused, 60, "w-cut's four late completions to be refused")
    for w in (cut, steady):
        w.signal(signal.SIGTERM)
        assert w.wait(30) == 0

    with engine.connect() as conn:
        history = {j: repo.events(conn, j) for j in ids}
        rows = conn.execute(sa.select(repo.conversion_jobs.c.id, repo.conversion_jobs.c.result_location,
                                      repo.conversion_jobs.c.source_sha256)).all()
    for j in ids:  # one completion each, by w-steady: its own under its first lease, w-cut's after the reclaim
        done = [e["meta"] for e in history[j] if e["event"] == "complete"]
        assert [(m["worker"], m["epoch"]) for m in done] == [("w-steady", 1 if j in steady_jobs else 2)]
    for j in cut_jobs:
        assert [e["meta"]["leased_by"] for e in history[j] if e["event"] == "expired"] == ["w-cut"]
        fenced = [e["meta"] for e in history[j] if e["event"] == "fenced"]
        assert "complete" in {m["write"] for m in fenced} and all(m["worker"] == "w-cut" for m in fenced)
    assert files_under(conv_settings.results_dir) == sorted(f"{j}.xml" for j in ids)
    for r in rows:  # each result is its own document's conversion, written once
        head = (conv_settings.results_dir / r.result_location).read_text()[:200]
        assert re.search(r'sha256="([0-9a-f]+)"', head).group(1) == r.source_sha256
    assert sandbox.count("pdf.convert") == 12  # w-cut's four were converted twice, their results written once
    for w in (cut, steady):  # both lost their connections and waited the database out
        assert log_events(w, "worker_stopped")[-1]["db_errors"] >= 1
