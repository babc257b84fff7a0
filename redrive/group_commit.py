"""Group commit: what concurrent callers hand in at about the same time leaves in one call, with no added delay.

The first caller sends at once; whoever calls while that call is in flight waits for it and then goes
out with the others in the next one (up to `limit` items). One call is in flight at a time, so under
load the groups grow by themselves (a database commit, an SQS batch call) and a lone caller pays
nothing extra. `send` returns one result or exception per item, in order: each caller gets its own
(a failure of one item fails its caller alone); an exception raised by `send` itself fails every
item of the group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Entry(Generic[T, R]):
    item: T
    done: bool = False
    result: R | None = None
    error: BaseException | None = None


class GroupCommit(Generic[T, R]):
    def __init__(self, send: Callable[[list[T]], Sequence[R | BaseException]], limit: int) -> None:
        self._send_group, self.limit = send, limit
        self._waiting: list[_Entry[T, R]] = []
        self._busy = False
        self._cond = threading.Condition()

    @property
    def pending(self) -> int:
        """Items waiting for the next call."""
        with self._cond:
            return len(self._waiting)

    def __call__(self, item: T) -> R:
        mine: _Entry[T, R] = _Entry(item)
        with self._cond:
            self._waiting.append(mine)
            while not mine.done:
                if self._busy:
                    self._cond.wait()
                    continue
                group, self._waiting = self._waiting[:self.limit], self._waiting[self.limit:]
                self._busy = True
                self._cond.release()
                try:
                    self._send(group)
                finally:
                    self._cond.acquire()
                    self._busy = False
                    self._cond.notify_all()
        if mine.error is not None:
            raise mine.error
        return mine.result  # type: ignore[return-value]

    def _send(self, group: list[_Entry[T, R]]) -> None:
        try:
            results = self._send_group([e.item for e in group])
            if len(results) != len(group):
                raise RuntimeError(f"group commit: {len(results)} results for {len(group)} items")
            for e, r in zip(group, results, strict=True):
                if isinstance(r, BaseException):
                    e.error = r
                else:
                    e.result = r
        except Exception as exc:  # noqa: BLE001 - the call failed for every item in it
            for e in group:
                e.error = exc
        for e in group:
            e.done = True
