"""Limits per upstream, shared by every run, worker and machine through PostgreSQL (issue 26 §3, §4).

A provider caps concurrent requests and requests per second for the whole account, not per worker; so
the caps live in the system of record and every process that calls the upstream takes from them:

- **Concurrency slots with leases.** `upstream_slots` holds one row per slot; a call holds one for its
  duration. A holder that dies (SIGKILL, lost machine) gives its slot back when the lease ends.
- **Requests per second.** GCRA on the upstream's row (`upstream_limits.tat`): grants are spaced 1/rate
  apart (`rate_burst` may come at once), so any window of W seconds holds at most rate·W + burst grants
  (at most rate per any 1 s with the default burst of 1, counted half-open). Spaced, not N at once and
  then N more a second later: jitter between a grant and the provider's arrival moves few requests
  across the provider's window. A grant due within the next second is reserved (the caller sleeps until
  its time and sends, one round trip a grant); later than that, the caller is told when to ask again.
- **Retry-After is news for everyone.** A 429 pauses the upstream (`paused_until`) for every worker.
- **A retry budget** (Finagle's RetryBudget shape): a retry is sent only while retries over the last
  `retry_window_seconds` stay within `retry_share` of all calls plus `retry_floor_per_second` per
  second. Beyond it :class:`RetryDeferred` is raised before anything is sent: the drain makes the
  entity due later without spending an attempt, and the first denial of an episode raises one alert
  per upstream (not one per entity).

The hot path is one round trip: `redrive_upstream_acquire(...)` (a stored function, migrations 0010-0015)
decides pause, budget, slot and rate under row locks and returns a slot or how long to wait; a
release is a second, one-row UPDATE. An entity waiting for a slot only waits: it spends no attempt.
The decision formulas are written once, in that function; :func:`retry_allowance` states the budget's
formula for documentation and tests.

Resources call :func:`guarded` ("llm", fn), or :func:`aguarded` from a coroutine: with no :class:`Upstreams` installed in the process, or
none configured for that name, the call goes straight through (tests, commands).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from redrive.clock import Clock, SystemClock
from redrive.db import per_process
from redrive.failures import RedriveError, parse_retry_after
from redrive.schema import NOW, TZ, metadata
from redrive.upstream_policy import UPSTREAMS, RetryDeferred, UpstreamLimits, retry_allowance

__all__ = [
    "UPSTREAMS",
    "Grant",
    "RetryDeferred",
    "UpstreamLimits",
    "Upstreams",
    "aguarded",
    "guarded",
    "install",
    "installed",
    "retry_allowance",
    "retrying",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

upstream_limits = sa.Table(
    "upstream_limits",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("max_concurrent", sa.Integer),
    sa.Column("rate_per_second", sa.Float),
    sa.Column("rate_burst", sa.Integer, nullable=False, server_default="1"),
    sa.Column("tat", TZ),  # GCRA's theoretical arrival time: the next grant is due then (less the burst)
    sa.Column("paused_until", TZ),
    sa.Column("pauses", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("retry_share", sa.Float),
    sa.Column("retry_floor_per_second", sa.Float, nullable=False, server_default="1"),
    sa.Column("retry_window_seconds", sa.Integer, nullable=False, server_default="10"),
    sa.Column("retries_denied", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("budget_episodes", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("budget_last_denied_at", TZ),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
)

upstream_slots = sa.Table(
    "upstream_slots",
    metadata,
    sa.Column("upstream", sa.Text, primary_key=True),
    sa.Column("slot", sa.Integer, primary_key=True),
    sa.Column("holder", sa.Text),
    sa.Column("lease_until", TZ),
)

upstream_calls = sa.Table(
    "upstream_calls",
    metadata,
    sa.Column("upstream", sa.Text, primary_key=True),
    sa.Column("second", sa.BigInteger, primary_key=True),
    sa.Column("calls", sa.Integer, nullable=False, server_default="0"),
    sa.Column("retries", sa.Integer, nullable=False, server_default="0"),
    # retries the upstream answered well: they show it recovered, so they give their budget back (migration 0012)
    sa.Column("retries_ok", sa.Integer, nullable=False, server_default="0"),
)

upstream_waiters = sa.Table(
    "upstream_waiters",
    metadata,
    sa.Column("upstream", sa.Text, primary_key=True),
    sa.Column("waiter", sa.Text, primary_key=True),
    sa.Column("until", TZ, nullable=False),
)


# ---------------------------------------------------------------------------------------------- policy

_RETRYING: contextvars.ContextVar[bool] = contextvars.ContextVar("redrive_upstream_retrying", default=False)


@contextlib.contextmanager
def retrying(flag: bool = True) -> Iterator[None]:
    """Mark the calls of this thread as a retry of failed work (the drain sets it for an entity whose
    last attempt failed); its first call to an upstream draws on that upstream's retry budget."""
    token = _RETRYING.set(flag)
    try:
        yield
    finally:
        _RETRYING.reset(token)


