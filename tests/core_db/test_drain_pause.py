"""Issue 26 §2 for the core drain: paused or cut off from its database past its leases, a run writes what its
entities finished (the epoch decides) and never takes back its own in-flight work."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from devstack.postgres import with_database
from redrive import work
from redrive.backoff import FixedSchedule
from redrive.clock import FrozenClock
from redrive.drain import Attempt, Drain, WorkItem
from redrive.reliability import Reliability
from redrive.schema import work_items
from redrive.stages import StagePolicy

START = datetime(2026, 11, 26, 9, 0, tzinfo=UTC)
POLICIES = {"send": StagePolicy(max_attempts=3, backoff=FixedSchedule((30.0,)))}


class Watched(Drain):
    """Signals each claim statement (the moment a run could take back its own expired rows)."""

    claims: threading.Semaphore

    def _claim(self, limit: int, group_key: str | None, held: list[WorkItem] | None = None) -> list[WorkItem]:
        found = super()._claim(limit, group_key, held)
        self.claims.release()
        return found


def _setup(engine: sa.Engine, clock: FrozenClock, n: int) -> Watched:
    with engine.begin() as conn:
        for i in range(n):
            work.enqueue(conn, "demo", f"e-{i}", now=clock.now())
    drain = Watched(reliability=Reliability(engine=engine, clock=clock), pipeline="demo", policies=POLICIES,
                    owner="run-a", concurrency=8, linger_seconds=0, lease_seconds=60, sleep=clock.sleep)
    drain.claims = threading.Semaphore(0)
    return drain


def _held_until(release: threading.Event, started: threading.Semaphore, calls: list[str]):  # type: ignore[no-untyped-def]
    """A handler whose entities start, say so, and finish their one stage only once `release` is set."""

    def handle(attempt: Attempt) -> None:
        calls.append(attempt.entity_ref)
        started.release()
        assert release.wait(20)
        attempt.stage("send", lambda: {"sent": True})

    return handle


def _held_as_tasks(release: threading.Event, started: threading.Semaphore, calls: list[str]):  # type: ignore[no-untyped-def]
    """The same as coroutines: each entity a task of the run's loop (the engine's other kind of handler)."""

    async def handle(attempt: Attempt) -> None:
        calls.append(attempt.entity_ref)
        started.release()
        while not release.is_set():
            await asyncio.sleep(0.01)

        async def send() -> dict[str, bool]:
            return {"sent": True}

        await attempt.astage("send", send)

    return handle


def _rows(engine: sa.Engine) -> dict[str, tuple[str, dict[str, int]]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(work_items.c.entity_ref, work_items.c.status, work_items.c.attempts)).all()
    return {r.entity_ref: (r.status, dict(r.attempts)) for r in rows}


@pytest.mark.parametrize("held", [_held_until, _held_as_tasks], ids=["threads", "coroutines"])
def test_a_run_paused_past_its_leases_does_not_reclaim_its_own_work(engine: sa.Engine, held) -> None:  # type: ignore[no-untyped-def]
    """4 entities in flight; the clock jumps 2 leases ahead (a paused process); the run's next claim leaves
    its own rows alone, so each entity is worked once and ends done with no lost lease."""
    clock = FrozenClock(START)
    drain = _setup(engine, clock, 4)
    release, started = threading.Event(), threading.Semaphore(0)
    calls: list[str] = []
    handle = held(release, started, calls)

    result: list = []
    runner = threading.Thread(target=lambda: result.append(drain.run(handle)))
    runner.start()
    for _ in range(4):
        assert started.acquire(timeout=20)
    assert drain.claims.acquire(timeout=20)  # the claim that started them
    clock.advance(120)  # paused: every lease ran out
    assert drain.claims.acquire(timeout=20)  # the next claim, after the pause
    release.set()
    runner.join(30)
    report = result[0]
    assert sorted(calls) == [f"e-{i}" for i in range(4)]  # none worked twice
    assert (report.done, report.lease_lost) == (4, 0)
    assert {status for status, _ in _rows(engine).values()} == {"done"}


@pytest.mark.parametrize("held", [_held_until, _held_as_tasks], ids=["threads", "coroutines"])
def test_a_database_outage_longer_than_the_lease_records_every_finished_entity(engine: sa.Engine, db_url: str,
                                                                               admin_url: str, held) -> None:  # type: ignore[no-untyped-def]
    """The database goes away while 3 entities are working and stays away past their leases: each one's
    success is written once it is back (no attempt spent, nothing failed, nothing worked twice)."""
    clock = FrozenClock(START)
    drain = _setup(engine, clock, 3)
    drain.outage_sleep = lambda s: threading.Event().wait(min(s, 0.05))
    release, started = threading.Event(), threading.Semaphore(0)
    calls: list[str] = []
    handle = held(release, started, calls)

    name = db_url.rsplit("/", 1)[1].split("?")[0]
    admin = sa.create_engine(with_database(admin_url, "postgres"), isolation_level="AUTOCOMMIT")
    result: list = []
    runner = threading.Thread(target=lambda: result.append(drain.run(handle)))
    runner.start()
    try:
        for _ in range(3):
            assert started.acquire(timeout=20)
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"),
                         {"d": name})
        release.set()  # they finish while the database is away
        threading.Event().wait(0.5)
        clock.advance(120)  # the outage outlasts the leases
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        admin.dispose()
    runner.join(60)
    report = result[0]
    assert sorted(calls) == ["e-0", "e-1", "e-2"]
    assert (report.done, report.lease_lost, report.retried, report.dead_lettered) == (3, 0, 0, 0)
    assert _rows(engine) == {f"e-{i}": ("done", {"send": 1}) for i in range(3)}
