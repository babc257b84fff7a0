"""Backoff policies: seed formulas, bounds for every attempt, Retry-After handling, scaling."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redrive.backoff import (
    CONVERSION_BACKOFF,
    CRITICIZER_BACKOFF,
    EVIDENCE_BACKOFF,
    MATCHING_LLM_BACKOFF,
    MATCHING_VISIBILITY_BACKOFF,
    MATCHMAKING_BACKOFF,
    BackoffPolicy,
    ExponentialPlusJitter,
    FixedSchedule,
    FullJitter,
    MultiplicativeJitter,
    honor_server_delay,
)

POLICIES: list[BackoffPolicy] = [
    FullJitter(),
    ExponentialPlusJitter(),
    FixedSchedule(),
    MultiplicativeJitter(),
    MATCHING_LLM_BACKOFF,
    MATCHING_VISIBILITY_BACKOFF,
    FullJitter(initial=0.5, multiplier=3.0, max_delay=10.0, retry_after_ceiling=10.0),
    MultiplicativeJitter(initial=10.0, cap=5.0, jitter_pct=0.5),
]

policies = st.sampled_from(POLICIES).flatmap(
    lambda p: st.sampled_from([p, p.scaled(0.001), p.scaled(10.0)])
)
server_delays = st.one_of(
    st.none(),
    st.floats(min_value=0.0, max_value=1e7, allow_nan=False),
    st.sampled_from([float("nan"), float("inf"), -5.0]),
)


@settings(max_examples=300, deadline=None)
@given(policies, st.integers(min_value=1, max_value=10_000), st.integers(min_value=0, max_value=2**32), server_delays)
def test_delay_stays_within_floor_and_cap(policy: BackoffPolicy, attempt: int, seed: int, server_delay: float | None) -> None:
    """No policy waits less than its floor or more than its cap, for any attempt, seed or Retry-After."""
    delay = policy.delay(attempt, random.Random(seed), server_delay)
    assert policy.floor <= delay <= policy.cap


@settings(max_examples=100, deadline=None)
@given(policies, st.integers(min_value=1, max_value=50), st.integers(min_value=0, max_value=2**32))
def test_same_seed_same_delay(policy: BackoffPolicy, attempt: int, seed: int) -> None:
    """Delays depend only on the arguments: a seeded rng reproduces them."""
    assert policy.delay(attempt, random.Random(seed)) == policy.delay(attempt, random.Random(seed))


@settings(max_examples=100, deadline=None)
@given(policies, st.integers(min_value=1, max_value=50), st.integers(min_value=0, max_value=2**32),
       st.floats(min_value=0.0, max_value=1e6, allow_nan=False))
def test_server_delay_never_shortens_a_wait(policy: BackoffPolicy, attempt: int, seed: int, server_delay: float) -> None:
    """A Retry-After can lengthen the calculated wait but never make it shorter."""
    plain = policy.delay(attempt, random.Random(seed))
    assert policy.delay(attempt, random.Random(seed), server_delay) >= plain


# --------------------------------------------------------------------------------------- FullJitter


def test_full_jitter_spreads_over_the_range() -> None:
    """002 §8.2: at attempt 5 (window 16 s) samples vary and cover most of [0, 16]."""
    rng = random.Random(7)
    samples = [CRITICIZER_BACKOFF.delay(5, rng) for _ in range(2000)]
    assert len(set(samples)) > 1900
    assert min(samples) < 0.5 and max(samples) > 15.5
    deciles = {int(s // 1.6) for s in samples}
    assert deciles == set(range(10))


@pytest.mark.parametrize(("attempt", "window"), [(1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0), (7, 60.0), (50, 60.0)])
def test_full_jitter_window_doubles_to_max(attempt: int, window: float) -> None:
    """002 §8.2: the jitter window is min(60, 1 * 2**(attempt-1))."""
    rng = random.Random(1)
    samples = [CRITICIZER_BACKOFF.delay(attempt, rng) for _ in range(500)]
    assert max(samples) <= window
    assert max(samples) > window * 0.9


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=100), st.integers(min_value=0, max_value=2**32))
def test_full_jitter_retry_after_120_waits_120_to_300(attempt: int, seed: int) -> None:
    """002 §8.2: Retry-After 120 gives max(calculated, 120), which is within [120, 300]."""
    assert 120.0 <= CRITICIZER_BACKOFF.delay(attempt, random.Random(seed), 120.0) <= 300.0


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=100), st.integers(min_value=0, max_value=2**32))
def test_full_jitter_retry_after_900_is_capped_at_300(attempt: int, seed: int) -> None:
    """002 §8.2: a Retry-After beyond the 5-minute ceiling waits exactly 300 s."""
    assert CRITICIZER_BACKOFF.delay(attempt, random.Random(seed), 900.0) == 300.0


def test_full_jitter_recomputes_per_attempt() -> None:
    """002 §8.2.1: two calls for the same attempt draw fresh delays (no precomputed schedule)."""
    rng = random.Random(3)
    assert CRITICIZER_BACKOFF.delay(4, rng) != CRITICIZER_BACKOFF.delay(4, rng)


# ----------------------------------------------------------------------------- ExponentialPlusJitter


@pytest.mark.parametrize(("attempt", "low", "high"), [(1, 5.0, 10.0), (2, 10.0, 15.0), (3, 20.0, 25.0)])
def test_conversion_delay_matches_003_formula(attempt: int, low: float, high: float) -> None:
    """003 §3.2: after failed attempt n the wait is 5 s * 2**(n-1) + uniform(0, 5 s)."""
    rng = random.Random(11)
    samples = [CONVERSION_BACKOFF.delay(attempt, rng) for _ in range(500)]
    assert low <= min(samples) and max(samples) <= high
    assert max(samples) - min(samples) > 4.5  # the jitter really spans 5 s


def test_conversion_delay_is_capped() -> None:
    """A misconfigured budget cannot make 003's exponential wait exceed its max_delay."""
    assert CONVERSION_BACKOFF.delay(40, random.Random(0)) == CONVERSION_BACKOFF.max_delay


