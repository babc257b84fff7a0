"""Settle a failed attempt of one entity: due again after its stage's backoff, or failed for good.

Every batch pipeline ends a failed entity the same way, so it is written once, here. The core
decides (`redrive.budgets.decide` under the stage's budget and backoff, jitter drawn per entity,
stage and attempt), builds the one sanitized public line, and runs in ONE transaction the
pipeline's own write for "retry at `due_at`" or "failed for good" and, in the final case, the dead
letter and its alert (`Reliability.fail_for_good`): a crash or an exception inside leaves neither.
A pipeline supplies only its writes and its dead letter's context; how its retry happens (a due
work row, a queued job, an SQS visibility step) stays its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

import sqlalchemy as sa

from redrive.backoff import BackoffPolicy
from redrive.budgets import RetryDecision, decide
from redrive.deadletters import FinalFailure, Recorded
from redrive.failures import Failure
from redrive.reliability import Reliability
from redrive.sanitize import sanitize_text

__all__ = ["Budget", "RetryBudget", "Settled", "Verdict", "Write", "settle"]


class RetryBudget(Protocol):
    """A stage's attempts and backoff: a `Budget`, or a `redrive.stages.StagePolicy`."""

    @property
    def max_attempts(self) -> int: ...

    @property
    def backoff(self) -> BackoffPolicy: ...


@dataclass(frozen=True)
class Budget:
    """Attempts (the first included) and the backoff between them, for a stage without a `StagePolicy`."""

    max_attempts: int
    backoff: BackoffPolicy


@dataclass(frozen=True)
class Verdict:
    """The decision on one failed attempt, handed to the pipeline's writes."""

    pipeline: str
    stage: str
    entity_ref: str
    failure: Failure
    attempt: int  # 1-based: the attempt that just failed
    max_attempts: int
    decision: RetryDecision
    now: datetime
    wait: float  # seconds until the next attempt, scaled by the time scale (0 when final)

    @property
    def due_at(self) -> datetime | None:
        return self.now + timedelta(seconds=self.wait) if self.decision.retry else None

    @property
    def message(self) -> str:
        """The failure's public message, sanitized."""
        return sanitize_text(self.failure.message)

    @property
    def error(self) -> str:
        """`code: message`, sanitized: what an entity's own error column shows."""
        return sanitize_text(f"{self.failure.code}: {self.failure.message}")

    @property
    def public(self) -> str:
        """The one line for logs and the work queue: stage, attempt, entity, code and message, sanitized."""
        return sanitize_text(f"{self.stage} attempt {self.attempt}/{self.max_attempts} of {self.entity_ref}: "
                             f"{self.failure.code}: {self.failure.message}")

    def final_failure(self, **extra: Any) -> FinalFailure:
        """The dead letter's record: the verdict's pipeline, stage, entity, failure, attempts and time,
        plus the pipeline's own context (`tenant`, `stack`, `context`, `payload_ref`, …; `attempts` may
        be overridden where the entity counts its attempts otherwise)."""
        fields: dict[str, Any] = {"pipeline": self.pipeline, "stage": self.stage, "entity_ref": self.entity_ref,
                                  "failure": self.failure, "attempts": self.attempt, "at": self.now}
        return FinalFailure(**{**fields, **extra})


Write = Callable[[sa.Connection, Verdict], bool]
"""A pipeline's own state write inside the settlement's transaction. False: refused (the entity is no
longer ours: a fenced lease, a result that won meanwhile); the transaction still commits what the
write did, and no dead letter is written. Raise to roll everything back."""

Outcome = Literal["retried", "dead_lettered", "refused"]


@dataclass(frozen=True)
class Settled:
    verdict: Verdict
    outcome: Outcome
    recorded: Recorded | None = None

    @property
    def dead_letter_id(self) -> int | None:
        return self.recorded.dead_letter.id if self.recorded is not None else None


def settle(
    reliability: Reliability,
    *,
    pipeline: str,
    stage: str,
    entity_ref: str,
    failure: Failure,
    attempt: int,
    budget: RetryBudget,
    on_retry: Write | None,
    on_final: Write,
    final: Callable[[Verdict], FinalFailure],
    jitter_key: str | None = None,
    link: str | None = None,
    time_scale: float | None = None,
    dispatch: bool = True,
) -> Settled:
    """Decide on attempt `attempt` of `entity_ref`'s `stage` and write the outcome in one transaction.

    `on_retry` None: the entity has no later attempt here (its in-process retries are spent), so a
    retryable failure is final too. `final(verdict)` builds the dead letter's record after
    `on_final` ran (so that write may still add to the context). `dispatch` False leaves sending the
    alert to the caller's `try_dispatch()` (a drain sends once per run) or the alert sensor.
    """
    now = reliability.now()
    key = jitter_key or f"{pipeline}:{entity_ref}:{stage}:{attempt}"
    decision = decide(failure, max(1, attempt), budget.max_attempts, budget.backoff, reliability.rng_for(key))
    if decision.retry and on_retry is None:
        decision = RetryDecision(retry=False, delay=0.0, reason="exhausted", attempts_left=0)
    scale = reliability.time_scale if time_scale is None else time_scale
    wait = decision.delay * scale if decision.retry else 0.0
    verdict = Verdict(pipeline, stage, entity_ref, failure, attempt, budget.max_attempts, decision, now,
                      wait if math.isfinite(wait) and wait > 0 else 0.0)
    with reliability.engine.begin() as conn:
        if decision.retry:
            assert on_retry is not None
            return Settled(verdict, "retried" if on_retry(conn, verdict) else "refused")
        if not on_final(conn, verdict):
            return Settled(verdict, "refused")
        recorded = reliability.fail_for_good(final(verdict), link=link, conn=conn)
    if dispatch:
        reliability.try_dispatch()
    return Settled(verdict, "dead_lettered", recorded)
