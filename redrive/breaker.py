"""A circuit breaker in hold-queue mode whose window lives in Postgres, so every worker sees one state (003 §3.3).

Pure part — :class:`BreakerPolicy`, :func:`should_open`, :func:`probe_due`, :func:`counts_as_failure` —
decides from values. The Postgres part keeps two tables: ``circuit_breakers`` (one row per breaker:
state, when it opened, how often, open time so far) and ``circuit_breaker_calls`` (outcome and duration
of each guarded call). The window is the newest ``policy.window`` calls since the breaker last closed.
:class:`CircuitBreaker` binds both to an engine and a clock for callers.

Hold-queue mode, no HALF_OPEN (003 §2, §4 "later"): while open, callers dispatch nothing and leave
their work queued. After a cooldown exactly one caller, in any process, wins the right to probe
(``UPDATE … RETURNING``); a healthy probe closes the breaker and starts a fresh window, so the
failures that opened it cannot open it again at once. Transitions are conditional updates, so two
workers that see the same window report one transition between them (one log line, one alert).

Any pipeline can guard an upstream with it: ``CircuitBreaker(engine, "pdf-gateway", policy)``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Literal

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from redrive.clock import Clock, SystemClock
from redrive.schema import NOW, TZ, metadata

if TYPE_CHECKING:  # `redrive breaker` reads states without loading every client library redrive.failures knows
    from redrive.failures import Failure

__all__ = [
    "BreakerPolicy",
    "BreakerState",
    "CircuitBreaker",
    "Transition",
    "breaker_calls",
    "circuit_breakers",
    "counts_as_failure",
    "failure_rate",
    "probe_due",
    "should_open",
]

log = logging.getLogger(__name__)

CLOSED, OPEN = "closed", "open"

circuit_breakers = sa.Table(
    "circuit_breakers",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("state", sa.Text, nullable=False, server_default=CLOSED),
    sa.Column("opened_at", TZ),
    sa.Column("closed_at", TZ),
    sa.Column("last_probe_at", TZ),
    sa.Column("open_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("open_seconds_total", sa.Float, nullable=False, server_default="0"),
    # calls with an id at or below this are from before the last close: outside the window
    sa.Column("window_floor", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    sa.CheckConstraint("state IN ('closed', 'open')", name="state"),
    sa.CheckConstraint("state = 'closed' OR opened_at IS NOT NULL", name="open_has_opened_at"),
)

breaker_calls = sa.Table(
    "circuit_breaker_calls",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("breaker", sa.Text, nullable=False),
    sa.Column("ok", sa.Boolean, nullable=False),
    sa.Column("duration_ms", sa.Float),
    sa.Column("at", TZ, nullable=False),
    sa.Index("ix_circuit_breaker_calls_breaker_id", "breaker", "id"),
)

KEEP_CALLS = 1000
"""Calls kept per breaker (the window and the latency quantiles read only the newest ones)."""
_PRUNE_EVERY = 256


# ---------------------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class BreakerPolicy:
    """003 §3.3: open at >= 50 % failures of the last 20 calls; probe again after a cooldown.

    ``min_calls`` keeps a nearly empty window (one failed call out of one) from opening the breaker;
    003 is silent on it, we take half the window.
    """

    window: int = 20
    failure_threshold: float = 0.5
    min_calls: int = 10
    cooldown: float = 30.0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 0.0 < self.failure_threshold <= 1.0:
            raise ValueError(f"failure_threshold must be in (0, 1], got {self.failure_threshold}")
        if not 1 <= self.min_calls <= self.window:
            raise ValueError(f"min_calls must be within [1, window={self.window}], got {self.min_calls}")
        if not (math.isfinite(self.cooldown) and self.cooldown >= 0):
            raise ValueError(f"cooldown must be a finite number of seconds >= 0, got {self.cooldown}")


def failure_rate(outcomes: Sequence[bool]) -> float:
    """Share of failed calls (``False``) among ``outcomes``; 0.0 for none."""
    return sum(1 for ok in outcomes if not ok) / len(outcomes) if outcomes else 0.0


def should_open(outcomes: Sequence[bool], policy: BreakerPolicy) -> bool:
    """Whether a closed breaker opens, given the newest calls first (``True`` = ok)."""
    window = list(outcomes)[: policy.window]
    return len(window) >= policy.min_calls and failure_rate(window) >= policy.failure_threshold


@dataclass(frozen=True)
class BreakerState:
    name: str
    state: str
    opened_at: datetime | None
    last_probe_at: datetime | None
    open_count: int
    open_seconds_total: float
    window_floor: int

    @property
    def is_open(self) -> bool:
        return self.state == OPEN

    def open_seconds(self, now: datetime) -> float:
        """Time spent open so far, the current opening included."""
        current = (now - self.opened_at).total_seconds() if self.is_open and self.opened_at else 0.0
        return self.open_seconds_total + max(0.0, current)


def probe_due(state: BreakerState, now: datetime, policy: BreakerPolicy) -> bool:
    """An open breaker may be probed once the cooldown has passed since it opened or was last probed."""
    if not state.is_open:
        return False
    since = state.last_probe_at or state.opened_at
    return since is None or now - since >= timedelta(seconds=policy.cooldown)


# redrive.failures.Code values (a StrEnum: a code compares equal to its name)
_BREAKER_FAILURES = frozenset(
    {"NETWORK_TIMEOUT", "NETWORK_ERROR", "UPSTREAM_UNAVAILABLE", "UPSTREAM_INTERNAL", "RATE_LIMITED"}
)


def counts_as_failure(failure: Failure) -> bool:
    """003 §3.3 counts 5xx and timeouts (and unreachable or overloaded upstreams); a 4xx is the caller's fault."""
    return failure.core in _BREAKER_FAILURES