# ------------------------------------------------------------------------------------- FixedSchedule


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (MATCHMAKING_BACKOFF, [30.0, 120.0, 300.0, 300.0, 300.0]),
        (MATCHING_LLM_BACKOFF, [2.0, 4.0, 8.0, 8.0]),
        (MATCHING_VISIBILITY_BACKOFF, [300.0, 1800.0, 1800.0]),
    ],
)
def test_fixed_schedule_steps_then_repeats_the_last(policy: FixedSchedule, expected: list[float]) -> None:
    """001/000: attempt n waits delays[n-1]; past the end the last delay repeats."""
    rng = random.Random(0)
    assert [policy.delay(n, rng) for n in range(1, len(expected) + 1)] == expected


def test_fixed_schedule_honours_retry_after_up_to_ceiling() -> None:
    """A Retry-After stretches a fixed step up to the ceiling, and a short one changes nothing."""
    rng = random.Random(0)
    assert MATCHMAKING_BACKOFF.delay(1, rng, 90.0) == 90.0
    assert MATCHMAKING_BACKOFF.delay(1, rng, 10.0) == 30.0
    assert MATCHMAKING_BACKOFF.delay(1, rng, 900.0) == 300.0
    assert MATCHING_LLM_BACKOFF.delay(1, rng, 120.0) == 20.0


def test_visibility_schedule_keeps_its_long_step_under_retry_after() -> None:
    """000's 30-minute visibility step is not cut to a Retry-After ceiling shorter than itself."""
    assert MATCHING_VISIBILITY_BACKOFF.delay(2, random.Random(0), 60.0) == 1800.0


# ------------------------------------------------------------------------------ MultiplicativeJitter


