"""The core's drain: claim due rows, work them, settle each one (done, due again, dead) — on real PostgreSQL."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import sqlalchemy as sa

from redrive import checkpoints, deadletters, work
from redrive.backoff import FixedSchedule
from redrive.clock import FrozenClock
from redrive.db import POOL_CONNECTIONS
from redrive.drain import Attempt, Drain
from redrive.failures import Code, Failure, PermanentError
from redrive.reliability import Reliability
from redrive.schema import stage_checkpoints, work_items
from redrive.stages import StagePolicy

START = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
POLICY = StagePolicy(max_attempts=3, backoff=FixedSchedule((30.0, 120.0)))
POLICIES = {"fetch": POLICY, "send": POLICY}


def runtime(engine: sa.Engine, clock: FrozenClock) -> Reliability:
    return Reliability(engine=engine, clock=clock)


def enqueue(engine: sa.Engine, n: int, clock: FrozenClock, *, pipeline: str = "demo", group: str | None = None) -> None:
    with engine.begin() as conn:
        for i in range(n):
            work.enqueue(conn, pipeline, f"e-{i}", now=clock.now(), group_key=group)


def drain(engine: sa.Engine, clock: FrozenClock, **kw) -> Drain:
    kw = {"concurrency": 4, "batch_size": 10, "linger_seconds": 0, **kw}
    return Drain(reliability=runtime(engine, clock), pipeline="demo", policies=POLICIES, owner="test",
                 sleep=clock.sleep, **kw)


def statuses(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(work_items.c.entity_ref, work_items.c.status)).all())


def test_every_due_entity_is_worked_once_in_batches(engine) -> None:
    """120 due entities are claimed in batches and each handler runs once; every row ends done."""
    clock = FrozenClock(START)
    enqueue(engine, 120, clock)
    seen: list[str] = []
    lock = threading.Lock()

    def handle(attempt: Attempt) -> None:
        attempt.stage("fetch", lambda: {"ok": True})
        with lock:
            seen.append(attempt.entity_ref)

    report = drain(engine, clock).run(handle)
    assert sorted(seen) == sorted(f"e-{i}" for i in range(120))
    assert report.done == 120 and report.claimed == 120 and report.batches >= 12
    assert set(statuses(engine).values()) == {"done"}


def test_a_drain_at_eight_in_flight_keeps_its_connections_instead_of_opening_one_per_entity(engine) -> None:
    """80 entities, 8 at once, each as an evidence row: a connection held for its row lock until all 8 hold one (a
    barrier), and a second one beside it for a commit. Every connection is one the pool kept, so the run's server
    backends are at most the pool's cap. With 8 kept and the rest as overflow, the commits' connections were closed
    at every return and opened again: 40 to 50 backends (issue 26)."""
    clock = FrozenClock(START)
    enqueue(engine, 80, clock)
    together = threading.Barrier(8, timeout=30)
    backends: set[int] = set()
    lock = threading.Lock()

    def handle(attempt: Attempt) -> None:
        with engine.connect() as held:
            pids = [held.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()]
            together.wait()  # all 8 in flight hold a connection at once
            with engine.begin() as beside:
                pids.append(beside.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        with lock:
            backends.update(pids)
        attempt.stage("fetch", lambda: {"ok": True})

    report = drain(engine, clock, concurrency=8).run(handle)
    assert report.done == 80
    assert 9 <= len(backends) <= POOL_CONNECTIONS


def test_enqueue_is_idempotent_and_a_rerun_reopens_only_finished_work(engine) -> None:
    """The same entity enqueued twice is one row; `reopen` starts done work again, never an open row twice."""
    clock = FrozenClock(START)
    with engine.begin() as conn:
        assert work.enqueue(conn, "demo", "x", now=clock.now())
        assert not work.enqueue(conn, "demo", "x", now=clock.now())
        assert not work.enqueue(conn, "demo", "x", now=clock.now(), reopen=True)  # still open
    drain(engine, clock).run(lambda a: None)
    with engine.begin() as conn:
        assert work.enqueue(conn, "demo", "x", now=clock.now(), reopen=True)
    assert statuses(engine) == {"x": "due"}


def test_transient_failure_makes_the_row_due_after_the_backoff(engine) -> None:
    """A 503 is not retried by sleeping: the row falls due 30 s later (the policy), then succeeds."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)
    calls = []

    def handle(attempt: Attempt) -> None:
        def send() -> dict:
            calls.append(clock.now())
            if len(calls) == 1:
                raise httpx.HTTPStatusError("503", request=httpx.Request("POST", "http://x"),
                                            response=httpx.Response(503))
            return {"sent": True}
        attempt.stage("send", send)

    first = drain(engine, clock).run(handle)
    assert (first.retried, first.done) == (1, 0)
    with engine.connect() as conn:
        row = conn.execute(sa.select(work_items)).one()
    assert row.status == "due" and row.due_at == START + timedelta(seconds=30)
    assert row.attempts == {"send": 1} and row.last_error.startswith("send attempt 1/3 of e-0")
    assert drain(engine, clock).run(handle).claimed == 0  # not due yet
    clock.advance(30)
    second = drain(engine, clock).run(handle)
    assert second.done == 1 and len(calls) == 2
    with engine.connect() as conn:
        assert conn.execute(sa.select(work_items.c.attempts)).scalar_one() == {"send": 2}


