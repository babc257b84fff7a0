"""Upstream limits shared through PostgreSQL: slots with leases, the rate ring, shared pauses, the retry budget."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncio
import threading

import httpx
import pytest
import sqlalchemy as sa

from redrive import upstreams as up
from redrive.clock import FrozenClock, SystemClock
from redrive.upstreams import RetryDeferred, UpstreamLimits, Upstreams, retry_allowance, retrying

START = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


class Stuck(Exception):
    """Raised by a sleep that refuses to wait: the caller would have waited."""


def refuse(_: float) -> None:
    raise Stuck


def limiter(engine: sa.Engine, clock: FrozenClock, sleep=None, **limits: object) -> Upstreams:  # type: ignore[no-untyped-def]
    return Upstreams(engine, {"llm": UpstreamLimits(**limits)}, clock=clock, sleep=sleep or clock.sleep)  # type: ignore[arg-type]


def test_slots_are_shared_and_a_dead_holders_slot_returns_when_its_lease_ends(engine: sa.Engine) -> None:
    """Two workers share 2 slots: a third acquire waits; a slot never released comes back after its lease."""
    clock = FrozenClock(START)
    first = limiter(engine, clock, sleep=refuse, max_concurrent=2, lease_seconds=30)
    second = limiter(engine, clock, sleep=refuse, max_concurrent=2, lease_seconds=30)
    a = first.acquire("llm", first.limits["llm"])
    b = second.acquire("llm", second.limits["llm"])
    assert {a.slot, b.slot} == {1, 2}
    with pytest.raises(Stuck):
        second.acquire("llm", second.limits["llm"])
    with engine.connect() as conn:
        state = up.states(conn, clock.now())[0]
    assert (state.slots_in_use, state.waiting) == (2, 1)
    clock.advance(31)  # `a`'s holder died: never released
    second._release(b)
    c = second.acquire("llm", second.limits["llm"])
    d = second.acquire("llm", second.limits["llm"])
    assert {c.slot, d.slot} == {1, 2}
    with engine.connect() as conn:
        assert up.states(conn, clock.now())[0].waiting == 0  # the waiter's row went with its grant


def test_waiting_for_a_slot_only_waits(engine: sa.Engine) -> None:
    """A full upstream is polled (the injected sleep) until a slot frees; the call then runs once."""
    clock = FrozenClock(START)
    holder = limiter(engine, clock, max_concurrent=1, lease_seconds=5)
    held = holder.acquire("llm", holder.limits["llm"])
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.advance(seconds)
        if len(waits) == 3:
            holder._release(held)

    waiter = limiter(engine, clock, sleep=sleep, max_concurrent=1, lease_seconds=5)
    calls = []
    assert waiter.call("llm", lambda: calls.append(1) or "answer") == "answer"
    assert len(waits) == 3 and calls == [1]


def test_grants_are_spaced_by_the_rate_across_workers(engine: sa.Engine) -> None:
    """At 3/s, four callers of two workers asking at one instant: the first is sent at once, the next three hold
    grants reserved 1/3, 2/3 and 1 s ahead and sleep until then (one round trip each), so any 1 s holds 3 sends.
    A fifth, due beyond the next second, is told to ask again later instead."""
    clock = FrozenClock(START)
    waits: list[float] = []
    workers = [limiter(engine, clock, sleep=waits.append, rate_per_second=3) for _ in range(2)]
    limits = workers[0].limits["llm"]
    asked: list[int] = []
    for worker in workers:
        worker._ask = lambda *a, ask=worker._ask: asked.append(1) or ask(*a)  # type: ignore[method-assign]
    for i in range(4):
        workers[i % 2].acquire("llm", limits)
    assert waits == pytest.approx([1 / 3, 2 / 3, 1.0], abs=1e-5) and len(asked) == 4
    sent = [START, *(START + timedelta(seconds=w) for w in waits)]
    assert (sent[3] - sent[0]).total_seconds() >= 1.0 - 1e-5  # 4 sends never fit in one second
    late = limiter(engine, clock, sleep=refuse, rate_per_second=3)
    with pytest.raises(Stuck):
        late.acquire("llm", limits)  # due 4/3 s from now: not reserved; it waits and asks again
    clock.advance(1.0)
    late.sleep = waits.append
    late.acquire("llm", limits)  # now within the second ahead: reserved, sent 1/3 s later
    assert waits[-1] == pytest.approx(1 / 3, abs=1e-5)


def test_a_grant_sent_late_is_given_back_and_asked_again(engine: sa.Engine) -> None:
    """At 10/s, a caller that wakes 80 ms after its reserved grant's time (a busy loop, a starved machine) would
    arrive at the provider bunched with the grants after it: it gives that grant back and asks again, and sends
    on its next grant, which it reaches on time. The grant it gave back is never used by anyone."""
    clock = FrozenClock(START)
    ticks = [0.0]
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        ticks[0] += seconds + (0.08 if len(waits) == 1 else 0.0)  # the first wake-up is late

    worker = Upstreams(engine, {"llm": UpstreamLimits(rate_per_second=10, max_concurrent=5)}, clock=clock,
                       sleep=sleep, monotonic=lambda: ticks[0])
    asked: list[int] = []
    worker._ask = lambda *a, ask=worker._ask: asked.append(1) or ask(*a)  # type: ignore[method-assign]
    limits = worker.limits["llm"]
    first = worker.acquire("llm", limits)  # due now: sent at once
    second = worker.acquire("llm", limits)  # reserved 0.1 s ahead, woke late; then reserved 0.2 s ahead
    assert waits == pytest.approx([0.1, 0.2], abs=1e-5) and len(asked) == 3
    with engine.connect() as conn:
        assert up.states(conn, clock.now())[0].slots_in_use == 2  # the late grant's slot went back
    assert second.slot != first.slot


def test_a_grant_whose_reply_came_back_late_is_given_back(engine: sa.Engine) -> None:
    """At 10/s, the database grants at once, but its answer reaches the caller 50 ms later (the commit, a thread
    starved of the GIL): the time since the reply says 0, the database's clock says 50 ms. Sent now, it would
    arrive bunched with the grants after it; it is given back and the caller sends on its next grant."""
    clock = FrozenClock(START)
    ticks = [0.0]

    def sleep(seconds: float) -> None:
        ticks[0] += seconds
        clock.advance(seconds)

    worker = Upstreams(engine, {"llm": UpstreamLimits(rate_per_second=10, max_concurrent=5)}, clock=clock,
                       sleep=sleep, monotonic=lambda: ticks[0])
    replies: list[float] = []

    def slow_reply(*args: object, ask=worker._ask):  # type: ignore[no-untyped-def]
        row, asked, replied = ask(*args)
        late = 0.05 if not replies else 0.0  # only the first answer is slow on its way back
        replies.append(late)
        ticks[0] += late
        clock.advance(late)
        return row, asked, replied + late  # the reply reached the caller `late` after the database answered

    worker._ask = slow_reply  # type: ignore[method-assign]
    worker.acquire("llm", worker.limits["llm"])
    assert len(replies) == 2  # the first grant went back; the second, reserved 50 ms on, was on time
    with engine.connect() as conn:
        assert up.states(conn, clock.now())[0].slots_in_use == 1


def test_waiting_for_the_rate_lock_does_not_date_a_grant_back(engine: sa.Engine) -> None:
    """A caller that waits for the rate's row lock (another backend holds it: a busy database) is told to wait
    until the grant's time counted from when it got the lock. Counted from when it asked, its wait came out longer
    by the time it had already waited, and callers queued behind the lock were sent that much late, bunched."""
    worker = Upstreams(engine, {"llm": UpstreamLimits(rate_per_second=10, max_concurrent=5)}, clock=SystemClock())
    worker.configure()
    answer: list[sa.Row] = []
    with engine.connect() as holder:
        due = holder.execute(sa.text("SELECT clock_timestamp() + interval '500 milliseconds'")).scalar_one()
        holder.execute(sa.text("UPDATE upstream_limits SET tat = :due WHERE name = 'llm'"), {"due": due})
        asking = threading.Thread(target=lambda: answer.append(worker._ask("llm", worker.limits["llm"], "h", False,
                                                                           False)[0]))
        asking.start()
        while not holder.execute(sa.text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar_one():
            pass  # until the caller waits for the row lock the holder's update took
        holder.execute(sa.text("SELECT pg_sleep(0.2)"))  # the holder keeps it a while: a backend descheduled
        holder.commit()
        asking.join(timeout=30)
    (row,) = answer
    assert row.reason == "reserved"
    sent = row.answered + row.wait  # where the caller will send, on the database's clock
    assert sent == pytest.approx(due.timestamp(), abs=0.1)  # not 200 ms or more after the grant's time


def test_a_reserved_grant_given_up_returns_its_slot(engine: sa.Engine) -> None:
    """A caller stopped while it sleeps until its reserved grant (a cancelled task, a shutdown) gives the
    concurrency slot back at once, not when its lease ends."""
    clock = FrozenClock(START)
    worker = limiter(engine, clock, max_concurrent=1, rate_per_second=1, lease_seconds=60)
    limits = worker.limits["llm"]
    worker._release(worker.acquire("llm", limits))
    worker.sleep = refuse
    with pytest.raises(Stuck):
        worker.acquire("llm", limits)  # reserved 1 s ahead with the only slot, then stopped
    with engine.connect() as conn:
        assert up.states(conn, clock.now())[0].slots_in_use == 0


def test_a_burst_lets_that_many_grants_come_at_once(engine: sa.Engine) -> None:
    """2/s with a burst of 3: three grants at one instant, the next reserved half a second later."""
    clock = FrozenClock(START)
    waits: list[float] = []
    worker = limiter(engine, clock, sleep=waits.append, rate_per_second=2, rate_burst=3)
    for _ in range(3):
        worker.acquire("llm", worker.limits["llm"])
    assert waits == []
    worker.acquire("llm", worker.limits["llm"])
    assert waits == pytest.approx([0.5], abs=1e-5)


def test_a_fractional_rate_spreads_grants(engine: sa.Engine) -> None:
    """0.5/s grants one call, then the next only 2 s later: asked at 0.9 s it is told to wait, at 1.5 s it is
    reserved for 2 s."""
    clock = FrozenClock(START)
    worker = limiter(engine, clock, sleep=refuse, rate_per_second=0.5)
    worker.acquire("llm", worker.limits["llm"])
    clock.advance(0.9)
    with pytest.raises(Stuck):
        worker.acquire("llm", worker.limits["llm"])
    clock.advance(0.6)
    waits: list[float] = []
    worker.sleep = waits.append
    worker.acquire("llm", worker.limits["llm"])
    assert waits == pytest.approx([0.5], abs=1e-5)


def test_a_429_pauses_the_upstream_for_every_worker(engine: sa.Engine, sandbox) -> None:  # type: ignore[no-untyped-def]
    """One worker's 429 with Retry-After 7 holds another worker's next call for those 7 s; the 429 is waited
    out and sent again, not failed."""
    clock = FrozenClock(START)
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "7"}})
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        clock.advance(seconds)

    one = limiter(engine, clock, sleep=sleep, max_concurrent=4)
    other = limiter(engine, clock, sleep=refuse, max_concurrent=4)

    def chat() -> int:
        with httpx.Client() as client:
            answer = client.post(sandbox.url("/llm/v1/chat/completions"), headers={"Authorization": "Bearer k"},
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            answer.raise_for_status()
            return answer.status_code

    paused_at = clock.now()
    with pytest.raises(Stuck):
        # `one` got the 429 and is waiting it out; meanwhile `other` is held too
        one.sleep = lambda s: (_ for _ in ()).throw(Stuck())  # type: ignore[assignment]
        one.call("llm", chat)
    with pytest.raises(Stuck):
        other.call("llm", chat)
    with engine.connect() as conn:
        state = up.states(conn, clock.now())[0]
    assert state.paused_seconds_left == pytest.approx(7.0) and state.pauses == 1
    one.sleep = sleep
    assert one.call("llm", chat) == 200
    assert sum(waits) >= 7.0 and (clock.now() - paused_at).total_seconds() >= 7.0
    assert [r["status"] for r in sandbox.requests("llm")] == [429, 200]  # `other` sent nothing while paused


def test_retry_allowance_is_a_share_of_calls_plus_a_floor() -> None:
    """10 % of 200 calls plus 1/s over 10 s: 30 retries."""
    policy = UpstreamLimits(retry_share=0.1, retry_floor_per_second=1, retry_window_seconds=10)
    assert retry_allowance(200, policy) == 30
    assert retry_allowance(0, policy) == 10


def test_over_the_budget_a_retry_is_deferred_not_sent_and_alerts_once(engine: sa.Engine) -> None:
    """Share 10 %, floor 0.2/s over 10 s: after 20 first calls, 4 retries go out (0.1·24 + 2 ≥ 4), the
    next is refused before sending; many refusals in one episode call the alert hook once."""
    clock = FrozenClock(START)
    alerts: list[str] = []
    worker = Upstreams(engine, {"llm": UpstreamLimits(retry_share=0.1, retry_floor_per_second=0.2,
                                                      retry_window_seconds=10)},
                       clock=clock, sleep=refuse, on_exhausted=alerts.append)
    sent: list[str] = []

    def failing(what: str) -> None:
        sent.append(what)
        raise httpx.ConnectError("the upstream is down")

    for i in range(20):
        worker.call("llm", lambda i=i: sent.append(f"first-{i}"))
    for i in range(4):
        with retrying(), pytest.raises(httpx.ConnectError):
            worker.call("llm", lambda i=i: failing(f"retry-{i}"))
    for _ in range(5):
        with retrying(), pytest.raises(RetryDeferred) as deferred:
            worker.call("llm", lambda: sent.append("not sent"))
        clock.advance(0.5)
    assert "not sent" not in sent and len(sent) == 24
    assert deferred.value.upstream == "llm" and deferred.value.wait == 10
    assert alerts == ["llm"]
    clock.advance(30)  # the window emptied: retries flow again, and a new exhaustion is a new episode
    with retrying():
        worker.call("llm", lambda: sent.append("retry-later"))
    with engine.connect() as conn:
        state = up.states(conn, clock.now())[0]
    assert (state.retries_denied, state.budget_episodes) == (5, 1)


def test_only_the_first_call_of_a_retrying_entity_is_a_retry(engine: sa.Engine) -> None:
    """Once a retry is granted, the entity's further calls are ordinary calls."""
    clock = FrozenClock(START)
    worker = Upstreams(engine, {"llm": UpstreamLimits(retry_share=0.0, retry_floor_per_second=0.1,
                                                      retry_window_seconds=10)}, clock=clock, sleep=refuse)
    def down() -> None:
        raise httpx.ConnectError("the upstream is down")

    with retrying():
        with pytest.raises(httpx.ConnectError):
            worker.call("llm", down)  # the floor allows 1; it fails, so it keeps its share
        worker.call("llm", lambda: None)  # not a retry any more
    with retrying(), pytest.raises(RetryDeferred):
        worker.call("llm", lambda: None)


