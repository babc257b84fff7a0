"""Injected time: the system clock is UTC-aware; the frozen clock moves only when told."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from redrive.clock import Clock, FrozenClock, SystemClock, as_utc


def test_system_clock_is_tz_aware_utc() -> None:
    """SystemClock.now() is an aware UTC datetime and monotonic() never goes back."""
    clock = SystemClock()
    now = clock.now()
    assert now.tzinfo is not None and now.utcoffset() == timedelta(0)
    first = clock.monotonic()
    assert clock.monotonic() >= first


def test_frozen_clock_sleep_advances_instead_of_waiting() -> None:
    """Sleeping 30 minutes on a FrozenClock moves it 30 minutes and records the request."""
    clock = FrozenClock(datetime(2026, 2, 26, 12, 0, tzinfo=UTC))
    clock.sleep(1800.0)
    assert clock.now() == datetime(2026, 2, 26, 12, 30, tzinfo=UTC)
    assert clock.monotonic() == 1800.0
    assert clock.sleeps == [1800.0]


def test_frozen_clock_stands_still_unless_advanced() -> None:
    """Reading a FrozenClock twice gives the same time; advance() moves it forward."""
    clock = FrozenClock()
    assert clock.now() == clock.now()
    before = clock.now()
    assert clock.advance(5) == before + timedelta(seconds=5)


def test_frozen_clock_refuses_to_go_backwards() -> None:
    """advance() with a negative duration is a test bug and raises."""
    with pytest.raises(ValueError):
        FrozenClock().advance(-1)


def test_frozen_clock_normalises_start_to_utc() -> None:
    """A start in another zone is stored as the same instant in UTC."""
    cet = timezone(timedelta(hours=1))
    clock = FrozenClock(datetime(2026, 2, 26, 13, 0, tzinfo=cet))
    assert clock.now() == datetime(2026, 2, 26, 12, 0, tzinfo=UTC)
    assert clock.now().tzinfo == UTC


def test_naive_datetimes_are_rejected() -> None:
    """A naive datetime has no zone, so as_utc and FrozenClock refuse it."""
    naive = datetime(2026, 2, 26, 12, 0)  # noqa: DTZ001 - the point of the test
    with pytest.raises(ValueError, match="naive"):
        as_utc(naive)
    with pytest.raises(ValueError):
        FrozenClock(naive)


def test_both_clocks_satisfy_the_protocol() -> None:
    """SystemClock and FrozenClock are both Clocks."""
    assert isinstance(SystemClock(), Clock) and isinstance(FrozenClock(), Clock)
