"""Backoff as small pure functions: how long to wait after a failed attempt.

Every policy answers ``delay(attempt, rng, server_delay)`` where **attempt is 1-based and names the
attempt that just failed**: after the first call fails, ``attempt == 1`` and the answer is the wait
before the second call. Randomness comes from the ``rng`` passed in, so a seeded ``random.Random``
makes any schedule reproducible; time is never read here.

A server's ``Retry-After`` (``server_delay``) is honoured the same way in every policy:
``max(calculated, min(server_delay, retry_after_ceiling))`` — it can lengthen a wait up to the
ceiling, never shorten one. With the ceiling at or above the policy's own maximum this is exactly
002 §8.2's ``min(max(calculated, retry_after), ceiling)``.

Every policy has ``floor`` and ``cap`` (no delay is ever outside them) and ``scaled(factor)``, which
multiplies every duration so configuration can shrink a 30-minute schedule to milliseconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol, Self, runtime_checkable

__all__ = [
    "CONVERSION_BACKOFF",
    "CRITICIZER_BACKOFF",
    "DEFAULT_RETRY_AFTER_CEILING",
    "EVIDENCE_BACKOFF",
    "MATCHING_LLM_BACKOFF",
    "MATCHING_VISIBILITY_BACKOFF",
    "MATCHMAKING_BACKOFF",
    "BackoffPolicy",
    "ExponentialPlusJitter",
    "FixedSchedule",
    "FullJitter",
    "MultiplicativeJitter",
    "honor_server_delay",
]

DEFAULT_RETRY_AFTER_CEILING = 300.0
"""002 §8.2's operational ceiling (5 minutes); also our choice for seeds that name none."""


@runtime_checkable
class BackoffPolicy(Protocol):
    """Seconds to wait after failed attempt ``attempt`` (1-based), within ``[floor, cap]``."""

    @property
    def floor(self) -> float: ...

    @property
    def cap(self) -> float: ...

    def delay(self, attempt: int, rng: random.Random, server_delay: float | None = None) -> float: ...

    def scaled(self, factor: float) -> Self: ...


def honor_server_delay(calculated: float, server_delay: float | None, ceiling: float) -> float:
    """Lengthen ``calculated`` to a server's requested delay, but never past ``ceiling``.

    A missing, negative or non-finite server delay is ignored: a bad header must not stall a job.
    """
    if server_delay is None or not math.isfinite(server_delay) or server_delay <= 0:
        return calculated
    return max(calculated, min(server_delay, ceiling))


def _check_attempt(attempt: int) -> None:
    if attempt < 1:
        raise ValueError(f"attempt is 1-based (the attempt that just failed); got {attempt}")


def _check_factor(factor: float) -> None:
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"scale factor must be a positive number, got {factor}")


def _exponential(initial: float, multiplier: float, exponent: int, limit: float) -> float:
    """``min(limit, initial * multiplier**exponent)`` without overflowing for huge attempts."""
    if initial <= 0:
        return 0.0
    if multiplier <= 1.0:
        return min(limit, initial)
    # once the product passes the limit it stays there; stop before float overflow.
    if exponent > math.log(max(limit, 1e-300) / initial, multiplier) + 1:
        return limit
    return min(limit, initial * multiplier**exponent)


def _nonneg(**values: float) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True)
class FullJitter:
    """002 §8.2: ``random(0, min(max_delay, initial * multiplier**(attempt-1)))``, drawn afresh each attempt."""

    initial: float = 1.0
    multiplier: float = 2.0
    max_delay: float = 60.0
    retry_after_ceiling: float = DEFAULT_RETRY_AFTER_CEILING

    def __post_init__(self) -> None:
        _nonneg(initial=self.initial, max_delay=self.max_delay, retry_after_ceiling=self.retry_after_ceiling)
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")

    @property
    def floor(self) -> float:
        return 0.0

    @property
    def cap(self) -> float:
        return max(self.max_delay, self.retry_after_ceiling)

    def delay(self, attempt: int, rng: random.Random, server_delay: float | None = None) -> float:
        _check_attempt(attempt)
        ceiling = _exponential(self.initial, self.multiplier, attempt - 1, self.max_delay)
        return honor_server_delay(rng.uniform(0.0, ceiling), server_delay, self.retry_after_ceiling)

    def scaled(self, factor: float) -> FullJitter:
        _check_factor(factor)
        return FullJitter(
            self.initial * factor, self.multiplier, self.max_delay * factor, self.retry_after_ceiling * factor
        )