def test_a_retry_answered_well_gives_its_share_back(engine: sa.Engine) -> None:
    """Room for one failing retry (floor 0.1/s over 10 s, no share): retries the upstream answers well (a value, or
    a 2xx response) give their share back, so after an outage the backlog flows; one that fails, or an HTTP error
    response, keeps it, and the next retry is deferred."""
    clock = FrozenClock(START)
    worker = Upstreams(engine, {"llm": UpstreamLimits(retry_share=0.0, retry_floor_per_second=0.1,
                                                      retry_window_seconds=10)}, clock=clock, sleep=refuse)
    ok = httpx.Response(200, request=httpx.Request("POST", "http://llm"))
    failed = httpx.Response(503, request=httpx.Request("POST", "http://llm"))
    for answer in (None, ok, None, ok):
        with retrying():
            assert worker.call("llm", lambda answer=answer: answer) is answer
    with retrying():
        worker.call("llm", lambda: failed)  # an error response: the last share is spent
    with retrying(), pytest.raises(RetryDeferred):
        worker.call("llm", lambda: None)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT sum(retries), sum(retries_ok) FROM upstream_calls")).one() == (5, 4)


def test_unconfigured_upstreams_cost_no_round_trip(engine: sa.Engine) -> None:
    """A name without limits calls straight through and writes nothing."""
    worker = Upstreams(engine, {"llm": UpstreamLimits()}, clock=FrozenClock(START), sleep=refuse)
    assert worker.call("llm", lambda: 5) == 5 and worker.call("mail", lambda: 6) == 6
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(up.upstream_limits)).scalar_one() == 0


