"""Per-stage attempt budgets (002 §8.3) and the pure retry decision."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redrive.backoff import CRITICIZER_BACKOFF, MATCHMAKING_BACKOFF, FixedSchedule
from redrive.budgets import (
    CRITICIZER_STAGES,
    RetryDecision,
    StageBudgets,
    decide,
    decide_stage,
)
from redrive.failures import Code, Failure
from redrive.vocabularies import CRITICIZER
from tests.core.real_inputs import REAL

RNG = random.Random(0)
TIMEOUT = Failure.of(Code.NETWORK_TIMEOUT)
AUTH = Failure.of(Code.AUTH_DENIED)


# ------------------------------------------------------------------------------------------- decide


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [
        (1, RetryDecision(True, 30.0, "retryable", 2)),
        (2, RetryDecision(True, 120.0, "retryable", 1)),
        (3, RetryDecision(False, 0.0, "exhausted", 0)),
        (4, RetryDecision(False, 0.0, "exhausted", 0)),
    ],
)
def test_decide_walks_the_001_schedule_then_stops(attempt: int, expected: RetryDecision) -> None:
    """001: a timeout retries after 30 s, then 2 min, and the third failure exhausts 3 attempts."""
    assert decide(TIMEOUT, attempt, 3, MATCHMAKING_BACKOFF, RNG) == expected


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=100), st.integers(min_value=1, max_value=100))
def test_permanent_failure_stops_at_once_whatever_the_budget(attempt: int, max_attempts: int) -> None:
    """002 §8.2.3: a non-retryable failure never retries, however many attempts remain."""
    decision = decide(AUTH, attempt, max_attempts, CRITICIZER_BACKOFF, RNG)
    assert (decision.retry, decision.reason, decision.delay) == (False, "permanent", 0.0)
    assert decision.attempts_left == max(0, max_attempts - attempt)


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=100), st.integers(min_value=1, max_value=100), st.integers(0, 2**32))
def test_retryable_failure_retries_until_the_budget_is_spent(attempt: int, max_attempts: int, seed: int) -> None:
    """A retryable failure retries iff attempts remain, with a delay from the policy's bounds."""
    decision = decide(TIMEOUT, attempt, max_attempts, CRITICIZER_BACKOFF, random.Random(seed))
    assert decision.retry is (attempt < max_attempts)
    assert decision.reason == ("retryable" if attempt < max_attempts else "exhausted")
    if decision.retry:
        assert CRITICIZER_BACKOFF.floor <= decision.delay <= CRITICIZER_BACKOFF.max_delay


def test_decide_passes_retry_after_to_the_policy() -> None:
    """The failure's Retry-After reaches the policy: 429 with Retry-After 7 waits at least 7 s."""
    failure = REAL[Code.RATE_LIMITED]()
    decision = decide(failure, 1, 5, CRITICIZER_BACKOFF, RNG)
    assert decision.retry and decision.delay == 7.0


def test_decide_follows_the_vocabulary_not_the_core_default() -> None:
    """A conflict made non-retryable by the criticizer vocabulary (non-idempotent) stops at once."""
    failure = CRITICIZER.apply(REAL[Code.CONFLICT](), idempotent=False)
    assert decide(failure, 1, 5, CRITICIZER_BACKOFF, RNG).reason == "permanent"


def test_retry_at_adds_the_delay_to_now() -> None:
    """retry_at is now + delay for a retry and None for a stop; now comes from the caller."""
    now = datetime(2026, 2, 26, 12, 0, tzinfo=UTC)
    assert RetryDecision(True, 90.0, "retryable", 1).retry_at(now) == now + timedelta(seconds=90)
    assert RetryDecision(False, 0.0, "exhausted", 0).retry_at(now) is None


