"""The in-process retry loop: what it retries, how long it waits, what it raises; no real sleeping."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from redrive.backoff import MATCHING_LLM_BACKOFF, ExponentialPlusJitter, FixedSchedule, FullJitter
from redrive.clock import FrozenClock
from redrive.failures import Code, ConflictError, Failure, PermanentError, RetryableError, classify_exception
from redrive.retrying import call_with_retries
from redrive.vocabularies import MATCHING
from tests.core.faults import FailNTimes, always_fail, fail_n_times
from tests.core.real_inputs import REQUEST, http_error, validation_error


def timeout() -> httpx.ReadTimeout:
    return httpx.ReadTimeout("read timed out", request=REQUEST)


class Sleeps:
    """An injected sleep that records durations instead of waiting."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def test_fail_twice_then_succeed_returns_the_result() -> None:
    """Two timeouts then success: the result comes back after three calls and two waits."""
    fn = fail_n_times(2, timeout, "matched")
    sleeps = Sleeps()
    result = call_with_retries(fn, classify=classify_exception, policy=MATCHING_LLM_BACKOFF, max_attempts=3, sleep=sleeps)
    assert result == "matched"
    assert fn.calls == 3
    assert sleeps.calls == [2.0, 4.0]


def test_success_first_time_never_sleeps() -> None:
    """A call that succeeds is made once and never waits."""
    fn = fail_n_times(0, timeout, 42)
    sleeps = Sleeps()
    assert call_with_retries(fn, classify=classify_exception, policy=FixedSchedule(), max_attempts=5, sleep=sleeps) == 42
    assert (fn.calls, sleeps.calls) == (1, [])


def test_waits_what_the_policy_says_then_gives_up() -> None:
    """000: 3 attempts on the 2 s/4 s/8 s schedule sleep [2, 4] and then raise the classified failure."""
    fn = always_fail(timeout)
    sleeps = Sleeps()
    with pytest.raises(RetryableError) as caught:
        call_with_retries(fn, classify=classify_exception, policy=MATCHING_LLM_BACKOFF, max_attempts=3, sleep=sleeps)
    assert sleeps.calls == [2.0, 4.0]
    assert fn.calls == 3
    assert caught.value.attempts == 3
    assert caught.value.failure.code == Code.NETWORK_TIMEOUT
    assert isinstance(caught.value.__cause__, httpx.ReadTimeout)


def test_non_retryable_failure_stops_after_one_call() -> None:
    """A 401 is permanent: exactly one call, no sleep, PermanentError from the HTTP error."""
    fn = always_fail(lambda: http_error(401, {"error": {"code": "invalid_api_key"}}))
    sleeps = Sleeps()
    with pytest.raises(PermanentError) as caught:
        call_with_retries(fn, classify=classify_exception, policy=FullJitter(), max_attempts=5, sleep=sleeps)
    assert (fn.calls, sleeps.calls, caught.value.attempts) == (1, [], 1)
    assert caught.value.failure.code == Code.AUTH_DENIED
    assert isinstance(caught.value.__cause__, httpx.HTTPStatusError)


def test_reclassified_to_permanent_stops_immediately() -> None:
    """002 §8.2.3: a timeout then a schema error stops at the schema error (the second call)."""
    fn = FailNTimes([timeout(), validation_error(), timeout()], "never")
    sleeps = Sleeps()
    with pytest.raises(PermanentError) as caught:
        call_with_retries(fn, classify=classify_exception, policy=FixedSchedule((1.0,)), max_attempts=5, sleep=sleeps)
    assert (fn.calls, sleeps.calls, caught.value.attempts) == (2, [1.0], 2)
    assert caught.value.failure.code == Code.SCHEMA_INVALID


def test_vocabulary_decides_retryability() -> None:
    """With 000's vocabulary a schema failure is transient, so the loop retries it."""
    fn = fail_n_times(2, validation_error, "ok")

    def classify(exc: BaseException) -> Failure:
        return MATCHING.apply(classify_exception(exc))

    assert call_with_retries(fn, classify=classify, policy=MATCHING_LLM_BACKOFF, max_attempts=3, sleep=Sleeps()) == "ok"
    assert fn.calls == 3


def test_retry_after_is_honoured() -> None:
    """A 429 with Retry-After 7 waits 7 s even though the schedule says 2 s."""
    fn = fail_n_times(1, lambda: http_error(429, b"", {"Retry-After": "7"}), "ok")
    sleeps = Sleeps()
    assert call_with_retries(fn, classify=classify_exception, policy=MATCHING_LLM_BACKOFF, max_attempts=3, sleep=sleeps) == "ok"
    assert sleeps.calls == [7.0]


def test_on_retry_sees_failure_attempt_and_delay() -> None:
    """on_retry is called before each wait with the failure, the failed attempt number and the delay."""
    seen: list[tuple[str, int, float]] = []
    fn = fail_n_times(2, timeout, "ok")
    call_with_retries(
        fn,
        classify=classify_exception,
        policy=FixedSchedule((3.0, 5.0)),
        max_attempts=4,
        sleep=Sleeps(),
        on_retry=lambda failure, attempt, delay: seen.append((failure.code, attempt, delay)),
    )
    assert seen == [(Code.NETWORK_TIMEOUT, 1, 3.0), (Code.NETWORK_TIMEOUT, 2, 5.0)]


