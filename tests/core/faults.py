"""Fault helpers for retry tests: callables that fail a set number of times, then succeed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class FailNTimes(Generic[T]):
    """A zero-argument callable that raises ``errors[i]`` on call ``i`` and then returns ``result``.

    ``errors`` may be exception instances or factories; ``calls`` counts every invocation.
    """

    def __init__(self, errors: Sequence[BaseException | Callable[[], BaseException]], result: T) -> None:
        self.errors = list(errors)
        self.result = result
        self.calls = 0

    def __call__(self) -> T:
        self.calls += 1
        if self.calls <= len(self.errors):
            error = self.errors[self.calls - 1]
            raise error() if callable(error) and not isinstance(error, BaseException) else error
        return self.result


def fail_n_times(n: int, error: Callable[[], BaseException], result: T) -> FailNTimes[T]:
    """Fail ``n`` times with a fresh ``error()`` each time, then return ``result``."""
    return FailNTimes([error] * n, result)


def always_fail(error: Callable[[], BaseException]) -> FailNTimes[None]:
    """Fail on every call (well, the first million)."""
    return FailNTimes([error] * 1_000_000, None)