def grant_lateness(since_replied: float, since_asked: float, since_answered: float) -> float:
    """How long ago a grant's moment (the database's answer, before its `wait`) is, given the time since the
    reply reached the caller, since the caller asked, and since the database's clock read `answered`.

    The answer was given between the ask and the reply, so the lateness lies between `since_replied` and
    `since_asked`. The database's clock says where: it counts what the reply's way back cost (the commit, a
    starved thread waiting for the GIL) that `since_replied` misses. Clamped to the bounds, so a machine
    whose clock is off can neither excuse a late grant nor give back more than a round trip's worth."""
    return min(max(since_answered, since_replied), since_asked)


def wait_before_asking_again(told: float, polls: int, poll: float, roll: float) -> float:
    """How long a denied caller sleeps: what the database told it (a pause's or the rate window's rest),
    spread a little so waiters do not all ask at the same instant; for a full upstream (told 0: a slot frees
    at an unknown time) a poll that doubles from `poll` up to 16× it, so hundreds of waiters cost the
    database tens of questions a second, not thousands. `roll` is a uniform draw in [0, 1)."""
    if told > 0:
        return min(told, 60.0) * (1.0 + 0.1 * roll)
    return poll * 2 ** min(polls - 1, 4) * (0.5 + 0.5 * roll)


# ------------------------------------------------------------------------------------------ repository

