"""Reconciliation: every entity failed for good has its dead letter and its alert (issue 13 item 3).

A pipeline that marks an entity failed in one transaction and dead-letters it in the next can crash
in between, leaving a failed entity nobody is told about. Each pipeline's repository answers one
question, "which entities are failed for good without a dead letter for that failure?"
(:data:`FailedForGood`, built on :func:`redrive.deadletters.unrecorded`); this module repairs each
one with the core's own write: dead letter and alert in one transaction, so a repair happens once.
The core imports no pipeline: the sources are handed in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa

from redrive import deadletters
from redrive.deadletters import FinalFailure
from redrive.reliability import Reliability

__all__ = ["DEFAULT_GRACE_SECONDS", "FailedForGood", "OVERLAP_SECONDS", "Repaired", "next_since", "reconcile"]

log = logging.getLogger(__name__)

FailedForGood = Callable[[sa.Connection, int, datetime | None], Sequence[FinalFailure]]
"""``(conn, limit, since)`` → up to ``limit`` final failures with no dead letter, oldest first, each ``at`` its
failure time (so the letter written for it satisfies :func:`redrive.deadletters.unrecorded`); with ``since``,
only failures at or after it, read through an index on the failure time, so a pass costs what failed lately
and not every failure the retention windows keep (issue 28)."""

DEFAULT_GRACE_SECONDS = 60.0
"""Failures younger than this are left to the pipeline's own second commit, which is normally milliseconds away."""

OVERLAP_SECONDS = 3600.0
"""How far before the last complete pass the next one looks again: a failure's time may come from the
database's clock or a worker's, and a pass must not step over one stamped a little in its past."""


@dataclass(frozen=True)
class Repaired:
    pipeline: str
    entity_ref: str
    dead_letter_id: int


def _still_missing(conn: sa.Connection, final: FinalFailure) -> bool:
    return bool(conn.execute(sa.select(deadletters.unrecorded(
        final.pipeline, sa.literal(final.entity_ref), sa.literal(final.at)))).scalar())


def reconcile(runtime: Reliability, sources: Mapping[str, FailedForGood], *, limit: int = 100,
              grace_seconds: float = DEFAULT_GRACE_SECONDS, since: datetime | None = None) -> list[Repaired]:
    """Write the missing dead letter and alert of each entity the sources report; returns what was repaired.

    Idempotent under concurrent runs: each repair takes a transaction-scoped advisory lock on its
    entity and checks again under it, so a second reconciler (or the pipeline's own late write)
    finds the letter and does nothing. Alerts are sent after commit (or by the alert sensor). With
    ``since``, only failures from then on are looked at (the sensor's pass); without, all (`redrive reconcile`).
    """
    cutoff = runtime.now() - timedelta(seconds=grace_seconds)
    repaired: list[Repaired] = []
    for name, source in sources.items():
        with runtime.engine.connect() as conn:
            candidates = [f for f in source(conn, limit, since) if f.at <= cutoff]
        for final in candidates:
            with runtime.engine.begin() as conn:
                conn.execute(sa.select(sa.func.pg_advisory_xact_lock(
                    sa.func.hashtextextended(f"redrive.reconcile:{final.pipeline}:{final.entity_ref}", 0))))
                if not _still_missing(conn, final):
                    continue
                recorded = runtime.fail_for_good(final, conn=conn)
            repaired.append(Repaired(final.pipeline, final.entity_ref, recorded.dead_letter.id))
            log.warning("%s %s was failed for good without a dead letter; repaired as dead letter %s",
                        name, final.entity_ref, recorded.dead_letter.id)
    if repaired:
        runtime.try_dispatch()
    return repaired


def next_since(previous: datetime | None, started: datetime, repaired: Sequence[Repaired], limit: int, *,
               grace_seconds: float = DEFAULT_GRACE_SECONDS, overlap_seconds: float = OVERLAP_SECONDS) -> datetime | None:
    """Where the next pass starts: a little before this one's start (its grace and the overlap), or where
    this one started when it took a full batch of some pipeline's (the rest of the backlog is still to come)."""
    per_pipeline: dict[str, int] = {}
    for r in repaired:
        per_pipeline[r.pipeline] = per_pipeline.get(r.pipeline, 0) + 1
    if any(n >= limit for n in per_pipeline.values()):
        return previous
    return started - timedelta(seconds=grace_seconds + overlap_seconds)