@dataclass(frozen=True)
class ExponentialPlusJitter:
    """003 §3.2: ``base * 2**k + uniform(0, jitter)``.

    003 counts ``attempt`` from 0 for the first retry; here ``k = attempt - 1``, so after the first
    failure (attempt 1) the wait is ``base * 2**0 + jitter`` = 5-10 s, then 10-15 s. 003 names no cap;
    ``max_delay`` (default 300 s) only guards a misconfigured budget, since 3 attempts never reach it.
    """

    base: float = 5.0
    jitter: float = 5.0
    max_delay: float = 300.0
    retry_after_ceiling: float = DEFAULT_RETRY_AFTER_CEILING

    def __post_init__(self) -> None:
        _nonneg(
            base=self.base, jitter=self.jitter, max_delay=self.max_delay, retry_after_ceiling=self.retry_after_ceiling
        )

    @property
    def floor(self) -> float:
        return min(self.base, self.max_delay)

    @property
    def cap(self) -> float:
        return max(self.max_delay, self.retry_after_ceiling)

    def delay(self, attempt: int, rng: random.Random, server_delay: float | None = None) -> float:
        _check_attempt(attempt)
        exponential = _exponential(self.base, 2.0, attempt - 1, self.max_delay)
        calculated = min(self.max_delay, exponential + rng.uniform(0.0, self.jitter))
        return honor_server_delay(calculated, server_delay, self.retry_after_ceiling)

    def scaled(self, factor: float) -> ExponentialPlusJitter:
        _check_factor(factor)
        return ExponentialPlusJitter(
            self.base * factor, self.jitter * factor, self.max_delay * factor, self.retry_after_ceiling * factor
        )


@dataclass(frozen=True)
class FixedSchedule:
    """A fixed list of waits: ``delays[attempt-1]``; past the end, the last one repeats.

    Repeating (instead of raising) keeps the policy total; how many attempts happen is the budget's
    decision, not the schedule's. Used for 001 (30 s, 2 min, 5 min), 000's in-process LLM retries
    (2 s, 4 s, 8 s) and 000's SQS visibility extensions (5 min, 30 min).
    """

    delays: tuple[float, ...] = (30.0, 120.0, 300.0)
    retry_after_ceiling: float = DEFAULT_RETRY_AFTER_CEILING

    def __post_init__(self) -> None:
        object.__setattr__(self, "delays", tuple(float(d) for d in self.delays))
        if not self.delays:
            raise ValueError("a fixed schedule needs at least one delay")
        _nonneg(retry_after_ceiling=self.retry_after_ceiling, **{f"delays[{i}]": d for i, d in enumerate(self.delays)})

    @property
    def floor(self) -> float:
        return min(self.delays)

    @property
    def cap(self) -> float:
        return max(max(self.delays), self.retry_after_ceiling)

    def delay(self, attempt: int, rng: random.Random, server_delay: float | None = None) -> float:
        _check_attempt(attempt)
        calculated = self.delays[min(attempt, len(self.delays)) - 1]
        return honor_server_delay(calculated, server_delay, self.retry_after_ceiling)

    def scaled(self, factor: float) -> FixedSchedule:
        _check_factor(factor)
        return FixedSchedule(tuple(d * factor for d in self.delays), self.retry_after_ceiling * factor)


@dataclass(frozen=True)
class MultiplicativeJitter:
    """004 §3: ``min(cap, initial * multiplier**(attempt-1)) * uniform(1-p, 1+p)``, clamped to ``cap``.

    004 says "max-delay: 60m" and "jitter-pct: 0.2"; we clamp *after* jitter so no wait ever exceeds
    60 minutes. ``cap`` is also the Retry-After ceiling: 004 names none and its own maximum is the
    natural one.
    """

    initial: float = 300.0
    multiplier: float = 2.0
    cap: float = 3600.0
    jitter_pct: float = 0.20

    def __post_init__(self) -> None:
        _nonneg(initial=self.initial, cap=self.cap)
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter_pct < 1:
            raise ValueError(f"jitter_pct must be in [0, 1), got {self.jitter_pct}")

    @property
    def floor(self) -> float:
        return min(self.cap, self.initial) * (1 - self.jitter_pct)

    def delay(self, attempt: int, rng: random.Random, server_delay: float | None = None) -> float:
        _check_attempt(attempt)
        base = _exponential(self.initial, self.multiplier, attempt - 1, self.cap)
        jittered = base * rng.uniform(1 - self.jitter_pct, 1 + self.jitter_pct)
        return honor_server_delay(min(self.cap, jittered), server_delay, self.cap)

    def scaled(self, factor: float) -> MultiplicativeJitter:
        _check_factor(factor)
        return MultiplicativeJitter(self.initial * factor, self.multiplier, self.cap * factor, self.jitter_pct)


# The seeds' policies, as data.
CRITICIZER_BACKOFF = FullJitter()  # 002 §8.2
CONVERSION_BACKOFF = ExponentialPlusJitter()  # 003 §3.2
MATCHMAKING_BACKOFF = FixedSchedule((30.0, 120.0, 300.0))  # 001 retry policy
# 000: in-process LLM retries. A Retry-After may stretch a wait to 20 s, no more: the worker sleeps
# while holding the SQS message, whose 60 s visibility timeout must outlast both waits.
MATCHING_LLM_BACKOFF = FixedSchedule((2.0, 4.0, 8.0), retry_after_ceiling=20.0)
# 000: visibility extension by receive count (1 -> 5 min, 2 -> 30 min), as written: a Retry-After
# never stretches a step (ceiling 0); a long one ends the in-process retries instead.
MATCHING_VISIBILITY_BACKOFF = FixedSchedule((300.0, 1800.0), retry_after_ceiling=0.0)
EVIDENCE_BACKOFF = MultiplicativeJitter()  # 004 §3
