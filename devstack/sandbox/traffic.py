"""The request log: which fault step each incoming request met and how it was answered.

It lets a test prove a script was served in order. It keeps header NAMES only and
no bodies, because requests carry API keys and personal data.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from devstack.sandbox.effects import Clock, utc_now

Outcome = Literal["in_flight", "answered", "dropped"]


@dataclass(frozen=True)
class RequestRecord:
    """One request on a service route; `status` stays None while in flight or when dropped."""

    seq: int
    route: str
    method: str
    path: str
    header_names: tuple[str, ...]
    step: str
    source: str
    at: datetime
    outcome: Outcome = "in_flight"
    status: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "route": self.route,
            "method": self.method,
            "path": self.path,
            "header_names": list(self.header_names),
            "step": self.step,
            "source": self.source,
            "at": self.at.isoformat(),
            "outcome": self.outcome,
            "status": self.status,
        }


class RequestLog:
    """Opened when a request arrives (so a held-open timeout is visible) and closed when answered."""

    def __init__(self, clock: Clock = utc_now) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[int, RequestRecord] = {}
        self._seq = 0

    def open(self, *, route: str, method: str, path: str, header_names: list[str], step: str, source: str) -> int:
        with self._lock:
            self._seq += 1
            self._records[self._seq] = RequestRecord(
                seq=self._seq,
                route=route,
                method=method,
                path=path,
                header_names=tuple(sorted({h.lower() for h in header_names})),
                step=step,
                source=source,
                at=self._clock(),
            )
            return self._seq

    def close(self, seq: int, status: int | None) -> None:
        """Record the answer; None means the connection was dropped without one."""
        with self._lock:
            record = self._records.get(seq)
            if record is not None:
                outcome: Outcome = "dropped" if status is None else "answered"
                self._records[seq] = replace(record, outcome=outcome, status=status)

    def list(self, route: str | None = None) -> list[RequestRecord]:
        with self._lock:
            return [r for r in self._records.values() if route is None or r.route == route]

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
