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
from datetime import timedelta

import sqlalchemy as sa

from redrive import deadletters
from redrive.deadletters import FinalFailure
from redrive.reliability import Reliability

__all__ = ["DEFAULT_GRACE_SECONDS", "FailedForGood", "Repaired", "reconcile"]

log = logging.getLogger(__name__)

FailedForGood = Callable[[sa.Connection, int], Sequence[FinalFailure]]
"""``(conn, limit)`` → up to ``limit`` final failures with no dead letter, oldest first, each ``at`` its
failure time (so the letter written for it satisfies :func:`redrive.deadletters.unrecorded`)."""

DEFAULT_GRACE_SECONDS = 60.0
"""Failures younger than this are left to the pipeline's own second commit, which is normally milliseconds away."""


@dataclass(frozen=True)
class Repaired:
    pipeline: str
    entity_ref: str
    dead_letter_id: int


def _still_missing(conn: sa.Connection, final: FinalFailure) -> bool:
    return bool(conn.execute(sa.select(deadletters.unrecorded(
        final.pipeline, sa.literal(final.entity_ref), sa.literal(final.at)))).scalar())


def reconcile(runtime: Reliability, sources: Mapping[str, FailedForGood], *, limit: int = 100,
              grace_seconds: float = DEFAULT_GRACE_SECONDS) -> list[Repaired]:
    """Write the missing dead letter and alert of each entity the sources report; returns what was repaired.

    Idempotent under concurrent runs: each repair takes a transaction-scoped advisory lock on its
    entity and checks again under it, so a second reconciler (or the pipeline's own late write)
    finds the letter and does nothing. Alerts are sent after commit (or by the alert sensor).
    """
    cutoff = runtime.now() - timedelta(seconds=grace_seconds)
    repaired: list[Repaired] = []
    for name, source in sources.items():
        with runtime.engine.connect() as conn:
            candidates = [f for f in source(conn, limit) if f.at <= cutoff]
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