ACQUIRE_FUNCTION = """
CREATE OR REPLACE FUNCTION redrive_upstream_acquire(
    p_name text, p_holder text, p_now timestamptz, p_lease double precision, p_retry boolean, p_waited boolean)
RETURNS TABLE (slot integer, wait double precision, reason text, new_episode boolean)
LANGUAGE plpgsql AS $fn$
DECLARE
    lim upstream_limits%ROWTYPE;
    s integer := 0;
    sec bigint;
    n_calls bigint;
    n_retries bigint;
    t timestamptz;
    due timestamptz;
    spacing double precision;
    fresh boolean := false;
    ahead double precision := 0.0;  -- a reserved grant is sent this many seconds from now
    reserve_ahead constant double precision := 1.0;
    v_now timestamptz := coalesce(p_now, clock_timestamp());  -- NULL: the database's clock, one for all machines
BEGIN
    sec := floor(extract(epoch FROM v_now));
    SELECT * INTO lim FROM upstream_limits l WHERE l.name = p_name;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 0, 0.0::float8, 'unlimited'::text, false;
        RETURN;
    END IF;
    -- a provider's Retry-After holds every worker
    IF lim.paused_until IS NOT NULL AND lim.paused_until > v_now THEN
        INSERT INTO upstream_waiters AS w VALUES (p_name, p_holder, lim.paused_until + interval '30 seconds')
            ON CONFLICT (upstream, waiter) DO UPDATE SET until = excluded.until;
        RETURN QUERY SELECT NULL::integer, extract(epoch FROM lim.paused_until - v_now)::float8, 'paused'::text, false;
        RETURN;
    END IF;
    -- the retry budget: failing retries <= share * calls + floor * window over the sliding window (a retry the
    -- upstream answered well gives its share back: after an outage the backlog flows at the limits, not the floor)
    IF p_retry AND lim.retry_share IS NOT NULL THEN
        SELECT coalesce(sum(c.calls), 0), coalesce(sum(c.retries - c.retries_ok), 0) INTO n_calls, n_retries
          FROM upstream_calls c WHERE c.upstream = p_name AND c.second > sec - lim.retry_window_seconds;
        IF n_retries + 1 > lim.retry_share * n_calls + lim.retry_floor_per_second * lim.retry_window_seconds THEN
            SELECT l.budget_last_denied_at IS NULL
                   OR l.budget_last_denied_at < v_now - make_interval(secs => l.retry_window_seconds)
              INTO fresh FROM upstream_limits l WHERE l.name = p_name FOR UPDATE;
            UPDATE upstream_limits l SET retries_denied = l.retries_denied + 1,
                   budget_episodes = l.budget_episodes + CASE WHEN fresh THEN 1 ELSE 0 END,
                   budget_last_denied_at = greatest(coalesce(l.budget_last_denied_at, v_now), v_now)
             WHERE l.name = p_name;
            RETURN QUERY SELECT NULL::integer, lim.retry_window_seconds::float8, 'retry_budget'::text, fresh;
            RETURN;
        END IF;
    END IF;
    -- a free slot (a dead holder's lease has ended); locked, so two callers never take the same one
    IF lim.max_concurrent IS NOT NULL THEN
        SELECT us.slot INTO s FROM upstream_slots us
         WHERE us.upstream = p_name AND us.slot <= lim.max_concurrent
           AND (us.lease_until IS NULL OR us.lease_until <= v_now)
         ORDER BY us.slot LIMIT 1 FOR UPDATE SKIP LOCKED;
        IF s IS NULL THEN
            INSERT INTO upstream_waiters AS w VALUES (p_name, p_holder, v_now + interval '30 seconds')
                ON CONFLICT (upstream, waiter) DO UPDATE SET until = excluded.until;
            RETURN QUERY SELECT NULL::integer, 0.0::float8, 'concurrency'::text, false;
            RETURN;
        END IF;
    END IF;
    -- the rate (GCRA): grants spaced 1/rate apart, `rate_burst` of them may come at once. A grant due within
    -- the next second is reserved now and sent at its time (`ahead`): one round trip a grant, where a denial
    -- would have every waiter ask again at each grant's instant and one of them win
    IF lim.rate_per_second IS NOT NULL THEN
        spacing := 1.0 / lim.rate_per_second;
        SELECT l.tat INTO t FROM upstream_limits l WHERE l.name = p_name FOR UPDATE;
        v_now := coalesce(p_now, clock_timestamp());  -- after the lock: waiting for it never dates a grant back
        due := coalesce(t, v_now) - make_interval(secs => (lim.rate_burst - 1) * spacing);
        IF due > v_now + make_interval(secs => reserve_ahead) THEN
            INSERT INTO upstream_waiters AS w VALUES (p_name, p_holder, v_now + interval '30 seconds')
                ON CONFLICT (upstream, waiter) DO UPDATE SET until = excluded.until;
            RETURN QUERY SELECT NULL::integer, extract(epoch FROM due - v_now)::float8 - reserve_ahead, 'rate'::text,
                                false;
            RETURN;
        END IF;
        ahead := greatest(extract(epoch FROM due - v_now)::float8, 0.0);
        UPDATE upstream_limits l SET tat = greatest(coalesce(t, v_now), v_now) + make_interval(secs => spacing)
         WHERE l.name = p_name;
    END IF;
    IF s > 0 THEN
        UPDATE upstream_slots us SET holder = p_holder, lease_until = v_now + make_interval(secs => ahead + p_lease)
         WHERE us.upstream = p_name AND us.slot = s;
    END IF;
    IF lim.retry_share IS NOT NULL THEN
        INSERT INTO upstream_calls AS c VALUES (p_name, sec, 1, CASE WHEN p_retry THEN 1 ELSE 0 END, 0)
            ON CONFLICT (upstream, second) DO UPDATE
            SET calls = c.calls + 1, retries = c.retries + CASE WHEN p_retry THEN 1 ELSE 0 END;
        IF sec % 60 = 0 THEN
            DELETE FROM upstream_calls c WHERE c.upstream = p_name AND c.second < sec - 3600;
        END IF;
    END IF;
    IF p_waited THEN
        DELETE FROM upstream_waiters w WHERE w.upstream = p_name AND w.waiter = p_holder;
    END IF;
    RETURN QUERY SELECT s, ahead, CASE WHEN ahead > 0 THEN 'reserved' ELSE 'granted' END, false;
END
$fn$;
"""

