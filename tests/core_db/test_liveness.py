"""Liveness (issue 25): heartbeats, the fence on a run declared dead, the drain under it — on real PostgreSQL."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from redrive import liveness, work
from redrive.backoff import FixedSchedule
from redrive.clock import FrozenClock
from redrive.drain import Attempt, Drain
from redrive.reliability import Reliability
from redrive.schema import work_items
from redrive.stages import StagePolicy

START = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
POLICIES = {"work": StagePolicy(max_attempts=3, backoff=FixedSchedule((30.0,)))}


def effects_table(engine: sa.Engine) -> None:
    """The receiving end of a pipeline's own completion write (what a duplicate would show twice)."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE test_effects (entity_ref text NOT NULL, holder text NOT NULL)"))


def effects(engine: sa.Engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT entity_ref, holder FROM test_effects ORDER BY 1, 2"))]


def record_effect(attempt: Attempt, holder: str) -> None:
    attempt.on_success.append(lambda conn: conn.execute(
        sa.text("INSERT INTO test_effects VALUES (:e, :h)"), {"e": attempt.entity_ref, "h": holder}))


def drain(engine: sa.Engine, clock: FrozenClock, run_id: str, **kw) -> Drain:
    kw = {"concurrency": 2, "batch_size": 10, "linger_seconds": 0, **kw}
    return Drain(reliability=Reliability(engine=engine, clock=clock), pipeline="demo", policies=POLICIES,
                 owner=liveness.holder_of(run_id), run_id=run_id, sleep=clock.sleep, **kw)


class BlockedRun:
    """Run A's drain in a thread, its handler stuck inside its work (one long call, a cut-off worker) until
    `finish`; it has recorded its own completion write by then."""

    def __init__(self, d: Drain) -> None:
        self.inside, self.release, self.result = threading.Event(), threading.Event(), {}

        def slow(attempt: Attempt) -> None:
            record_effect(attempt, "A")
            self.inside.set()
            assert self.release.wait(10)

        self.thread = threading.Thread(target=lambda: self.result.update(report=d.run(slow)))
        self.thread.start()
        assert self.inside.wait(10)

    def finish(self):
        self.release.set()
        self.thread.join(10)
        return self.result["report"]


def statuses(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(work_items.c.entity_ref, work_items.c.status)).all())


@pytest.mark.parametrize(("last", "started", "db_up", "advance", "silent"), [
    (0, 0, None, 91, True),  # silent past the window
    (60, 0, None, 91, False),  # beat a minute in: counts from the beat
    (0, 50, None, 91, True),  # a beat proves the start: silence counts from it
    (None, 0, None, 89, False),  # never beat, inside the window from its start
    (None, 0, None, 91, True),  # never beat at all (killed before its first beat)
    (0, 0, 30, 91, False),  # the database restarted 30 s in: the window starts again then
    (0, 0, 30, 125, True),
    (0, 0, 10_000, 91, True),  # a database start "in the future" (a test clock behind the server) is ignored
])
def test_a_run_is_silent_only_after_a_full_window_it_could_have_beaten_in(last, started, db_up, advance,
                                                                          silent) -> None:
    """Silence counts from the latest of the last beat, the run's start and the database's start."""
    at = lambda s: START + timedelta(seconds=s)  # noqa: E731
    assert liveness.is_silent(last_beat=None if last is None else at(last), started=at(started),
                              database_up_since=None if db_up is None else at(db_up), now=at(advance),
                              dead_after=90) is silent


def test_a_dead_holder_can_neither_claim_extend_nor_settle_and_its_rows_come_back_due(engine) -> None:
    """Declared dead, a run's leases are given back due now in the same transaction, and every later write
    of it — a claim, an extension, a completion, a retry, a burial — is refused."""
    clock = FrozenClock(START)
    with engine.begin() as conn:
        for i in range(3):
            work.enqueue(conn, "demo", f"e-{i}", now=clock.now())
        held = work.claim(conn, "demo", owner="run:A", limit=2, lease_seconds=60, now=clock.now())
        assert liveness.beat(conn, "run:A", "A", now=clock.now())
    with engine.begin() as conn:
        released = liveness.declare_dead(conn, "A", reason="test", now=clock.now(),
                                         release=lambda c, h, at: work.release_owner(c, h, now=at))
    assert released == 2
    with engine.begin() as conn:
        assert liveness.declare_dead(conn, "A", reason="again", now=clock.now(),
                                     release=lambda c, h, at: 0) is None  # once
        assert not liveness.beat(conn, "run:A", "A", now=clock.now())  # its heartbeat learns it is dead
        assert work.claim(conn, "demo", owner="run:A", limit=10, lease_seconds=60, now=clock.now()) == []
    assert statuses(engine) == {"e-0": "due", "e-1": "due", "e-2": "due"}

    # even a row still leased under its name (a claim that raced the verdict) cannot be settled by it
    with engine.begin() as conn:
        conn.execute(sa.update(work_items).where(work_items.c.entity_ref == "e-0").values(
            status="leased", lease_owner="run:A", lease_epoch=held[0].lease_epoch))
    with engine.begin() as conn:
        assert work.extend(conn, held, lease_seconds=60, now=clock.now()) == 0
        assert not work.complete(conn, held[0], now=clock.now())
        assert not work.reschedule(conn, held[0], due_at=clock.now(), stage="work", attempts={}, error="x",
                                   now=clock.now())
        assert not work.bury(conn, held[0], stage="work", attempts={}, error="x", now=clock.now())
    with engine.begin() as conn:  # a living holder is not fenced
        b = work.claim(conn, "demo", owner="run:B", limit=10, lease_seconds=60, now=clock.now() + timedelta(61))
        assert {i.entity_ref for i in b} == {"e-0", "e-1", "e-2"}
        assert all(work.complete(conn, i, now=clock.now()) for i in b)


