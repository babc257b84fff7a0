"""In-process retries: one loop, built on tenacity, driven by our classifier and backoff policies.

The loop retries only what the classifier calls retryable, waits what the policy says (stretched by a
server's ``Retry-After``), sleeps through the injected ``sleep`` so tests never wait, and on giving
up raises a typed :class:`~redrive.failures.RedriveError` ``from`` the last exception.

Every call after the first is a retry to whatever upstream it reaches (`redrive.upstreams.retrying`), so
it counts against that upstream's retry budget (issue 26 §4). A retry the budget holds back raises
:class:`~redrive.upstream_policy.RetryDeferred` before anything is sent: it is no failure and spends no
attempt; the caller's ``on_deferred`` waits it out and the same attempt goes again, or, without one, it
passes through untouched to a caller that defers the whole entity (the drain).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

import tenacity

from redrive import upstreams
from redrive.backoff import BackoffPolicy
from redrive.clock import Sleep
from redrive.failures import Failure, RedriveError
from redrive.upstream_policy import RetryDeferred

__all__ = ["call_with_retries"]

T = TypeVar("T")


def call_with_retries(
    fn: Callable[[], T],
    *,
    classify: Callable[[BaseException], Failure],
    policy: BackoffPolicy,
    max_attempts: int,
    sleep: Sleep = time.sleep,
    rng: random.Random | None = None,
    on_retry: Callable[[Failure, int, float], None] | None = None,
    max_server_delay: float | None = None,
    on_deferred: Callable[[RetryDeferred], None] | None = None,
) -> T:
    """Call ``fn`` up to ``max_attempts`` times (first call included) and return its result.

    Between attempts it waits ``policy.delay(attempt, rng, failure.retry_after)``, where ``attempt``
    is the 1-based number of the call that just failed. A non-retryable failure stops at once.
    ``on_retry(failure, attempt, delay)`` is called before each wait, e.g. to log or count.
    A server that asks (``Retry-After``) for more than ``max_server_delay`` seconds ends the loop at
    once, the failure still retryable: a caller with a longer-lived retry (SQS visibility, a durable
    timer) takes over instead of holding the work while it waits.

    Calls after the first are marked as retries to the upstream (its retry budget). When the budget holds
    one back, ``on_deferred(deferred)`` is called (it waits, e.g. ``deferred.due_after``) and the same
    attempt is made again; without ``on_deferred`` the :class:`RetryDeferred` is raised as it is.

    Raises the :class:`RedriveError` subclass matching the last failure, ``from`` the last exception,
    with ``.attempts`` set to the number of calls made. ``BaseException`` that is not an
    ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) passes through untouched, unretried.
    """
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
    source = rng if rng is not None else random.Random()
    classified: dict[int, tuple[BaseException, Failure]] = {}
    calls = 0

    def failure_of(exc: BaseException) -> Failure:
        # Classify each exception once; keep the exception alive so its id cannot be reused.
        key = id(exc)
        if key not in classified:
            classified[key] = (exc, classify(exc))
        return classified[key][1]

    def should_retry(state: tenacity.RetryCallState) -> bool:
        outcome = state.outcome
        if outcome is None or not outcome.failed:
            return False
        exc = outcome.exception()
        return isinstance(exc, Exception) and not isinstance(exc, RetryDeferred) and failure_of(exc).retryable

    def wait(state: tenacity.RetryCallState) -> float:
        outcome = state.outcome
        exc = outcome.exception() if outcome is not None else None
        server_delay = failure_of(exc).retry_after if exc is not None else None
        return policy.delay(state.attempt_number, source, server_delay)

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is None or state.outcome is None or state.next_action is None:
            return
        exc = state.outcome.exception()
        if exc is not None:
            on_retry(failure_of(exc), state.attempt_number, state.next_action.sleep)

    def attempt() -> T:
        nonlocal calls
        calls += 1
        while True:
            try:
                if calls == 1:
                    return fn()  # as the caller marked it (a drain's later attempt is a retry already)
                with upstreams.retrying():
                    return fn()
            except RetryDeferred as deferred:
                if on_deferred is None:
                    raise
                on_deferred(deferred)  # nothing was sent: the same attempt, once the budget has room

    def server_asks_too_long(state: tenacity.RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome is not None else None
        asked = failure_of(exc).retry_after if exc is not None else None
        return max_server_delay is not None and asked is not None and asked > max_server_delay

    retrying = tenacity.Retrying(
        sleep=sleep,
        stop=tenacity.stop_any(tenacity.stop_after_attempt(max_attempts), server_asks_too_long),
        wait=wait,
        retry=should_retry,
        before_sleep=before_sleep,
        reraise=True,
    )
    try:
        return retrying(attempt)
    except RetryDeferred:
        raise
    except Exception as exc:
        raise RedriveError.of(failure_of(exc), attempts=calls) from exc