@dataclass(frozen=True)
class Transition:
    """A state change one caller carried out: what to log and alert, exactly once across workers."""

    breaker: str
    to: Literal["open", "closed"]
    at: datetime
    open_count: int
    failure_rate: float = 0.0
    open_seconds: float = 0.0


# ------------------------------------------------------------------------------------------ repository


def ensure(conn: sa.Connection, name: str) -> None:
    conn.execute(insert(circuit_breakers).values(name=name).on_conflict_do_nothing(index_elements=["name"]))


def get_state(conn: sa.Connection, name: str) -> BreakerState:
    """The breaker's state; a breaker never used is closed."""
    row = conn.execute(sa.select(circuit_breakers).where(circuit_breakers.c.name == name)).first()
    if row is None:
        return BreakerState(name, CLOSED, None, None, 0, 0.0, 0)
    return BreakerState(row.name, row.state, row.opened_at, row.last_probe_at, row.open_count,
                        row.open_seconds_total, row.window_floor)


def all_states(conn: sa.Connection) -> list[BreakerState]:
    """Every breaker that has guarded a call, by name (what `redrive breaker` shows): one that has opened has a
    row of its own, one that never opened only its calls (issue 27: it was missing from the list)."""
    names = conn.execute(sa.union(sa.select(circuit_breakers.c.name),
                                  sa.select(breaker_calls.c.breaker).distinct()).order_by("name")).scalars().all()
    return [get_state(conn, name) for name in names]


def window(conn: sa.Connection, name: str, floor: int, size: int) -> list[bool]:
    """Outcomes of the newest ``size`` calls after ``floor``, newest first."""
    rows = conn.execute(
        sa.select(breaker_calls.c.ok)
        .where(breaker_calls.c.breaker == name, breaker_calls.c.id > floor)
        .order_by(breaker_calls.c.id.desc())
        .limit(size)
    )
    return [r.ok for r in rows]


def record_call(conn: sa.Connection, name: str, ok: bool, duration_ms: float | None, at: datetime,
                policy: BreakerPolicy) -> Transition | None:
    """Append a call to the window and open the breaker if the window says so; the opener gets the transition."""
    call_id = conn.execute(
        sa.insert(breaker_calls).values(breaker=name, ok=ok, duration_ms=duration_ms, at=at).returning(breaker_calls.c.id)
    ).scalar_one()
    if call_id % _PRUNE_EVERY == 0:
        _prune(conn, name)
    if ok:
        return None  # a success never opens a breaker
    state = get_state(conn, name)
    if state.is_open:
        return None
    outcomes = window(conn, name, state.window_floor, policy.window)
    if not should_open(outcomes, policy):
        return None
    ensure(conn, name)
    row = conn.execute(
        sa.update(circuit_breakers)
        .where(circuit_breakers.c.name == name, circuit_breakers.c.state == CLOSED)
        .values(state=OPEN, opened_at=at, last_probe_at=None, open_count=circuit_breakers.c.open_count + 1,
                updated_at=at)
        .returning(circuit_breakers.c.open_count)
    ).first()
    if row is None:
        return None  # another worker opened it first
    return Transition(name, OPEN, at, row.open_count, failure_rate=failure_rate(outcomes))


OK_CALLS_CTE = ("INSERT INTO circuit_breaker_calls (breaker, ok, duration_ms, at) "
                "SELECT {breaker}, true, ms, {at} FROM unnest({durations}) AS c(ms) RETURNING id")
"""Healthy calls appended in bulk, as a CTE a caller folds into its own write (a success never opens a
breaker, so no window read is needed); the caller calls :func:`prune_if_due` with the ids it got back."""


def prune_due(first_id: int, last_id: int) -> bool:
    """Whether appending call ids ``first_id..last_id`` crossed a pruning mark (a caller that holds no
    connection asks first, so most turns open none)."""
    return last_id // _PRUNE_EVERY > (first_id - 1) // _PRUNE_EVERY


def prune_if_due(conn: sa.Connection, name: str, first_id: int, last_id: int) -> None:
    """Keep the window table bounded when ids ``first_id..last_id`` crossed a pruning mark."""
    if prune_due(first_id, last_id):
        _prune(conn, name)


