"""The effect log: every side effect a fake provider performed, in order.

Tests assert on this rather than on responses, because "exactly one e-mail was
sent" is the property that matters when a response was lost and the caller
retried. Entries hold identifiers and digests, never secrets or whole bodies.
"""

from __future__ import annotations

import copy
import gc
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

Clock = Callable[[], datetime]

_RESERVED = frozenset({"seq", "kind", "at"})


def utc_now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Effect:
    """One side effect: a sequence number, a kind such as `mail.send`, and its data."""

    seq: int
    kind: str
    at: datetime
    data: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "kind": self.kind, "at": self.at.isoformat(), **self.data}


class EffectLog:
    """Append-only (until cleared) and thread-safe; sequence numbers never repeat within one log.

    Every `FREEZE_EVERY` entries, what the process holds is moved out of the garbage collector's reach
    (`gc.freeze`): a full collection walked the whole log, 40,000 entries into a run it paused the sandbox's
    loop for 181 ms, and the requests that waited were then counted in one rate window and refused. A
    provider on its own machine does not stall for its own ledger. Entries are still freed when the log is
    cleared (they hold no cycles), and clearing gives the collector back what was frozen."""

    FREEZE_EVERY = 4096

    def __init__(self, clock: Clock = utc_now) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._effects: list[Effect] = []
        self._seq = 0

    def record(self, kind: str, **data: Any) -> Effect:
        clash = _RESERVED & data.keys()
        if clash:
            raise ValueError(f"effect data may not use reserved keys {sorted(clash)}")
        # Deep copy so a caller mutating its payload later cannot rewrite history.
        frozen = MappingProxyType(copy.deepcopy(data))
        with self._lock:
            self._seq += 1
            effect = Effect(seq=self._seq, kind=kind, at=self._clock(), data=frozen)
            self._effects.append(effect)
            if self._seq % self.FREEZE_EVERY == 0:
                gc.freeze()
            return effect

    def list(self, kind: str | None = None) -> list[Effect]:
        with self._lock:
            return [e for e in self._effects if kind is None or e.kind == kind]

    def count(self, kind: str | None = None) -> int:
        return len(self.list(kind))

    def clear(self) -> None:
        """Forget the entries but keep counting, so a tailing reader never sees a seq twice."""
        with self._lock:
            self._effects.clear()
            gc.unfreeze()