@pytest.mark.parametrize(("attempt", "max_attempts"), [(0, 3), (1, 0)])
def test_decide_rejects_impossible_counts(attempt: int, max_attempts: int) -> None:
    """Attempt numbers start at 1 and a budget allows at least one attempt."""
    with pytest.raises(ValueError):
        decide(TIMEOUT, attempt, max_attempts, FixedSchedule(), RNG)


# ------------------------------------------------------------------------------------- StageBudgets


def test_criticizer_budgets_are_five_per_stage() -> None:
    """002 §8.3: fetch, llm and notify each start with five attempts."""
    budgets = StageBudgets.criticizer()
    assert {stage: budgets.remaining(stage) for stage in CRITICIZER_STAGES} == {"fetch": 5, "llm": 5, "notify": 5}


def test_failure_in_one_stage_never_spends_another() -> None:
    """002 §8.3: exhausting llm leaves fetch and notify untouched."""
    budgets = StageBudgets.criticizer()
    for _ in range(5):
        budgets = budgets.record_failure("llm")
    assert budgets.exhausted("llm")
    assert budgets.remaining("fetch") == 5 and budgets.remaining("notify") == 5
    assert not budgets.exhausted("fetch")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(CRITICIZER_STAGES), max_size=30))
def test_each_stage_counts_only_its_own_failures(failures: list[str]) -> None:
    """After any sequence of failures, each stage's remaining = 5 - its own failures (never below 0)."""
    budgets = StageBudgets.criticizer()
    for stage in failures:
        budgets = budgets.record_failure(stage)
    for stage in CRITICIZER_STAGES:
        assert budgets.remaining(stage) == max(0, 5 - failures.count(stage))
        assert budgets.exhausted(stage) is (failures.count(stage) >= 5)


def test_record_failure_returns_a_new_value() -> None:
    """Budgets are immutable: recording a failure leaves the old value as it was."""
    before = StageBudgets({"fetch": 2})
    after = before.record_failure("fetch")
    assert before.remaining("fetch") == 2 and after.remaining("fetch") == 1
    with pytest.raises(TypeError):
        after.used["fetch"] = 0  # type: ignore[index]


def test_int_budget_applies_to_every_stage() -> None:
    """An int max_attempts gives every stage, even unnamed ones, the same budget."""
    budgets = StageBudgets(3).record_failure("anything")
    assert budgets.remaining("anything") == 2 and budgets.remaining("other") == 3


def test_unknown_stage_is_a_configuration_error() -> None:
    """Charging a stage that has no budget fails loudly instead of inventing one."""
    with pytest.raises(KeyError, match="no attempt budget"):
        StageBudgets.criticizer().record_failure("render")


def test_budgets_round_trip_through_plain_dicts() -> None:
    """`dict(budgets.used)` persists and restores the same budgets."""
    budgets = StageBudgets.criticizer().record_failure("notify").record_failure("notify")
    restored = StageBudgets(dict(budgets.max_attempts), dict(budgets.used))  # type: ignore[arg-type]
    assert restored == budgets and restored.remaining("notify") == 3


def test_decide_stage_charges_the_stage_and_decides_from_its_count() -> None:
    """The fifth llm failure exhausts llm (dead-letter) while fetch still has all five attempts."""
    budgets = StageBudgets.criticizer()
    decisions = []
    for _ in range(5):
        budgets, decision = decide_stage(TIMEOUT, budgets, "llm", CRITICIZER_BACKOFF, random.Random(1))
        decisions.append(decision)
    assert [d.retry for d in decisions] == [True, True, True, True, False]
    assert decisions[-1].reason == "exhausted"
    assert budgets.remaining("fetch") == 5


def test_decide_stage_permanent_failure_stops_with_budget_left() -> None:
    """A permanent failure in notify stops at once and still charges only notify."""
    budgets, decision = decide_stage(AUTH, StageBudgets.criticizer(), "notify", CRITICIZER_BACKOFF, RNG)
    assert decision == RetryDecision(False, 0.0, "permanent", 4)
    assert budgets.spent("notify") == 1 and budgets.spent("llm") == 0