# `answered`: the clock the function's `wait` is counted from, read once it has returned (epoch seconds)
_ACQUIRE = sa.text("SELECT slot, wait, reason, new_episode, "
                   "extract(epoch FROM coalesce(CAST(:now AS timestamptz), clock_timestamp()))::float8 AS answered "
                   "FROM redrive_upstream_acquire(:name, :holder, :now, :lease, :retry, :waited)")


def configure(conn: sa.Connection, name: str, limits: UpstreamLimits, now: datetime) -> None:
    """Write the upstream's limits and its slot rows (idempotent)."""
    values = {"max_concurrent": limits.max_concurrent, "rate_per_second": limits.rate_per_second,
              "rate_burst": limits.rate_burst, "retry_share": limits.retry_share,
              "retry_floor_per_second": limits.retry_floor_per_second,
              "retry_window_seconds": limits.retry_window_seconds, "updated_at": now}
    stmt = insert(upstream_limits).values(name=name, **values)
    conn.execute(stmt.on_conflict_do_update(index_elements=["name"], set_=values))
    if limits.max_concurrent:
        conn.execute(sa.text(
            "INSERT INTO upstream_slots (upstream, slot) SELECT :name, generate_series(1, :n) "
            "ON CONFLICT DO NOTHING"), {"name": name, "n": limits.max_concurrent})
        conn.execute(sa.delete(upstream_slots).where(upstream_slots.c.upstream == name,
                                                     upstream_slots.c.slot > limits.max_concurrent,
                                                     upstream_slots.c.holder.is_(None)))


# the newest second of the window with a retry not yet answered well: the granted retry's own, or one as recent
_RETRY_ANSWERED = sa.text(
    "UPDATE upstream_calls c SET retries_ok = c.retries_ok + 1 WHERE c.upstream = :name AND c.second = "
    "(SELECT max(x.second) FROM upstream_calls x WHERE x.upstream = :name AND x.retries > x.retries_ok "
    "AND x.second <= floor(extract(epoch FROM coalesce(CAST(:now AS timestamptz), clock_timestamp()))))")


def retry_answered(conn: sa.Connection, name: str, now: datetime | None) -> None:
    """A granted retry got a good answer: its budget share comes back."""
    conn.execute(_RETRY_ANSWERED, {"name": name, "now": now})


def release(conn: sa.Connection, name: str, slot: int, holder: str) -> bool:
    """Give the slot back (only if still ours: an expired lease may have passed it on)."""
    return conn.execute(sa.update(upstream_slots).where(
        upstream_slots.c.upstream == name, upstream_slots.c.slot == slot, upstream_slots.c.holder == holder,
    ).values(holder=None, lease_until=None)).rowcount == 1


def pause(conn: sa.Connection, name: str, now: datetime | None, seconds: float) -> None:
    """Hold the upstream for every worker for `seconds` from `now` (None: the database's clock); a longer
    pause already set stays."""
    start = sa.func.clock_timestamp() if now is None else sa.literal(now, TZ)
    until = start + sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.cast(seconds, sa.Float))
    conn.execute(sa.update(upstream_limits).where(upstream_limits.c.name == name).values(
        paused_until=sa.func.greatest(sa.func.coalesce(upstream_limits.c.paused_until, until), until),
        pauses=upstream_limits.c.pauses + 1))


