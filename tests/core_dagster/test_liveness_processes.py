"""A real run worker process dies where it cannot report (issue 25): the watchdog fails its run within its window,
the next drain settles every entity once. One short process per test; the watchdog's clock is injected."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import dagster as dg
import pytest
import sqlalchemy as sa

from redrive import liveness, work
from redrive.backoff import FixedSchedule
from redrive.clock import FrozenClock
from redrive.drain import Attempt, Drain
from redrive.reliability import Reliability
from redrive.schema import work_items
from redrive.stages import StagePolicy
from sensors.core import fail_silent_runs

N = 12
DEAD_AFTER = 90.0

WORKER = """
import sys, time
from datetime import UTC, datetime
from redrive import liveness, work
from redrive.db import engine_for
url, run_id = sys.argv[1], sys.argv[2]
engine = engine_for(url)
liveness.start_for_run(engine, run_id, interval=0.2, now=lambda: datetime.now(UTC))
with engine.begin() as conn:
    items = work.claim(conn, "demo", owner=liveness.holder_of(run_id), limit=100, lease_seconds=3600,
                       now=datetime.now(UTC))
print("claimed", len(items), flush=True)
while True:  # reporting: extending its leases as fast as it can, until it is killed
    try:
        with engine.begin() as conn:
            work.extend(conn, items, lease_seconds=3600, now=datetime.now(UTC))
    except Exception:
        pass
    time.sleep(0.02)
"""


class SocketProxy:
    """PostgreSQL's Unix socket as the worker sees it, through a proxy we can pull: `down()` closes every
    connection and stops listening, which is PostgreSQL gone from the worker's side (the suite's server stays up)."""

    def __init__(self, target: str | tuple[str, int], folder: Path, port: int) -> None:
        self.target, self.path = target, folder / f".s.PGSQL.{port}"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.path))
        self.server.listen(64)
        self.conns: list[socket.socket] = []
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            family = socket.AF_UNIX if isinstance(self.target, str) else socket.AF_INET
            upstream = socket.socket(family, socket.SOCK_STREAM)
            upstream.connect(self.target)
            self.conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self.stopped.is_set():
                ready, _, _ = select.select([a, b], [], [], 0.1)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except OSError:
            return

    def down(self) -> None:
        self.stopped.set()
        self.server.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


def with_query(url: str, **params: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()} | params
    return urlunsplit(parts._replace(query=urlencode(query)))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A folder with a short path (a Unix socket path is limited to ~100 bytes)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rl-", dir="/tmp") as d:
        yield Path(d)


def start_worker(url: str, run_id: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, url, run_id], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2], env={**os.environ})
    assert proc.stdout is not None and proc.stdout.readline().strip() == f"claimed {N}"
    return proc


def wait_for_beat(engine: sa.Engine, run_id: str) -> None:
    for _ in range(200):
        with engine.connect() as conn:
            if liveness.last_beats(conn, [run_id]):
                return
        time.sleep(0.05)  # the worker's first beat, from its own process; not a timing assertion
    raise AssertionError("the worker never beat")


@pytest.mark.parametrize("how", ["postgres_down", "backends_terminated"])
def test_a_worker_killed_where_it_cannot_report_is_failed_in_the_window_and_the_next_run_settles_all(
        how, defs, instance, engine, db_url, short_tmp) -> None:
    """SIGKILLed while PostgreSQL is unreachable from it, or while its backends are being terminated as it
    reports: its run stays STARTED (nobody could record the failure) until the watchdog, inside its window, fails
    it and gives its leases back; the next drain run settles every entity: 0 lost, 0 duplicate effects."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE test_effects (entity_ref text NOT NULL, holder text NOT NULL)"))
        for i in range(N):
            work.enqueue(conn, "demo", f"p-{i}", now=datetime.now(UTC))
    job = defs.resolve_job_def("criticizer_job")
    run = instance.create_run_for_job(job_def=job, tags=job.tags, status=dg.DagsterRunStatus.STARTED)

    if how == "postgres_down":
        parts = urlsplit(db_url)
        port, host = parts.port or 5432, parse_qs(parts.query).get("host", [None])[0]
        # the embedded server's Unix socket, or the server's TCP address (CI's second pass: DATABASE_URL)
        target = str(Path(host) / f".s.PGSQL.{port}") if host else (parts.hostname or "127.0.0.1", port)
        proxy = SocketProxy(target, short_tmp, port)
        worker = start_worker(with_query(db_url, host=str(short_tmp)), run.run_id)
        wait_for_beat(engine, run.run_id)
        proxy.down()  # PostgreSQL is gone from where the worker stands
        time.sleep(0.3)  # let it try (and fail) to beat and report; not a timing assertion
        worker.send_signal(signal.SIGKILL)
    else:
        name = f"lv-{run.run_id[:8]}"
        worker = start_worker(with_query(db_url, application_name=name), run.run_id)
        wait_for_beat(engine, run.run_id)
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n"),
                         {"n": name})
        worker.send_signal(signal.SIGKILL)  # as it reports, on a fresh connection or none
    worker.wait(10)

    clock = FrozenClock(datetime.now(UTC))
    rt = Reliability(engine=engine, clock=clock)
    clock.advance(DEAD_AFTER - 30)
    assert fail_silent_runs(rt, instance, dead_after=DEAD_AFTER) == []  # inside the window: still STARTED
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
    with engine.connect() as conn:
        assert work.backlog(conn, "demo", clock.now()).leased == N  # its leases would hold for an hour
    clock.advance(31)
    assert [s.run_id for s in fail_silent_runs(rt, instance, dead_after=DEAD_AFTER)] == [run.run_id]
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE

    def handle(attempt: Attempt) -> None:
        attempt.on_success.append(lambda conn: conn.execute(
            sa.text("INSERT INTO test_effects VALUES (:e, 'next')"), {"e": attempt.entity_ref}))

    report = Drain(reliability=rt, pipeline="demo", policies={"work": StagePolicy(3, FixedSchedule((1.0,)))},
                   owner="run:next", run_id="next", sleep=clock.sleep, concurrency=4, linger_seconds=0).run(handle)
    assert report.done == N
    with engine.connect() as conn:
        statuses = dict(conn.execute(sa.select(work_items.c.entity_ref, work_items.c.status)).all())
        effects = conn.execute(sa.text("SELECT entity_ref, count(*) FROM test_effects GROUP BY 1")).all()
    assert statuses == {f"p-{i}": "done" for i in range(N)}  # 0 lost
    assert sorted(effects) == sorted((f"p-{i}", 1) for i in range(N))  # 0 duplicate effects
