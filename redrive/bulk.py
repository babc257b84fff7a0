"""Bulk redrive: replay many dead letters by filter at a bounded rate.

Like SQS's message-move task with its max-velocity: a recovered upstream gets the
backlog at `rate` replays per second, not all at once. Each replay goes through the
same §8.5 gate as a single one (evidence and confirmation required).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sqlalchemy as sa

from redrive import deadletters
from redrive.clock import Clock, Sleep
from redrive.deadletters import Filter, ReplayRefused


@dataclass
class BulkReport:
    requested: int = 0
    refused: int = 0
    refusals: list[str] = field(default_factory=list)
    requested_ids: list[int] = field(default_factory=list)


def pacing(count: int, rate: float) -> list[float]:
    """Pure: offsets in seconds at which the i-th replay may be requested."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    return [i / rate for i in range(count)]


def bulk_replay(engine: sa.Engine, flt: Filter, *, evidence: str, confirm_safe: bool, rate: float,
                clock: Clock, sleep: Sleep, operator: str = "bulk-redrive") -> BulkReport:
    with engine.connect() as conn:
        targets = [letter.id for letter in deadletters.list_(conn, flt)]
    report = BulkReport()
    start = clock.monotonic()
    for letter_id, offset in zip(targets, pacing(len(targets), rate), strict=True):
        wait = start + offset - clock.monotonic()
        if wait > 0:
            sleep(wait)
        try:
            with engine.begin() as conn:
                deadletters.request_replay(conn, letter_id, evidence=evidence, confirm_safe=confirm_safe,
                                           at=clock.now(), operator=operator)
        except ReplayRefused as refused:
            report.refused += 1
            report.refusals.append(f"{letter_id}: {refused}")
            continue
        report.requested += 1
        report.requested_ids.append(letter_id)
    return report