@dataclass(frozen=True)
class UpstreamState:
    """What the metrics endpoint shows of one upstream."""

    name: str
    max_concurrent: int | None
    rate_per_second: float | None
    slots_in_use: int
    waiting: int
    paused_seconds_left: float
    pauses: int
    retries_denied: int
    budget_episodes: int


def states(conn: sa.Connection, now: datetime) -> list[UpstreamState]:
    """Every configured upstream: slots whose lease runs, waiters still waiting, pause left, denials."""
    in_use = sa.select(sa.func.count()).where(
        upstream_slots.c.upstream == upstream_limits.c.name, upstream_slots.c.holder.is_not(None),
        upstream_slots.c.lease_until > now).scalar_subquery()
    waiting = sa.select(sa.func.count()).where(
        upstream_waiters.c.upstream == upstream_limits.c.name, upstream_waiters.c.until > now).scalar_subquery()
    rows = conn.execute(sa.select(upstream_limits, in_use.label("in_use"), waiting.label("waiting"))
                        .order_by(upstream_limits.c.name))
    return [UpstreamState(r.name, r.max_concurrent, r.rate_per_second, r.in_use, r.waiting,
                          max(0.0, (r.paused_until - now).total_seconds()) if r.paused_until else 0.0,
                          r.pauses, r.retries_denied, r.budget_episodes) for r in rows]


# ---------------------------------------------------------------------------------------------- facade


@dataclass(frozen=True)
class Grant:
    upstream: str
    slot: int
    holder: str
    retry: bool = False  # the call drew on the retry budget