def test_linger_works_a_retry_falling_due_soon_in_the_same_run(engine) -> None:
    """A retry due within the linger window is worked by the same run (one run, not two)."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)
    calls = []

    def handle(attempt: Attempt) -> None:
        def send() -> dict:
            calls.append(1)
            if len(calls) == 1:
                raise TimeoutError("read timed out")
            return {}
        attempt.stage("send", send)

    report = drain(engine, clock, linger_seconds=60).run(handle)
    assert (report.retried, report.done) == (1, 1)
    assert clock.sleeps and clock.sleeps[0] == pytest.approx(30)


def test_permanent_failure_is_dead_lettered_with_the_entity_state_in_one_transaction(engine) -> None:
    """A permanent failure: the row is dead, one dead letter, and the handler's own `failed` write commits with it."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE demo_entities (ref text primary key, status text)"))
        conn.execute(sa.text("INSERT INTO demo_entities VALUES ('e-0', 'processing')"))

    def handle(attempt: Attempt) -> None:
        attempt.tenant = "acme"
        attempt.on_failure.append(lambda conn, failure, final: final and conn.execute(
            sa.text("UPDATE demo_entities SET status = :s WHERE ref = 'e-0'"), {"s": f"failed:{failure.code}"}))
        attempt.stage("fetch", lambda: {"bytes": 1})
        attempt.stage("send", lambda: (_ for _ in ()).throw(PermanentError(Failure.of(Code.AUTH_DENIED))))

    report = drain(engine, clock).run(handle)
    assert report.dead_lettered == 1
    with engine.connect() as conn:
        letters = deadletters.list_(conn)
        status = conn.execute(sa.text("SELECT status FROM demo_entities")).scalar_one()
    assert status == "failed:AUTH_DENIED"
    assert [(d.entity_ref, d.stage, d.error_class, d.tenant) for d in letters] == [("e-0", "send", "AUTH_DENIED", "acme")]
    assert letters[0].stage_attempts == {"fetch": 1, "send": 1}
    assert statuses(engine) == {"e-0": "dead"}


def test_failed_settlement_write_rolls_back_the_dead_letter(engine) -> None:
    """If the entity's own `failed` write fails, no dead letter is left without it: the row stays leased and
    falls due again when its lease ends (all or nothing)."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)

    def broken_write(conn, failure, final) -> None:
        if final:
            conn.execute(sa.text("SELECT * FROM no_such_table"))

    def handle(attempt: Attempt) -> None:
        attempt.on_failure.append(broken_write)
        attempt.stage("send", lambda: (_ for _ in ()).throw(PermanentError(Failure.of(Code.AUTH_DENIED))))

    report = drain(engine, clock, lease_seconds=60).run(handle)
    assert report.dead_lettered == 0 and report.errors == {"unsettled": 1}
    with engine.connect() as conn:
        assert deadletters.list_(conn) == []
        row = conn.execute(sa.select(work_items)).one()
    assert row.status == "leased" and row.due_at == START + timedelta(seconds=60)


def test_budget_is_per_stage_and_exhaustion_dead_letters(engine) -> None:
    """Three timeouts of `send` spend its budget of 3 (30 s, then 120 s apart); the third is dead-lettered."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)

    def handle(attempt: Attempt) -> None:
        attempt.stage("fetch", lambda: {"n": 1})
        attempt.stage("send", lambda: (_ for _ in ()).throw(TimeoutError("timed out")))

    outcomes = []
    for wait in (0, 30, 120):
        clock.advance(wait)
        r = drain(engine, clock).run(handle)
        outcomes.append((r.retried, r.dead_lettered))
    assert outcomes == [(1, 0), (1, 0), (0, 1)]
    with engine.connect() as conn:
        [letter] = deadletters.list_(conn)
        fetched = conn.execute(sa.select(sa.func.count()).select_from(stage_checkpoints)).scalar_one()
    assert letter.attempts == 3 and letter.stage_attempts == {"fetch": 1, "send": 3}
    assert fetched == 1  # fetch ran once; its checkpoint served the retries


