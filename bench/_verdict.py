"""The chaos run's verdict: pure functions over what the run submitted and what it found afterwards.

Every count starts from the harness's own ledger (what it submitted, the canaries it planted), never
from what the system reports about itself: an entity the system forgot is *lost*, not absent; a work
row marked dead with no dead letter is lost too (its failure reached nobody). `tests/chaos/` breaks a
build on purpose and checks that the verdict fails.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

DONE, DEAD = "done", "dead"


@dataclass(frozen=True)
class Settled:
    """One pipeline's entities after the run: done, dead-lettered (dead row + active letter), lost."""

    items_in: int
    done: int
    dead_lettered: int
    lost: int
    lost_refs: tuple[str, ...] = ()


def settle(expected: int, known: Collection[str], rows: Mapping[str, str], letters: Collection[str]) -> Settled:
    """`expected` entities were submitted, `known` of them by entity ref; `rows` maps each work row's
    entity ref to its status; `letters` are the entity refs with an unresolved dead letter.

    Lost: a row still open, a dead row without its letter, a known entity with no row, and any shortfall
    of rows against what was submitted (evidence rows get their refs only at ingest).
    """
    letters = set(letters)
    done = sum(1 for status in rows.values() if status == DONE)
    dead = sum(1 for ref, status in rows.items() if status == DEAD and ref in letters)
    lost_refs = sorted(ref for ref, status in rows.items() if status not in (DONE, DEAD)
                       or (status == DEAD and ref not in letters))
    missing_known = sorted(set(known) - set(rows))
    shortfall = max(len(missing_known), expected - len(rows))
    return Settled(items_in=max(expected, len(rows)), done=done, dead_lettered=dead,
                   lost=len(lost_refs) + shortfall, lost_refs=tuple(lost_refs + missing_known)[:20])


def duplicates(effects: Iterable[Mapping[str, Any]], key: Callable[[Mapping[str, Any]], Any]) -> int:
    """External effects beyond the first per key (an email per recipient and version, …)."""
    counts = Counter(key(e) for e in effects)
    return sum(n - 1 for n in counts.values() if n > 1)


def canaries_in(texts: Iterable[tuple[str, str]], canaries: Collection[str]) -> list[tuple[str, str]]:
    """(where, canary) for every planted canary found verbatim in a text; `where` names the sink."""
    found = []
    for where, text in texts:
        for canary in canaries:
            if canary in text:
                found.append((where, canary))
    return found


def alert_mismatches(letters: Collection[str], alerted: Iterable[str]) -> list[tuple[str, int]]:
    """Final failures (dead letters) alerted other than exactly once; `alerted` names a letter per alert."""
    counts = Counter(alerted)
    return [(letter, counts.get(letter, 0)) for letter in sorted(set(letters)) if counts.get(letter, 0) != 1]


STALL_LIMIT_SECONDS = 300.0  # issue 25: no pipeline may go longer than this with open work and no progress


@dataclass
class StallMeter:
    """The longest time a pipeline had work outstanding and its (entities, open) did not change, from the
    harness's own polls: fed one sample per poll; a poll that failed (PostgreSQL away) simply is no sample, so
    the gap counts."""

    longest: float = 0.0
    since: float | None = None
    last: tuple[int, int] | None = None

    def observe(self, t: float, total: int, open_: int, expected: int) -> float:
        outstanding = open_ > 0 or total < expected
        if not outstanding or (total, open_) != self.last or self.since is None:
            self.since = t
        self.last = (total, open_)
        self.longest = max(self.longest, t - self.since)
        return t - self.since


@dataclass
class Verdict:
    pipeline: str
    items_in: int
    done: int
    dead_lettered: int
    lost: int
    duplicate_effects: int
    canaries: int
    unreplayable: int
    alerts_not_one: int
    redacted: int = 0  # sink texts carrying a redaction marker: the canaries were there, and redacted
    examples: dict[str, list[Any]] = field(default_factory=dict)
    longest_stall_seconds: float = 0.0  # open work and no progress, the longest spell the harness saw
    stall_limit_seconds: float = STALL_LIMIT_SECONDS

    @property
    def stalled(self) -> bool:
        return self.longest_stall_seconds > self.stall_limit_seconds

    @property
    def failed(self) -> bool:
        return bool(self.lost or self.duplicate_effects or self.canaries or self.unreplayable or self.alerts_not_one
                    or self.stalled)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "failed": self.failed}


def verdict(pipeline: str, settled: Settled, *, duplicate_effects: int, canaries: list[tuple[str, str]],
            unreplayable: Collection[Any], alerts: list[tuple[str, int]], redacted: int = 0,
            longest_stall: float = 0.0, stall_limit: float = STALL_LIMIT_SECONDS) -> Verdict:
    examples: dict[str, list[Any]] = {}
    if settled.lost_refs:
        examples["lost"] = list(settled.lost_refs[:5])
    if canaries:
        examples["canaries"] = [where for where, _ in canaries[:5]]
    if unreplayable:
        examples["unreplayable"] = list(unreplayable)[:5]
    if alerts:
        examples["alerts"] = alerts[:5]
    if longest_stall > stall_limit:
        examples["stall"] = [f"{longest_stall:.0f} s with open work and no progress (limit {stall_limit:g} s)"]
    return Verdict(pipeline, settled.items_in, settled.done, settled.dead_lettered, settled.lost, duplicate_effects,
                   len(canaries), len(unreplayable), len(alerts), redacted, examples, round(longest_stall, 1),
                   stall_limit)


def failed(verdicts: Iterable[Verdict], unattributed_canaries: int = 0) -> bool:
    return unattributed_canaries > 0 or any(v.failed for v in verdicts)


def table(verdicts: Iterable[Verdict]) -> list[str]:
    """The verdict as a Markdown table."""
    head = ["pipeline", "in", "done", "dead-lettered", "lost", "duplicate effects", "canaries", "unreplayable",
            "alerts ≠ 1", "redacted sinks", "longest stall (s)", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in verdicts:
        lines.append(f"| {v.pipeline} | {v.items_in} | {v.done} | {v.dead_lettered} | {v.lost} | "
                     f"{v.duplicate_effects} | {v.canaries} | {v.unreplayable} | {v.alerts_not_one} | {v.redacted} | "
                     f"{v.longest_stall_seconds:.0f} | {'FAIL' if v.failed else 'pass'} |")
    return lines


def dumps(value: Any) -> str:
    """A row or an effect as text to scan for canaries."""
    return json.dumps(value, default=str, ensure_ascii=False)
