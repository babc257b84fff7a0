"""Injected time: a clock and a sleep function, so policies and loops are testable without waiting.

STYLE §8: nothing in the core calls ``datetime.now()`` or ``time.sleep()`` directly; it is handed
a :class:`Clock` and a :data:`Sleep`. :class:`FrozenClock` lets a 30-minute backoff run in a test in
milliseconds: its ``sleep`` moves time forward instead of blocking.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "FrozenClock", "Sleep", "SystemClock", "as_utc"]

Sleep = Callable[[float], None]
"""Blocks (or pretends to) for the given number of seconds."""


@runtime_checkable
class Clock(Protocol):
    """Where the core reads time from; wall time for records, monotonic time for durations."""

    def now(self) -> datetime:
        """Current wall time, tz-aware, in UTC."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards; only differences mean anything."""
        ...


def as_utc(value: datetime) -> datetime:
    """Return ``value`` in UTC; a naive datetime is rejected because its zone is a guess."""
    if value.tzinfo is None or value.tzinfo.utcoffset(value) is None:
        raise ValueError(f"naive datetime {value.isoformat()} has no timezone; pass a tz-aware UTC time")
    return value.astimezone(UTC)


@dataclass(frozen=True)
class SystemClock:
    """The real clock; the only place the core touches the system time."""

    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        """Really block; kept here so callers can pass ``clock.sleep`` as their :data:`Sleep`."""
        if seconds > 0:
            time.sleep(seconds)


class FrozenClock:
    """A clock that only moves when told to; ``sleep`` advances it and records the request.

    Mutable on purpose (it *is* the passage of time in a test); everything else in the core is frozen.
    """

    def __init__(self, start: datetime | None = None) -> None:
        self._now = as_utc(start) if start is not None else datetime(2026, 1, 1, tzinfo=UTC)
        self._monotonic = 0.0
        self.sleeps: list[float] = []
        """Every duration passed to :meth:`sleep`, in order; tests assert on it."""

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, seconds: float) -> datetime:
        """Move both clocks forward by ``seconds`` (never backwards) and return the new now."""
        if seconds < 0:
            raise ValueError(f"time does not go backwards: advance({seconds})")
        self._now += timedelta(seconds=seconds)
        self._monotonic += seconds
        return self._now

    def sleep(self, seconds: float) -> None:
        """Pretend to sleep: record the duration and advance the clock by it, at once."""
        self.sleeps.append(seconds)
        self.advance(max(0.0, seconds))

    def __repr__(self) -> str:
        return f"FrozenClock({self._now.isoformat()})"