def test_replay_of_a_dead_letter_is_worked_by_the_drain_from_the_failed_stage(engine) -> None:
    """`request_replay` makes the row due with fresh budgets; the next drain runs only the failed stage and
    closes the letter; the replay sensor's list does not include it (no run per letter)."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)
    fetches, broken = [], [True]

    def handle(attempt: Attempt) -> None:
        attempt.stage("fetch", lambda: fetches.append(1) or {"n": 1})

        def send() -> dict:
            if broken[0]:
                raise PermanentError(Failure.of(Code.AUTH_DENIED))
            return {}
        attempt.stage("send", send)

    drain(engine, clock).run(handle)
    with engine.begin() as conn:
        [letter] = deadletters.list_(conn)
        deadletters.request_replay(conn, letter.id, evidence="INC-1 key rotated", confirm_safe=True, at=clock.now())
        assert deadletters.replays_pending(conn) == []
    broken[0] = False
    report = drain(engine, clock).run(handle)
    assert report.done == 1 and fetches == [1]
    with engine.connect() as conn:
        assert deadletters.get(conn, letter.id).status == "resolved"


def test_expired_lease_is_reclaimed_and_the_late_holder_writes_nothing(engine) -> None:
    """A holder whose lease expired (a paused worker) is fenced out: its completion changes nothing."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)
    with engine.begin() as conn:
        [stale] = work.claim(conn, "demo", owner="paused", limit=5, lease_seconds=60, now=clock.now())
        assert work.claim(conn, "demo", owner="other", limit=5, lease_seconds=60, now=clock.now()) == []
    clock.advance(61)
    with engine.begin() as conn:
        [fresh] = work.claim(conn, "demo", owner="other", limit=5, lease_seconds=60, now=clock.now())
        assert fresh.lease_epoch == stale.lease_epoch + 1
        assert not work.complete(conn, stale, now=clock.now())
        assert work.complete(conn, fresh, now=clock.now())
    assert statuses(engine) == {"e-0": "done"}


def test_two_drains_at_once_work_each_entity_once(engine) -> None:
    """Two concurrent drains over 200 rows (SKIP LOCKED): every entity handled exactly once."""
    clock = FrozenClock(START)
    enqueue(engine, 200, clock)
    seen: list[str] = []
    lock = threading.Lock()

    def handle(attempt: Attempt) -> None:
        with lock:
            seen.append(attempt.entity_ref)

    threads = [threading.Thread(target=lambda: drain(engine, clock, batch_size=7).run(handle)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 200 and len(set(seen)) == 200


def test_group_key_limits_the_drain_to_one_group(engine) -> None:
    """A drain of one group (an evidence file job's partition) leaves other groups' rows due."""
    clock = FrozenClock(START)
    enqueue(engine, 3, clock, group="job-a")
    with engine.begin() as conn:
        work.enqueue(conn, "demo", "b-0", now=clock.now(), group_key="job-b")
        assert work.due_groups(conn, "demo", clock.now()) == [("job-a", 3), ("job-b", 1)]
    report = drain(engine, clock).run(lambda a: None, group_key="job-a")
    assert report.done == 3
    assert statuses(engine)["b-0"] == "due"


def test_claim_uses_the_claim_index(engine) -> None:
    """With many rows due in the future ahead of the due ones, the claim is an index range, not a scan."""
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO work_items (pipeline, entity_ref, due_at) "
            "SELECT 'demo', 'f-' || g, :later FROM generate_series(1, 20000) g"), {"later": START + timedelta(days=1)})
        conn.execute(sa.text("INSERT INTO work_items (pipeline, entity_ref, due_at) "
                             "SELECT 'demo', 'd-' || g, :now FROM generate_series(1, 50) g"), {"now": START})
        conn.execute(sa.text("ANALYZE work_items"))
    picked = (sa.select(work_items.c.id)
              .where(work_items.c.pipeline == "demo", work_items.c.status.in_(work.OPEN_STATUSES),
                     work_items.c.due_at <= START)
              .order_by(work_items.c.due_at).limit(50).with_for_update(skip_locked=True))
    sql = str(picked.compile(dialect=engine.dialect, compile_kwargs={"literal_binds": True}))
    with engine.connect() as conn:
        plan = "\n".join(r[0] for r in conn.execute(sa.text("EXPLAIN " + sql)))
    assert "ix_work_items_claim" in plan and "Seq Scan" not in plan


