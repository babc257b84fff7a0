"""Attempt budgets and the retry decision, as pure values (002 §8.3; procrastinate's ``get_retry_decision``).

:func:`decide` takes a classified failure, the attempt that just failed, the budget and a backoff
policy and returns a :class:`RetryDecision`; the code that owns Postgres, SQS or Dagster only carries
it out. :class:`StageBudgets` keeps one counter per stage so a flaky ``notify`` never spends the
attempts of ``llm`` (002 §8.3).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Literal

from redrive.backoff import BackoffPolicy
from redrive.failures import Failure

__all__ = [
    "CRITICIZER_MAX_ATTEMPTS",
    "CRITICIZER_STAGES",
    "Reason",
    "RetryDecision",
    "StageBudgets",
    "decide",
    "decide_stage",
]

CRITICIZER_STAGES: tuple[str, ...] = ("fetch", "llm", "notify")
"""002 §8.3 stages."""
CRITICIZER_MAX_ATTEMPTS = 5
"""002 §8.3: per stage, inclusive of the first attempt."""

Reason = Literal["retryable", "permanent", "exhausted"]


@dataclass(frozen=True)
class RetryDecision:
    """What to do after a failed attempt: retry after ``delay`` seconds, or stop, and why."""

    retry: bool
    delay: float
    reason: Reason
    attempts_left: int

    def retry_at(self, now: datetime) -> datetime | None:
        """When the next attempt is due (``now`` + delay), or None when there is none."""
        return now + timedelta(seconds=self.delay) if self.retry else None


def decide(
    failure: Failure,
    attempt: int,
    max_attempts: int,
    policy: BackoffPolicy,
    rng: random.Random,
) -> RetryDecision:
    """Retry a retryable failure while the budget lasts; stop a permanent one at once (002 §8.2.3).

    ``attempt`` is 1-based and names the attempt that just failed; ``max_attempts`` includes the
    first. The delay comes from ``policy`` with the failure's ``retry_after`` as the server delay.
    """
    if attempt < 1:
        raise ValueError(f"attempt is 1-based (the attempt that just failed); got {attempt}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    left = max(0, max_attempts - attempt)
    if not failure.retryable:
        return RetryDecision(retry=False, delay=0.0, reason="permanent", attempts_left=left)
    if left == 0:
        return RetryDecision(retry=False, delay=0.0, reason="exhausted", attempts_left=0)
    delay = policy.delay(attempt, rng, failure.retry_after)
    return RetryDecision(retry=True, delay=delay, reason="retryable", attempts_left=left)


def _frozen_counts(values: Mapping[str, int]) -> Mapping[str, int]:
    for stage, count in values.items():
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"stage {stage!r}: count must be an int >= 0, got {count!r}")
    return MappingProxyType(dict(values))


@dataclass(frozen=True)
class StageBudgets:
    """Failed attempts per stage against a per-stage maximum (an int applies to every stage).

    Immutable: :meth:`record_failure` returns a new value, which the caller persists (e.g. in the
    dead-letter row's stage metadata) as ``dict(budgets.used)``.
    """

    max_attempts: Mapping[str, int] | int
    used: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, int):
            if self.max_attempts < 1:
                raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        else:
            limits = _frozen_counts(self.max_attempts)
            if any(v < 1 for v in limits.values()):
                raise ValueError(f"every stage needs max_attempts >= 1, got {dict(limits)}")
            object.__setattr__(self, "max_attempts", limits)
        object.__setattr__(self, "used", _frozen_counts(self.used))
        for stage in self.used:
            self.limit(stage)  # rejects counts for stages without a budget

    @classmethod
    def criticizer(cls) -> StageBudgets:
        """002 §8.3: fetch, llm and notify, five attempts each."""
        return cls(dict.fromkeys(CRITICIZER_STAGES, CRITICIZER_MAX_ATTEMPTS))

    def limit(self, stage: str) -> int:
        """The stage's maximum attempts; an unknown stage is a configuration bug."""
        if isinstance(self.max_attempts, int):
            return self.max_attempts
        try:
            return self.max_attempts[stage]
        except KeyError:
            raise KeyError(f"no attempt budget for stage {stage!r}; known: {sorted(self.max_attempts)}") from None

    def spent(self, stage: str) -> int:
        """Failed attempts recorded for the stage."""
        self.limit(stage)
        return self.used.get(stage, 0)

    def remaining(self, stage: str) -> int:
        """Attempts the stage may still make."""
        return max(0, self.limit(stage) - self.spent(stage))

    def exhausted(self, stage: str) -> bool:
        """True once the stage has no attempts left (002 §8.3: dead-letter with the stage's metadata)."""
        return self.remaining(stage) == 0

    def record_failure(self, stage: str) -> StageBudgets:
        """A new value with one more failed attempt charged to ``stage`` and to no other."""
        spent = self.spent(stage)
        return StageBudgets(self.max_attempts, {**self.used, stage: spent + 1})


def decide_stage(
    failure: Failure,
    budgets: StageBudgets,
    stage: str,
    policy: BackoffPolicy,
    rng: random.Random,
) -> tuple[StageBudgets, RetryDecision]:
    """Charge the failed attempt to ``stage`` and decide, from that stage's own count and limit."""
    charged = budgets.record_failure(stage)
    decision = decide(failure, charged.spent(stage), charged.limit(stage), policy, rng)
    return charged, decision