def claim_probe(conn: sa.Connection, name: str, now: datetime, policy: BreakerPolicy) -> bool:
    """Win the right to probe an open breaker whose cooldown passed; one winner per cooldown, across processes."""
    due_before = now - timedelta(seconds=policy.cooldown)
    row = conn.execute(
        sa.update(circuit_breakers)
        .where(
            circuit_breakers.c.name == name,
            circuit_breakers.c.state == OPEN,
            sa.func.coalesce(circuit_breakers.c.last_probe_at, circuit_breakers.c.opened_at) <= due_before,
        )
        .values(last_probe_at=now, updated_at=now)
        .returning(circuit_breakers.c.name)
    ).first()
    return row is not None


def close(conn: sa.Connection, name: str, now: datetime) -> Transition | None:
    """Close an open breaker and start a fresh window; None when it was not open."""
    floor = sa.select(sa.func.coalesce(sa.func.max(breaker_calls.c.id), 0)).where(
        breaker_calls.c.breaker == name).scalar_subquery()
    open_for = sa.func.extract("epoch", sa.literal(now, TZ) - circuit_breakers.c.opened_at)
    row = conn.execute(
        sa.update(circuit_breakers)
        .where(circuit_breakers.c.name == name, circuit_breakers.c.state == OPEN)
        .values(state=CLOSED, closed_at=now, opened_at=None, last_probe_at=None, window_floor=floor,
                open_seconds_total=circuit_breakers.c.open_seconds_total + sa.func.greatest(open_for, 0),
                updated_at=now)
        .returning(circuit_breakers.c.open_count, circuit_breakers.c.open_seconds_total)
    ).first()
    if row is None:
        return None
    return Transition(name, CLOSED, now, row.open_count, open_seconds=row.open_seconds_total)


def latency_quantile(conn: sa.Connection, name: str, q: float, last: int = KEEP_CALLS) -> float | None:
    """The ``q`` quantile of the newest ``last`` call durations in milliseconds (None without calls)."""
    recent = (
        sa.select(breaker_calls.c.duration_ms)
        .where(breaker_calls.c.breaker == name, breaker_calls.c.duration_ms.is_not(None))
        .order_by(breaker_calls.c.id.desc())
        .limit(last)
        .subquery()
    )
    value = conn.execute(
        sa.select(sa.func.percentile_cont(q).within_group(recent.c.duration_ms))
    ).scalar()
    return float(value) if value is not None else None


def _prune(conn: sa.Connection, name: str) -> None:
    oldest_kept = (
        sa.select(breaker_calls.c.id)
        .where(breaker_calls.c.breaker == name)
        .order_by(breaker_calls.c.id.desc())
        .offset(KEEP_CALLS)
        .limit(1)
        .scalar_subquery()
    )
    conn.execute(sa.delete(breaker_calls).where(breaker_calls.c.breaker == name, breaker_calls.c.id <= oldest_kept))


# ---------------------------------------------------------------------------------------------- facade


@dataclass
class CircuitBreaker:
    """One named breaker on an engine: ask ``allows()``, report each call with ``record()``, ``probe()`` while open."""

    engine: sa.Engine
    name: str
    policy: BreakerPolicy = BreakerPolicy()
    clock: Clock = SystemClock()

    def state(self) -> BreakerState:
        with self.engine.connect() as conn:
            return get_state(conn, self.name)

    def allows(self) -> bool:
        """Closed: dispatch. Open: hold the queue (003 §3.3)."""
        return not self.state().is_open

    def record(self, ok: bool, duration_ms: float | None = None) -> Transition | None:
        with self.engine.begin() as conn:
            return record_call(conn, self.name, ok, duration_ms, self.clock.now(), self.policy)

    def record_failure(self, failure: Failure, duration_ms: float | None = None) -> Transition | None:
        """Record a failed call; only 5xx, timeouts and unreachable upstreams count against the upstream."""
        return self.record(not counts_as_failure(failure), duration_ms)

    def probe(self, healthy: Callable[[], bool]) -> Transition | None | Literal[False]:
        """If a probe is due and this caller wins it, run ``healthy()``; close on success.

        Returns the closing transition, ``None`` when no probe was due (or another caller probes),
        and ``False`` when this caller probed and the upstream is still unhealthy.
        """
        now = self.clock.now()
        with self.engine.begin() as conn:
            if not claim_probe(conn, self.name, now, self.policy):
                return None
        try:
            ok = bool(healthy())
        except Exception:  # noqa: BLE001 - an exploding probe is an unhealthy upstream
            log.info("breaker %s: probe raised; staying open", self.name)
            ok = False
        if not ok:
            return False
        with self.engine.begin() as conn:
            return close(conn, self.name, self.clock.now())

    def latency_p95(self) -> float | None:
        with self.engine.connect() as conn:
            return latency_quantile(conn, self.name, 0.95)