@dataclass
class Upstreams:
    """The limits of every upstream this process calls, on one engine; `call(name, fn)` runs fn within them.

    `on_exhausted(name)` is called once per budget episode across all processes (the alert).
    """

    engine: sa.Engine
    limits: Mapping[str, UpstreamLimits]
    clock: Clock = field(default_factory=SystemClock)
    sleep: Callable[[float], None] = time.sleep
    asleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # a coroutine's wait (tests inject both)
    on_exhausted: Callable[[str], None] | None = None
    poll_seconds: float = 0.05  # a full upstream is asked again this often (slots free at unknown times)
    late_seconds: float = 0.02  # a rate grant not sent within this of its time is given back (`_on_time`)
    monotonic: Callable[[], float] = time.monotonic  # what `late_seconds` is measured on (tests inject it)
    _configured: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    waiting: dict[str, int] = field(default_factory=dict)  # in this process, for a run's own report
    _jitter: random.Random = field(default_factory=random.Random)

    def _now(self) -> datetime | None:
        """The time leases, the rate window and pauses are written in: the database's own clock (None) for
        the system clock, so every machine measures against one clock, grants are stamped when they are
        granted (not when the caller read its clock, possibly a thread switch earlier); an injected
        clock's time otherwise (tests)."""
        return None if isinstance(self.clock, SystemClock) else self.clock.now()

    @property
    def _autocommit(self) -> sa.Engine:
        return limiter_engine(self.engine.url)

    def configure(self) -> None:
        """Write every active upstream's limits (once per process; idempotent across processes)."""
        with self._lock:
            if self._configured:
                return
            with self.engine.begin() as conn:
                for name, limits in sorted(self.limits.items()):
                    if limits.active:
                        configure(conn, name, limits, self.clock.now())
            self._configured = True

    def limited(self, name: str) -> UpstreamLimits | None:
        limits = self.limits.get(name)
        return limits if limits is not None and limits.active else None

    def call(self, name: str, fn: Callable[[], T]) -> T:
        """`fn()` holding a slot and a rate grant of `name`; a 429 pauses `name` for every worker and is
        waited out up to `throttle_retries` times. Raises :class:`RetryDeferred` before sending a retry
        that the budget does not allow."""
        limits = self.limited(name)
        if limits is None:
            return fn()
        throttled = 0
        while True:
            grant = self.acquire(name, limits)
            try:
                try:
                    result = fn()
                except Exception as exc:
                    if not self._answered(grant, limits, exc, throttled):
                        raise
                else:
                    if not self._answered(grant, limits, result, throttled):
                        return result
            finally:
                self._release(grant)
            throttled += 1

    async def acall(self, name: str, fn: Callable[[], Awaitable[T]]) -> T:
        """`call` for a coroutine: the wait for a slot, a grant or a pause is an `asyncio.sleep` and the call an
        await, so an entity waiting on the upstream holds no thread; the database round trips take one
        briefly (`asyncio.to_thread`)."""
        limits = self.limited(name)
        if limits is None:
            return await fn()
        throttled = 0
        while True:
            grant = await self.aacquire(name, limits)
            try:
                try:
                    result = await fn()
                except Exception as exc:
                    if not await asyncio.to_thread(self._answered, grant, limits, exc, throttled):
                        raise
                else:
                    if not await asyncio.to_thread(self._answered, grant, limits, result, throttled):
                        return result
            finally:
                await asyncio.to_thread(self._release, grant)
            throttled += 1

    def _answered(self, grant: Grant, limits: UpstreamLimits, outcome: object, throttled: int) -> bool:
        """After one call (its result or its exception): True to send it again once a 429's pause is waited out;
        a retry answered well gives its budget share back."""
        asked = _throttled(outcome)
        if asked is None:
            if grant.retry and not isinstance(outcome, BaseException) and _answered_well(outcome):
                self._retry_answered(grant)
            return False
        return self._wait_out(grant.upstream, limits, asked, throttled)

    def acquire(self, name: str, limits: UpstreamLimits) -> Grant:
        """Wait (spending no attempt) until `name` grants a slot and a rate token; one round trip a try."""
        self.configure()
        holder, retry = uuid.uuid4().hex, _RETRYING.get()
        waited, polls = False, 0
        try:
            while True:
                row, asked, replied = self._ask(name, limits, holder, retry, waited)
                if (grant := self._granted(name, limits, row, holder, retry)) is not None:
                    if row.wait > 0:  # a rate grant reserved for a moment from now: sent then, not asked again
                        self._reserved(grant, lambda: self.sleep(float(row.wait)))
                    if self._on_time(limits, row, asked, replied):
                        return grant
                    self._release(grant)  # too late for its place in the rate: asked again
                    continue
                waited, polls = self._waiting(name, waited), polls + 1
                self.sleep(wait_before_asking_again(float(row.wait), polls, self.poll_seconds, self._jitter.random()))
        finally:
            self._done_waiting(name, waited)

    async def aacquire(self, name: str, limits: UpstreamLimits) -> Grant:
        """`acquire` for a coroutine: it waits in `asyncio.sleep`, not on a thread."""
        await asyncio.to_thread(self.configure)
        holder, retry = uuid.uuid4().hex, _RETRYING.get()
        waited, polls = False, 0
        try:
            while True:
                row, asked, replied = await asyncio.to_thread(self._ask, name, limits, holder, retry, waited)
                if (grant := self._granted(name, limits, row, holder, retry)) is not None:
                    if row.wait > 0:
                        try:
                            await self.asleep(float(row.wait))
                        except BaseException:  # cancelled while the grant waits: its slot goes back now
                            await asyncio.to_thread(self._release, grant)
                            raise
                    if self._on_time(limits, row, asked, replied):
                        return grant
                    await asyncio.to_thread(self._release, grant)
                    continue
                waited, polls = self._waiting(name, waited), polls + 1
                await self.asleep(wait_before_asking_again(float(row.wait), polls, self.poll_seconds,
                                                             self._jitter.random()))
        finally:
            self._done_waiting(name, waited)

    def _reserved(self, grant: Grant, wait: Callable[[], None]) -> None:
        """Wait for a reserved grant's time; a caller stopped meanwhile gives its slot back at once."""
        try:
            wait()
        except BaseException:
            self._release(grant)
            raise

    def _on_time(self, limits: UpstreamLimits, row: Any, asked: float, replied: float) -> bool:
        """Whether a rate grant is still sent in its place: a caller that gets to send more than `late_seconds`
        after the grant's time (a busy event loop, a starved machine) would arrive at the provider bunched with
        the grants after it and push a 1 s window over the rate; it gives the grant back and asks again."""
        if not limits.rate_per_second:
            return True
        now = self.monotonic()
        return grant_lateness(now - replied, now - asked, self._wall() - float(row.answered)) - float(row.wait) \
            <= self.late_seconds

    def _wall(self) -> float:
        """Epoch seconds on the clock `answered` is read on: the database's for the system clock (one
        machine's clocks agree; `grant_lateness` bounds what another machine's skew can do), else the injected one."""
        return time.time() if isinstance(self.clock, SystemClock) else self.clock.now().timestamp()

    def _ask(self, name: str, limits: UpstreamLimits, holder: str, retry: bool,
             waited: bool) -> tuple[Any, float, float]:
        """One round trip to the acquire function: a slot, or how long to wait and why; and when it was asked
        and when it answered (`monotonic()`, taken on the asking thread)."""
        asked = self.monotonic()
        row = _once_more_if_dropped(lambda conn: conn.execute(_ACQUIRE, {
            "name": name, "holder": holder, "now": self._now(), "lease": limits.lease_seconds,
            "retry": retry, "waited": waited}).one(), self._autocommit)
        return row, asked, self.monotonic()

    def _granted(self, name: str, limits: UpstreamLimits, row: Any, holder: str, retry: bool) -> Grant | None:
        """The grant the row gives, or None to wait and ask again; raises RetryDeferred over the budget (and the
        first denial of an episode writes the one alert)."""
        if row.slot is not None:
            if retry:
                _RETRYING.set(False)  # the entity's next calls are not retries
            return Grant(name, row.slot, holder, retry=retry and limits.retry_share is not None)
        if row.reason == "retry_budget":
            if row.new_episode and self.on_exhausted is not None:
                try:
                    self.on_exhausted(name)
                except Exception:  # noqa: BLE001 - the alert sensor retries pending deliveries
                    log.warning("upstream %s: retry-budget alert could not be written", name)
            raise RetryDeferred(name, float(row.wait))
        return None

    def _waiting(self, name: str, waited: bool) -> bool:
        if not waited:
            with self._lock:
                self.waiting[name] = self.waiting.get(name, 0) + 1
        return True

    def _done_waiting(self, name: str, waited: bool) -> None:
        if waited:
            with self._lock:
                self.waiting[name] -= 1

    def _release(self, grant: Grant) -> None:
        if grant.slot <= 0:
            return
        try:
            _once_more_if_dropped(lambda conn: release(conn, grant.upstream, grant.slot, grant.holder),
                                  self._autocommit)
        except Exception:  # noqa: BLE001 - the slot's lease ends and it comes back by itself
            log.warning("upstream %s: slot %s not released; it comes back when its lease ends",
                        grant.upstream, grant.slot)

    def _retry_answered(self, grant: Grant) -> None:
        try:
            _once_more_if_dropped(lambda conn: retry_answered(conn, grant.upstream, self._now()), self._autocommit)
        except Exception:  # noqa: BLE001 - the share comes back anyway when the window slides past it
            log.warning("upstream %s: a good answer to a retry was not recorded", grant.upstream)

    def _wait_out(self, name: str, limits: UpstreamLimits, asked: float | None, throttled: int) -> bool:
        """Pause `name` for every worker as the provider asked; True when this caller sends again after it."""
        wait = min(asked if asked is not None and asked >= 0 else 1.0, limits.max_pause_seconds)
        with self.engine.begin() as conn:
            pause(conn, name, self._now(), wait)
        log.info("upstream %s answered 429: paused for every worker for %.1f s", name, wait)
        return throttled < limits.throttle_retries and (asked or 0.0) <= limits.max_pause_seconds