def test_the_drain_defers_a_retry_over_the_budget_without_spending_an_attempt(engine: sa.Engine) -> None:
    """Two entities whose last attempt failed, a budget with room for one failing retry: one retry is sent (and
    fails again: retried); the other is not sent, falls due later with its attempts unchanged, one alert."""
    from redrive import work
    from redrive.backoff import FixedSchedule
    from redrive.drain import Attempt, Drain
    from redrive.reliability import Reliability
    from redrive.schema import alerts, work_items
    from redrive.stages import StagePolicy

    clock = FrozenClock(START)
    runtime = Reliability(engine=engine, clock=clock)
    budget = Upstreams(engine, {"llm": UpstreamLimits(retry_share=0.0, retry_floor_per_second=0.1,
                                                      retry_window_seconds=10)},
                       clock=clock, sleep=refuse, on_exhausted=runtime.retry_budget_exhausted)
    with engine.begin() as conn:
        for ref in ("a", "b"):
            work.enqueue(conn, "demo", ref, now=clock.now())
        conn.execute(sa.update(work_items).values(stage="llm", attempts={"llm": 1}))  # each failed once
    sent: list[str] = []

    def down(entity: str) -> None:  # the upstream is still failing: the retry that is sent fails again
        sent.append(entity)
        raise httpx.ConnectError("the upstream is down")

    def handle(attempt: Attempt) -> None:
        attempt.stage("llm", lambda: {"answer": up.guarded("llm", lambda: down(attempt.entity_ref))})

    up.install(budget)
    try:
        report = Drain(reliability=runtime, pipeline="demo", owner="t", concurrency=1, linger_seconds=0,
                       policies={"llm": StagePolicy(max_attempts=3, backoff=FixedSchedule((5.0,)))},
                       sleep=clock.sleep).run(handle)
    finally:
        up.install(None)
    assert len(sent) == 1 and (report.retried, report.deferred, report.dead_lettered) == (1, 1, 0)
    with engine.connect() as conn:
        deferred = conn.execute(sa.select(work_items).where(work_items.c.status == "due",
                                                            work_items.c.entity_ref != sent[0])).one()
        kinds = conn.execute(sa.select(alerts.c.kind)).scalars().all()
    assert deferred.entity_ref not in sent and deferred.attempts == {"llm": 1}  # no attempt spent
    assert 5 <= (deferred.due_at - clock.now()).total_seconds() <= 15
    assert "retry budget" in deferred.last_error
    assert kinds == ["retry_budget_exhausted"]