@pytest.mark.parametrize(("attempt", "base"), [(1, 300.0), (2, 600.0), (3, 1200.0), (4, 2400.0)])
def test_evidence_delay_matches_004(attempt: int, base: float) -> None:
    """004 §3: 5 min doubling, each wait within ±20 % of its base."""
    rng = random.Random(5)
    samples = [EVIDENCE_BACKOFF.delay(attempt, rng) for _ in range(500)]
    assert base * 0.8 <= min(samples) < base * 0.85
    assert base * 1.15 < max(samples) <= base * 1.2


def test_evidence_delay_never_exceeds_60_minutes() -> None:
    """004: jitter is applied before the 60-minute cap, so no wait ever exceeds 3600 s."""
    rng = random.Random(5)
    samples = [EVIDENCE_BACKOFF.delay(5, rng) for _ in range(500)]
    assert max(samples) == 3600.0
    assert min(samples) >= 3600.0 * 0.8


# ------------------------------------------------------------------------------------------- scaling


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
def test_scaled_scales_bounds(policy: BackoffPolicy) -> None:
    """scaled(0.001) multiplies floor and cap by 0.001, so a 30-minute schedule runs in seconds."""
    fast = policy.scaled(0.001)
    assert fast.floor == pytest.approx(policy.floor * 0.001)
    assert fast.cap == pytest.approx(policy.cap * 0.001)
    assert type(fast) is type(policy)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(POLICIES), st.integers(min_value=1, max_value=30), st.integers(min_value=0, max_value=2**32))
def test_scaled_scales_every_delay(policy: BackoffPolicy, attempt: int, seed: int) -> None:
    """With the same random draws, a scaled policy waits exactly factor times as long."""
    plain = policy.delay(attempt, random.Random(seed))
    fast = policy.scaled(0.001).delay(attempt, random.Random(seed))
    assert fast == pytest.approx(plain * 0.001, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("factor", [0.0, -1.0, float("nan"), float("inf")])
def test_scaled_rejects_nonsense_factors(factor: float) -> None:
    """A zero, negative or non-finite factor is refused rather than producing odd schedules."""
    with pytest.raises(ValueError):
        FullJitter().scaled(factor)


# -------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
def test_attempt_is_one_based(policy: BackoffPolicy) -> None:
    """Attempt 0 is a caller bug (attempts count from 1, the call that just failed)."""
    with pytest.raises(ValueError, match="1-based"):
        policy.delay(0, random.Random(0))


@pytest.mark.parametrize(
    "build",
    [
        lambda: FullJitter(initial=-1.0),
        lambda: FullJitter(multiplier=0.5),
        lambda: ExponentialPlusJitter(jitter=float("inf")),
        lambda: FixedSchedule(()),
        lambda: FixedSchedule((1.0, -2.0)),
        lambda: MultiplicativeJitter(jitter_pct=1.0),
    ],
)
def test_invalid_parameters_are_rejected(build: object) -> None:
    """Negative durations, shrinking multipliers, empty schedules and 100 % jitter fail at construction."""
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("calculated", "server", "ceiling", "expected"),
    [
        (5.0, None, 300.0, 5.0),
        (5.0, 120.0, 300.0, 120.0),
        (5.0, 900.0, 300.0, 300.0),
        (200.0, 100.0, 300.0, 200.0),
        (5.0, 0.0, 300.0, 5.0),
        (5.0, -3.0, 300.0, 5.0),
        (5.0, float("nan"), 300.0, 5.0),
        (5.0, float("inf"), 300.0, 5.0),
    ],
)
def test_honor_server_delay_table(calculated: float, server: float | None, ceiling: float, expected: float) -> None:
    """max(calculated, min(server, ceiling)); missing or nonsense server delays are ignored."""
    assert honor_server_delay(calculated, server, ceiling) == expected


def test_policies_satisfy_the_protocol() -> None:
    """Every policy is a BackoffPolicy at run time too."""
    assert all(isinstance(p, BackoffPolicy) for p in POLICIES)