def _throttled(outcome: object) -> float | None:
    """How long a 429 asked us to wait (`Retry-After`, -1 when it did not say); None when not a 429. Takes a
    response, an `httpx.HTTPStatusError`, or a classified `RedriveError` (whose failure kept the status)."""
    response = outcome.response if isinstance(outcome, httpx.HTTPStatusError) else outcome
    if isinstance(response, httpx.Response):
        if response.status_code != 429:
            return None
        asked = parse_retry_after(response.headers.get("retry-after"), datetime.now(UTC))
        return asked if asked is not None else -1.0
    if isinstance(outcome, RedriveError) and outcome.failure.upstream_status == 429:
        return outcome.failure.retry_after if outcome.failure.retry_after is not None else -1.0
    return None


def _answered_well(result: object) -> bool:
    """A call that returned: good unless it returned an HTTP error response (resources that check the status
    after the guarded call return those)."""
    return not (isinstance(result, httpx.Response) and result.status_code >= 400)


@per_process(maxsize=8)
def limiter_engine(url: sa.URL) -> sa.Engine:
    """The limiter's own pool on the database: autocommit (the acquire function is its own transaction, so a
    call is one round trip, not BEGIN, call, COMMIT), no pre-ping (another round trip per checkout: a
    connection the server dropped fails once and is retried), and room for 32 threads asking at once (more wait
    their turn for a connection, a millisecond each: a process must not take the database's connections). Only 4
    stay open: keeping 16 in every run worker, with its main pool's, held more connections than a 100-connection
    server has once 5 matching or 8 evidence runs ran at once; a burst above 4 opens and closes backends."""
    # synchronous_commit off: a slot taken or given back is not worth a WAL flush each; a crash forgets at most
    # the last few ms of them, and leases and the rate window heal from that on their own
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", pool_pre_ping=False, pool_size=4, max_overflow=28,
                            connect_args={"options": "-c synchronous_commit=off"})