def test_a_run_declared_dead_mid_work_writes_nothing_and_the_next_run_settles_each_entity_once(engine) -> None:
    """Run A is stuck inside its handler (a worker cut off) when the watchdog fences it: its completions are
    refused and roll back its own writes; run B works every entity; one effect each, none lost."""
    clock = FrozenClock(START)
    effects_table(engine)
    with engine.begin() as conn:
        for i in range(4):
            work.enqueue(conn, "demo", f"e-{i}", now=clock.now())
    a = BlockedRun(drain(engine, clock, "A", max_items=2))
    with engine.begin() as conn:
        assert liveness.declare_dead(conn, "A", reason="test", now=clock.now(),
                                     release=lambda c, h, at: work.release_owner(c, h, now=at)) == 2
    report_b = drain(engine, clock, "B").run(lambda attempt: record_effect(attempt, "B"))
    report_a = a.finish()
    assert report_a.lease_lost == 2 and report_a.done == 0
    assert report_b.done == 4
    assert effects(engine) == [(f"e-{i}", "B") for i in range(4)]
    assert set(statuses(engine).values()) == {"done"}


def test_a_completion_refused_after_a_takeover_rolls_back_the_pipelines_own_write(engine) -> None:
    """Run A's lease lapsed and run B took the entity over and finished it; when A's slow handler returns,
    its completion is refused and its own write (the entity's `done` state, an outbox row) does not commit."""
    clock = FrozenClock(START)
    effects_table(engine)
    with engine.begin() as conn:
        work.enqueue(conn, "demo", "e-0", now=clock.now())
    a = BlockedRun(drain(engine, clock, "A", lease_seconds=60))
    clock.advance(61)  # A's lease lapses (its extensions did not land)
    report_b = drain(engine, clock, "B").run(lambda attempt: record_effect(attempt, "B"))
    report_a = a.finish()
    assert report_b.done == 1
    assert report_a.lease_lost == 1 and report_a.done == 0
    assert effects(engine) == [("e-0", "B")]


def test_a_slow_run_that_keeps_beating_is_never_silent(engine) -> None:
    """A run inside one long call still beats from its own thread: after ten minutes of work it is not silent,
    and its settlement then goes through."""
    clock = FrozenClock(START)
    with engine.begin() as conn:
        work.enqueue(conn, "demo", "e-0", now=clock.now())
        held = work.claim(conn, "demo", owner="run:S", limit=1, lease_seconds=60, now=clock.now())
    hb = liveness.Heartbeat(engine, "S", now=clock.now)
    for _ in range(60):  # ten minutes of one call, a beat every 10 s (and the drain extends its lease)
        clock.advance(10)
        assert hb.beat_once()
        with engine.begin() as conn:
            work.extend(conn, held, lease_seconds=60, now=clock.now())
        with engine.connect() as conn:
            assert liveness.silent_runs(conn, {"S": START}, now=clock.now(), dead_after=90) == []
    with engine.begin() as conn:
        assert work.complete(conn, held[0], now=clock.now())
    assert not hb.fenced.is_set()


def test_the_heartbeat_thread_beats_until_stopped_and_learns_it_was_fenced(engine) -> None:
    """The run worker's heartbeat is a thread of its own; once the run is declared dead it sets `fenced`."""
    clock = FrozenClock(START)
    hb = liveness.start_for_run(engine, "T", interval=0.01, now=clock.now)
    told: list[str] = []
    assert liveness.when_fenced("T", lambda: told.append("stop claiming"))
    assert not liveness.when_fenced("not-here", lambda: None)
    try:
        deadline = threading.Event()
        for _ in range(500):
            with engine.connect() as conn:
                if liveness.last_beats(conn, ["T"]):
                    break
            deadline.wait(0.01)
        with engine.begin() as conn:
            liveness.declare_dead(conn, "T", reason="test", now=clock.now(), release=lambda c, h, at: 0)
        assert hb.fenced.wait(5)
        assert liveness.fenced("T") and told == ["stop claiming"]
    finally:
        liveness.stop_for_run("T")
    assert not liveness.fenced("T")