@pytest.mark.parametrize("kind", ["thread", "coroutine"])
def test_checkpoints_are_read_once_an_attempt_and_not_on_an_entitys_first_lease(engine, kind: str,
                                                                                   monkeypatch) -> None:
    """A first lease runs every stage (a checkpoint left by an earlier life of the same ref, pruned work or a
    stray row, is not taken for this entity's); its retry, on a later lease, resumes after the stage that
    succeeded, reading the entity's checkpoints in one query."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)
    with engine.begin() as conn:
        conn.execute(sa.insert(stage_checkpoints).values(pipeline="demo", entity_ref="e-0", stage="fetch",
                                                         output={"body": "stale"}))
    ran: list[str] = []

    def fetch() -> dict:
        ran.append("fetch")
        return {"body": f"fresh {len(ran)}"}

    def send(fetched: dict) -> dict:
        ran.append("send")
        if ran.count("send") == 1:
            raise httpx.HTTPStatusError("503", request=httpx.Request("POST", "http://x"), response=httpx.Response(503))
        return {"sent": fetched["body"]}

    def handle(attempt: Attempt) -> None:
        fetched = attempt.stage("fetch", fetch)
        attempt.stage("send", lambda: send(fetched))

    async def ahandle(attempt: Attempt) -> None:
        async def afetch() -> dict:
            return fetch()

        fetched = await attempt.astage("fetch", afetch)

        async def asend() -> dict:
            return send(fetched)

        await attempt.astage("send", asend)

    chosen = handle if kind == "thread" else ahandle
    assert drain(engine, clock).run(chosen).retried == 1
    assert ran == ["fetch", "send"]  # the stale checkpoint was not used on the first lease
    clock.advance(30)
    reads: list[str] = []
    original = checkpoints.load_all

    def counted(conn, pipeline, ref):  # type: ignore[no-untyped-def]
        reads.append(ref)
        return original(conn, pipeline, ref)

    monkeypatch.setattr(checkpoints, "load_all", counted)
    assert drain(engine, clock).run(chosen).done == 1
    assert ran == ["fetch", "send", "send"] and reads == ["e-0"]  # resumed at `send`, one read for both stages
    with engine.connect() as conn:
        outputs = dict(conn.execute(sa.select(stage_checkpoints.c.stage, stage_checkpoints.c.output)).all())
    assert outputs["send"] == {"sent": "fresh 1"}


def test_an_attempt_our_database_lost_spends_none_and_comes_back_shortly(engine) -> None:
    """The handler's own write fails on our database (too many clients, a restart): the entity is due again
    within seconds with its stage's attempts untouched, the loss counted apart; after OURS_MAX such losses it
    is an ordinary failure of the stage, so a broken statement cannot loop for ever."""
    from redrive.drain import OURS, OURS_MAX

    clock = FrozenClock(START)
    enqueue(engine, 1, clock)
    lost = sa.exc.OperationalError("INSERT", {}, Exception("FATAL: sorry, too many clients already"))

    def handle(attempt: Attempt) -> None:
        def send() -> dict:
            raise lost
        attempt.stage("send", send)

    report = drain(engine, clock).run(handle)
    assert (report.infrastructure, report.retried, report.dead_lettered) == (1, 0, 0)
    with engine.connect() as conn:
        row = conn.execute(sa.select(work_items)).one()
    assert row.status == "due" and row.attempts == {OURS: 1}
    assert START < row.due_at <= START + timedelta(seconds=3)
    assert "not counted as an attempt" in row.last_error
    for n in range(2, OURS_MAX + 1):
        clock.advance(120)
        assert drain(engine, clock).run(handle).infrastructure == 1
    clock.advance(120)
    spent = drain(engine, clock).run(handle)
    assert (spent.infrastructure, spent.retried) == (0, 1)
    with engine.connect() as conn:
        assert conn.execute(sa.select(work_items.c.attempts)).scalar_one() == {OURS: OURS_MAX, "send": 1}


def test_the_wait_after_our_database_lost_an_attempt_grows_and_is_capped() -> None:
    from redrive.drain import ours_wait

    assert [ours_wait(n, 0.5) for n in (1, 2, 3, 6, 7, 20)] == [2.0, 4.0, 8.0, 60.0, 60.0, 60.0]
    assert ours_wait(3, 0.0) == 4.0 and ours_wait(3, 0.999) < 12.0


def saved(engine: sa.Engine, stage: str) -> dict | None:
    with engine.connect() as conn:
        return checkpoints.load(conn, "demo", "e-0", stage)


@pytest.mark.parametrize("kind", ["thread", "coroutine"])
def test_a_stage_that_is_not_durable_rides_the_entitys_next_write_whatever_its_outcome(engine, kind: str) -> None:
    """`durable=False` writes nothing of its own: fetch's checkpoint is absent while send runs, and is written by
    the transaction that settles send's failure, so the retry resumes at send; there send (not durable either)
    and a `write_later` record are written by the settlement that completes the entity."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)
    ran: list[str] = []
    seen: dict[str, object] = {}

    def fetch() -> dict:
        ran.append("fetch")
        return {"body": "b"}

    def send() -> dict:
        ran.append("send")
        seen.setdefault("fetch checkpoint while send ran", saved(engine, "fetch"))
        if ran.count("send") == 1:
            raise httpx.HTTPStatusError("503", request=httpx.Request("POST", "http://x"), response=httpx.Response(503))
        return {"sent": True}

    def note(attempt: Attempt) -> None:
        attempt.write_later(lambda conn: checkpoints.save(conn, "demo", "e-0", "note", {"n": len(ran)}))

    def handle(attempt: Attempt) -> None:
        attempt.stage("fetch", fetch, durable=False)
        attempt.stage("send", send, durable=False)
        note(attempt)

    async def ahandle(attempt: Attempt) -> None:
        async def afetch() -> dict:
            return fetch()

        async def asend() -> dict:
            return send()

        await attempt.astage("fetch", afetch, durable=False)
        await attempt.astage("send", asend, durable=False)
        note(attempt)

    chosen = handle if kind == "thread" else ahandle
    assert drain(engine, clock).run(chosen).retried == 1
    assert seen["fetch checkpoint while send ran"] is None
    assert saved(engine, "fetch") == {"body": "b"} and saved(engine, "send") is None
    clock.advance(30)
    assert drain(engine, clock).run(chosen).done == 1
    assert ran == ["fetch", "send", "send"]  # resumed at send: fetch's checkpoint was there
    assert saved(engine, "send") == {"sent": True} and saved(engine, "note") == {"n": 3}
    with engine.connect() as conn:
        ok = dict(conn.execute(sa.text("SELECT stage, sum(count) FROM stage_observations WHERE pipeline = 'demo' "
                                       "AND outcome = 'ok' GROUP BY stage")).all())
    assert ok == {"fetch": 1, "send": 1}  # each success observed once, with its checkpoint