def _once_more_if_dropped(statement: Callable[[sa.Connection], T], engine: sa.Engine) -> T:
    """Run `statement` on a pooled connection; once more on a fresh one if the server had dropped it."""
    for tries in (1, 2):
        try:
            with engine.connect() as conn:
                return statement(conn)
        except sa.exc.DBAPIError as exc:
            if tries == 2 or not exc.connection_invalidated:
                raise
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------------------- process registry

_INSTALLED: Upstreams | None = None


def install(upstreams: Upstreams | None) -> None:
    """Make `upstreams` the limits every resource of this process calls through (None: no limits)."""
    global _INSTALLED
    _INSTALLED = upstreams


def installed() -> Upstreams | None:
    return _INSTALLED


def install_once(engine: sa.Engine, limits: Mapping[str, UpstreamLimits], clock: Clock,
                 on_exhausted: Callable[[str], None] | None) -> Upstreams | None:
    """Install limits for this process unless the same ones are installed on the same engine already (a
    run builds its runtime many times); nothing when no upstream is limited."""
    active = {name: value for name, value in limits.items() if value.active}
    current = _INSTALLED
    if current is not None and current.engine is engine and dict(current.limits) == active:
        return current
    install(Upstreams(engine, active, clock=clock, on_exhausted=on_exhausted) if active else None)
    return _INSTALLED


def guarded(name: str, fn: Callable[[], T]) -> T:
    """`fn()` within `name`'s limits when this process has them, else `fn()` as it is."""
    upstreams = _INSTALLED
    if upstreams is None:
        return fn()
    return upstreams.call(name, fn)


async def aguarded(name: str, fn: Callable[[], Awaitable[T]]) -> T:
    """`await fn()` within `name`'s limits when this process has them (a coroutine handler's calls)."""
    upstreams = _INSTALLED
    if upstreams is None:
        return await fn()
    return await upstreams.acall(name, fn)