def test_seeded_rng_makes_jittered_waits_reproducible() -> None:
    """The same rng seed gives the same jittered sleeps."""

    def run() -> list[float]:
        sleeps = Sleeps()
        with pytest.raises(RetryableError):
            call_with_retries(
                always_fail(timeout), classify=classify_exception, policy=ExponentialPlusJitter(),
                max_attempts=3, sleep=sleeps, rng=random.Random(99),
            )
        return sleeps.calls

    first = run()
    assert first == run()
    assert 5.0 <= first[0] <= 10.0 and 10.0 <= first[1] <= 15.0


def test_frozen_clock_runs_half_an_hour_of_backoff_in_no_time() -> None:
    """Injecting FrozenClock.sleep makes 000's 5 min + 30 min backoff pass instantly on the clock."""
    clock = FrozenClock()
    start_wall, start = time.monotonic(), clock.now()
    fn = fail_n_times(2, timeout, "ok")
    policy = FixedSchedule((300.0, 1800.0), retry_after_ceiling=1800.0)
    assert call_with_retries(fn, classify=classify_exception, policy=policy, max_attempts=3, sleep=clock.sleep) == "ok"
    assert clock.sleeps == [300.0, 1800.0]
    assert (clock.now() - start).total_seconds() == 2100.0
    assert time.monotonic() - start_wall < 1.0


def test_conflict_exhaustion_raises_conflict_error() -> None:
    """A conflict that keeps happening ends as ConflictError carrying the CONFLICT failure."""
    conflict = Failure.of(Code.CONFLICT, detail="version 3 != 4")
    fn = always_fail(lambda: ConflictError(conflict))
    with pytest.raises(ConflictError) as caught:
        call_with_retries(fn, classify=classify_exception, policy=FixedSchedule((0.0,)), max_attempts=2, sleep=Sleeps())
    assert caught.value.attempts == 2 and caught.value.failure == conflict


def test_keyboard_interrupt_passes_through_unretried() -> None:
    """A KeyboardInterrupt is not an error to classify: it propagates after one call."""
    fn = always_fail(KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        call_with_retries(fn, classify=classify_exception, policy=FixedSchedule(), max_attempts=3, sleep=Sleeps())
    assert fn.calls == 1


def test_max_attempts_one_means_no_retry() -> None:
    """max_attempts=1 makes exactly one call even for a retryable failure."""
    fn = always_fail(timeout)
    with pytest.raises(RetryableError) as caught:
        call_with_retries(fn, classify=classify_exception, policy=FixedSchedule(), max_attempts=1, sleep=Sleeps())
    assert (fn.calls, caught.value.attempts) == (1, 1)


def test_max_attempts_must_be_positive() -> None:
    """Zero attempts is a configuration error, caught before calling anything."""
    with pytest.raises(ValueError):
        call_with_retries(lambda: None, classify=classify_exception, policy=FixedSchedule(), max_attempts=0)


def test_each_exception_is_classified_once() -> None:
    """The classifier runs once per raised exception, however many hooks need the failure."""
    calls: list[BaseException] = []

    def classify(exc: BaseException) -> Failure:
        calls.append(exc)
        return classify_exception(exc)

    fn = fail_n_times(2, timeout, "ok")
    call_with_retries(fn, classify=classify, policy=FixedSchedule((1.0,)), max_attempts=3, sleep=Sleeps(), on_retry=lambda *a: None)
    assert len(calls) == 2 and len({id(e) for e in calls}) == 2


def test_calls_after_the_first_are_retries_to_the_upstream_and_a_held_back_one_spends_no_attempt() -> None:
    """Issue 26 §4: the second call runs marked as a retry (the upstream's budget counts it); when the budget
    holds it back (RetryDeferred, nothing sent), `on_deferred` waits and the same attempt goes again, so
    max_attempts=2 still allows the one real retry."""
    from redrive import upstreams
    from redrive.upstream_policy import RetryDeferred

    marked: list[bool] = []
    held: list[float] = []
    outcomes = iter([httpx.ConnectError("down"), RetryDeferred("llm", 10.0), RetryDeferred("llm", 10.0), "ok"])

    def call() -> str:
        marked.append(upstreams._RETRYING.get())
        outcome = next(outcomes)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    result = call_with_retries(call, classify=classify_exception, policy=FixedSchedule((1.0,)), max_attempts=2,
                               sleep=lambda s: None, on_deferred=lambda d: held.append(d.wait))
    assert result == "ok" and marked == [False, True, True, True] and held == [10.0, 10.0]


def test_without_on_deferred_a_held_back_retry_passes_through_unclassified() -> None:
    """The drain defers the whole entity: it must see the RetryDeferred itself, not a RedriveError."""
    from redrive.upstream_policy import RetryDeferred

    outcomes = iter([httpx.ConnectError("down"), RetryDeferred("mail", 10.0)])

    def call() -> None:
        raise next(outcomes)

    with pytest.raises(RetryDeferred):
        call_with_retries(call, classify=classify_exception, policy=FixedSchedule((1.0,)), max_attempts=3,
                          sleep=lambda s: None)