def test_metrics_show_slots_in_use_and_waiting_per_upstream(engine: sa.Engine) -> None:
    """The scrape shows the held slot, the waiter and the limit of the upstream."""
    from redrive import metrics

    clock = FrozenClock(START)
    worker = limiter(engine, clock, sleep=refuse, max_concurrent=1)
    worker.acquire("llm", worker.limits["llm"])
    with pytest.raises(Stuck):
        worker.acquire("llm", worker.limits["llm"])
    samples = {(s.name, s.labels.get("upstream")): s.value
               for family in metrics.registry(engine, clock, []).collect() for s in family.samples}
    assert samples[("redrive_upstream_slots_in_use", "llm")] == 1
    assert samples[("redrive_upstream_slots_limit", "llm")] == 1
    assert samples[("redrive_upstream_waiting", "llm")] == 1


def test_coroutines_share_the_slots_and_never_exceed_them(engine: sa.Engine, sandbox) -> None:  # type: ignore[no-untyped-def]
    """24 coroutines at once through `acall` against 4 slots and a provider capped at 4 concurrent: all answered,
    none refused, the provider never saw a fifth at once."""
    sandbox.set_profile("llm", latency=0.2, max_concurrent=4, retry_after=1)
    limits = Upstreams(engine, {"llm": UpstreamLimits(max_concurrent=4, lease_seconds=30)})

    async def all_at_once() -> list[int]:
        async with httpx.AsyncClient() as client:
            async def chat() -> int:
                answer = await client.post(sandbox.url("/llm/v1/chat/completions"),
                                           headers={"Authorization": "Bearer k"},
                                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
                answer.raise_for_status()
                return answer.status_code

            return await asyncio.gather(*(limits.acall("llm", chat) for _ in range(24)))

    assert asyncio.run(all_at_once()) == [200] * 24
    meter = sandbox.meters("llm")
    assert (meter["admitted"], meter["limited"], meter["peak_concurrency"]) == (24, 0, 4)


def test_a_429_to_one_coroutine_pauses_the_others_too(engine: sa.Engine, sandbox) -> None:  # type: ignore[no-untyped-def]
    """A coroutine's 429 with Retry-After 7 pauses the upstream: a second coroutine of another limiter waits
    those 7 s before it sends, and the first sends again after its pause instead of failing."""
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "7"}})
    waits: dict[str, list[float]] = {"one": [], "other": []}

    def limiter_at(name: str, clock: FrozenClock) -> Upstreams:
        async def asleep(seconds: float) -> None:
            waits[name].append(seconds)
            clock.advance(seconds)
            await asyncio.sleep(0)

        return Upstreams(engine, {"llm": UpstreamLimits(max_concurrent=4)}, clock=clock, asleep=asleep)

    async def chat() -> int:
        async with httpx.AsyncClient() as client:
            answer = await client.post(sandbox.url("/llm/v1/chat/completions"), headers={"Authorization": "Bearer k"},
                                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            answer.raise_for_status()
            return answer.status_code

    assert asyncio.run(limiter_at("one", FrozenClock(START)).acall("llm", chat)) == 200  # waited out, answered
    assert sum(waits["one"]) >= 7.0
    with engine.connect() as conn:
        assert up.states(conn, START)[0].pauses == 1
    # another worker, one second into the pause: it holds off for the rest before sending
    assert asyncio.run(limiter_at("other", FrozenClock(START + timedelta(seconds=1))).acall("llm", chat)) == 200
    assert sum(waits["other"]) >= 6.0
    assert [r["status"] for r in sandbox.requests("llm")] == [429, 200, 200]
