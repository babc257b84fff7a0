"""The core circuit breaker (003 §3.3): pure thresholds, and its shared state in PostgreSQL."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from redrive.breaker import (
    BreakerPolicy,
    BreakerState,
    CircuitBreaker,
    breaker_calls,
    counts_as_failure,
    failure_rate,
    probe_due,
    prune_due,
    should_open,
)
from redrive.clock import FrozenClock
from redrive.failures import Code, Failure

POLICY = BreakerPolicy(window=20, failure_threshold=0.5, min_calls=10, cooldown=30)


@pytest.mark.parametrize(
    ("outcomes", "opens"),
    [
        ([False] * 10 + [True] * 10, True),  # exactly 50 % of 20: opens (>=)
        ([False] * 9 + [True] * 11, False),  # 45 %
        ([False] * 9, False),  # 100 % but only 9 calls: below min_calls
        ([False] * 5 + [True] * 5, True),  # 10 calls, 50 %
        ([True] * 20 + [False] * 20, False),  # failures older than the last 20 calls do not count
        ([], False),
    ],
)
def test_should_open_at_half_of_the_last_twenty_calls(outcomes: list[bool], opens: bool) -> None:
    """The breaker opens at >= 50 % failures among the newest 20 calls, once at least 10 were made."""
    assert should_open(outcomes, POLICY) is opens


@given(st.lists(st.booleans(), max_size=60))
def test_should_open_only_looks_at_the_window(outcomes: list[bool]) -> None:
    """Whatever happened before the newest `window` calls never changes the decision."""
    assert should_open(outcomes, POLICY) == should_open(outcomes[:20], POLICY)
    assert 0.0 <= failure_rate(outcomes) <= 1.0


def test_policy_rejects_nonsense() -> None:
    """A threshold of 0 or a min_calls larger than the window is a configuration error, said at once."""
    with pytest.raises(ValueError):
        BreakerPolicy(failure_threshold=0)
    with pytest.raises(ValueError):
        BreakerPolicy(window=5, min_calls=6)


def test_only_5xx_timeouts_and_unreachable_count_as_failures() -> None:
    """003 §3.3 counts 5xx and timeouts; a 4xx or a bad payload says nothing about the gateway's health."""
    assert counts_as_failure(Failure.of(Code.UPSTREAM_UNAVAILABLE))
    assert counts_as_failure(Failure.of(Code.NETWORK_TIMEOUT))
    assert counts_as_failure(Failure.of(Code.NETWORK_ERROR))
    assert not counts_as_failure(Failure.of(Code.BAD_REQUEST))
    assert not counts_as_failure(Failure.of(Code.PARSE_ERROR))
    assert counts_as_failure(Failure.of(Code.UPSTREAM_INTERNAL).as_code("GW_5XX", retryable=True))


def test_probe_due_after_the_cooldown_only() -> None:
    """An open breaker is probed once the cooldown has passed since it opened or was last probed."""
    clock = FrozenClock()
    opened = BreakerState("gw", "open", clock.now(), None, 1, 0.0, 0)
    assert not probe_due(opened, clock.advance(29), POLICY)
    assert probe_due(opened, clock.advance(1), POLICY)
    probed = BreakerState("gw", "open", opened.opened_at, clock.now(), 1, 0.0, 0)
    assert not probe_due(probed, clock.advance(10), POLICY)
    assert not probe_due(BreakerState("gw", "closed", None, None, 0, 0.0, 0), clock.now(), POLICY)


def test_shared_state_opens_once_probes_once_and_closes_with_a_fresh_window(engine: sa.Engine) -> None:
    """Two processes' view is one row: it opens once, one caller wins each probe, closing forgets the old failures."""
    clock = FrozenClock()
    a = CircuitBreaker(engine, "gw", POLICY, clock)
    b = CircuitBreaker(engine, "gw", POLICY, clock)  # another worker, same table
    transitions = []
    for i in range(10):
        transitions.append((a if i % 2 else b).record(ok=False, duration_ms=5.0))
    opened = [t for t in transitions if t is not None]
    assert len(opened) == 1 and opened[0].to == "open" and opened[0].open_count == 1
    assert not a.allows() and not b.allows()
    assert a.record(ok=False) is None  # already open: no second transition

    assert a.probe(lambda: True) is None  # cooldown not over
    clock.advance(30)
    assert a.probe(lambda: False) is False  # a won and the gateway is still down
    assert b.probe(lambda: True) is None  # the same cooldown: only one probe
    clock.advance(30)
    closed = b.probe(lambda: True)
    assert closed is not None and closed is not False and closed.to == "closed"
    assert closed.open_seconds == pytest.approx(60.0)
    assert a.allows()
    assert a.record(ok=False) is None  # the 10 old failures are outside the new window
    assert a.state().open_seconds(clock.now()) == pytest.approx(60.0)


def test_concurrent_recorders_open_it_exactly_once(engine: sa.Engine) -> None:
    """Eight threads failing at once: one of them carries out the transition, the rest see it open."""
    breaker = CircuitBreaker(engine, "gw", POLICY)
    results: list[object] = []
    barrier = threading.Barrier(8)

    def fail_twice() -> None:
        barrier.wait()
        for _ in range(2):
            results.append(breaker.record(ok=False))

    threads = [threading.Thread(target=fail_twice) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len([r for r in results if r is not None]) == 1
    assert breaker.state().open_count == 1


def test_a_probe_that_raises_keeps_it_open(engine: sa.Engine) -> None:
    """An exploding health check is an unhealthy gateway, not a crash of the caller."""
    clock = FrozenClock()
    breaker = CircuitBreaker(engine, "gw", BreakerPolicy(window=2, min_calls=2, cooldown=0), clock)
    breaker.record(ok=False), breaker.record(ok=False)

    def boom() -> bool:
        raise ConnectionError("down")

    assert breaker.probe(boom) is False
    assert not breaker.allows()


def test_latency_quantile_reads_recent_calls(engine: sa.Engine) -> None:
    """p95 of call durations over the kept calls, for the gateway latency gauge."""
    breaker = CircuitBreaker(engine, "gw", POLICY)
    for ms in range(1, 101):
        breaker.record(ok=True, duration_ms=float(ms))
    assert breaker.latency_p95() == pytest.approx(95.05)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(breaker_calls)).scalar() == 100


@given(st.integers(min_value=1, max_value=10_000), st.integers(min_value=0, max_value=600))
def test_a_batch_of_calls_prunes_exactly_when_it_crosses_a_pruning_mark(first: int, extra: int) -> None:
    """The worker asks `prune_due` before it opens a connection: ids first..last cross a mark of every 256th id."""
    last = first + extra
    crosses = any(i % 256 == 0 for i in range(first, last + 1))
    assert prune_due(first, last) is crosses
