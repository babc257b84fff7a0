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

import asyncio
import inspect
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import tenacity

from redrive import upstreams
from redrive.backoff import BackoffPolicy
from redrive.clock import Sleep
from redrive.failures import Failure, RedriveError
from redrive.upstream_policy import RetryDeferred

__all__ = ["acall_with_retries", "call_with_retries"]

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
    loop = _Loop(classify, policy, max_attempts, rng, max_server_delay)

    def attempt() -> T:
        loop.calls += 1
        while True:
            try:
                if loop.calls == 1:
                    return fn()  # as the caller marked it (a drain's later attempt is a retry already)
                with upstreams.retrying():
                    return fn()
            except RetryDeferred as deferred:
                if on_deferred is None:
                    raise
                on_deferred(deferred)  # nothing was sent: the same attempt, once the budget has room

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and (told := loop.retrying_after(state)) is not None:
            on_retry(*told)

    try:
        return tenacity.Retrying(sleep=sleep, before_sleep=before_sleep, **loop.policy())(attempt)
    except RetryDeferred:
        raise
    except Exception as exc:
        raise RedriveError.of(loop.failure_of(exc), attempts=loop.calls) from exc


async def acall_with_retries(
    fn: Callable[[], Awaitable[T]],
    *,
    classify: Callable[[BaseException], Failure],
    policy: BackoffPolicy,
    max_attempts: int,
    sleep: Callable[[float], Awaitable[None] | None] = asyncio.sleep,
    rng: random.Random | None = None,
    on_retry: Callable[[Failure, int, float], Awaitable[None] | None] | None = None,
    max_server_delay: float | None = None,
    on_deferred: Callable[[RetryDeferred], Awaitable[None] | None] | None = None,
) -> T:
    """`call_with_retries` for a coroutine: the calls and the waits between them are awaited, so an entity in its
    backoff holds no thread. ``sleep``, ``on_retry`` and ``on_deferred`` may be plain functions (a test's
    recorder) or coroutine functions."""
    loop = _Loop(classify, policy, max_attempts, rng, max_server_delay)

    async def attempt() -> T:
        loop.calls += 1
        while True:
            try:
                if loop.calls == 1:
                    return await fn()
                with upstreams.retrying():
                    return await fn()
            except RetryDeferred as deferred:
                if on_deferred is None:
                    raise
                await _maybe(on_deferred(deferred))

    async def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None and (told := loop.retrying_after(state)) is not None:
            await _maybe(on_retry(*told))

    async def pause(seconds: float) -> None:
        await _maybe(sleep(seconds))

    try:
        return await tenacity.AsyncRetrying(sleep=pause, before_sleep=before_sleep, **loop.policy())(attempt)
    except RetryDeferred:
        raise
    except Exception as exc:
        raise RedriveError.of(loop.failure_of(exc), attempts=loop.calls) from exc


async def _maybe(result: Awaitable[None] | None) -> None:
    if inspect.isawaitable(result):
        await result


class _Loop:
    """What one retry loop decides, the same for a plain call and a coroutine: what is retried, how long it
    waits, when it stops; each exception classified once."""

    def __init__(self, classify: Callable[[BaseException], Failure], policy: BackoffPolicy, max_attempts: int,
                 rng: random.Random | None, max_server_delay: float | None) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.classify, self.backoff, self.max_attempts = classify, policy, max_attempts
        self.rng = rng if rng is not None else random.Random()
        self.max_server_delay = max_server_delay
        self.calls = 0
        self._classified: dict[int, tuple[BaseException, Failure]] = {}

    def failure_of(self, exc: BaseException) -> Failure:
        # Classify each exception once; keep the exception alive so its id cannot be reused.
        key = id(exc)
        if key not in self._classified:
            self._classified[key] = (exc, self.classify(exc))
        return self._classified[key][1]

    def policy(self) -> dict[str, Any]:
        """tenacity's stop, wait and retry for this loop."""
        return {"stop": tenacity.stop_any(tenacity.stop_after_attempt(self.max_attempts), self._server_asks_too_long),
                "wait": self._wait, "retry": self._should_retry, "reraise": True}

    def retrying_after(self, state: tenacity.RetryCallState) -> tuple[Failure, int, float] | None:
        """(failure, attempt, delay) of the retry about to wait, for ``on_retry``."""
        if state.outcome is None or state.next_action is None:
            return None
        exc = state.outcome.exception()
        return None if exc is None else (self.failure_of(exc), state.attempt_number, state.next_action.sleep)

    def _should_retry(self, state: tenacity.RetryCallState) -> bool:
        outcome = state.outcome
        if outcome is None or not outcome.failed:
            return False
        exc = outcome.exception()
        return isinstance(exc, Exception) and not isinstance(exc, RetryDeferred) and self.failure_of(exc).retryable

    def _wait(self, state: tenacity.RetryCallState) -> float:
        outcome = state.outcome
        exc = outcome.exception() if outcome is not None else None
        server_delay = self.failure_of(exc).retry_after if exc is not None else None
        return self.backoff.delay(state.attempt_number, self.rng, server_delay)

    def _server_asks_too_long(self, state: tenacity.RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome is not None else None
        asked = self.failure_of(exc).retry_after if exc is not None else None
        return self.max_server_delay is not None and asked is not None and asked > self.max_server_delay