def test_write_now_carries_what_waits_for_the_next_write(engine) -> None:
    """A `write_later` record is in the next `write_now`'s transaction, not left for the settlement."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)
    seen: list[object] = []

    def handle(attempt: Attempt) -> None:
        attempt.write_later(lambda conn: checkpoints.save(conn, "demo", "e-0", "webhook", {"status": 200}))
        seen.append(saved(engine, "webhook"))
        attempt.write_now(lambda conn: checkpoints.save(conn, "demo", "e-0", "slack", {"ts": "1"}))
        seen.append(saved(engine, "webhook"))
        assert attempt.riders == []

    assert drain(engine, clock).run(handle).done == 1
    assert seen == [None, {"status": 200}] and saved(engine, "slack") == {"ts": "1"}


def test_what_rides_a_settlement_refused_by_its_fence_is_not_written(engine) -> None:
    """Our lease expired and another holder took the entity: the late settlement writes nothing, its riders
    (a stage's checkpoint, a record) included; the new holder does that work again."""
    clock = FrozenClock(START)
    enqueue(engine, 1, clock)

    def handle(attempt: Attempt) -> None:
        attempt.stage("fetch", lambda: {"body": "b"}, durable=False)
        attempt.write_later(lambda conn: checkpoints.save(conn, "demo", "e-0", "note", {}))
        clock.advance(61)  # paused past the lease: another holder claims the entity
        with engine.begin() as conn:
            assert len(work.claim(conn, "demo", owner="other", limit=1, lease_seconds=60, now=clock.now())) == 1

    report = drain(engine, clock).run(handle)
    assert report.lease_lost == 1 and report.done == 0
    assert saved(engine, "fetch") is None and saved(engine, "note") is None
