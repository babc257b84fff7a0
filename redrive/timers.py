"""Durable retry timers: a wait too long to hold a Dagster run worker for lives here instead.

Dagster sleeps inside the run for `RetryRequested.seconds_to_wait`, so a 30-minute
backoff would idle a worker for 30 minutes and die with it on a restart. Instead the
entity's next attempt is a row; a sensor requests a run when it is due, with a run
key built from the entity and the attempt, so repeated ticks start nothing twice.
The run consumes its timer when it starts. The sensor only reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from redrive.schema import deferred_attempts


@dataclass(frozen=True)
class Timer:
    pipeline: str
    entity_ref: str
    attempt: int
    due_at: datetime
    payload: Mapping[str, Any]


def defer(conn: sa.Connection, timer: Timer) -> bool:
    """Record the next attempt; False if that attempt of that entity already has a timer."""
    row = conn.execute(
        insert(deferred_attempts)
        .values(pipeline=timer.pipeline, entity_ref=timer.entity_ref, attempt=timer.attempt,
                due_at=timer.due_at, payload=dict(timer.payload))
        .on_conflict_do_nothing(index_elements=["pipeline", "entity_ref", "attempt"])
        .returning(deferred_attempts.c.id)
    ).first()
    return row is not None


def due(conn: sa.Connection, now: datetime, *, pipeline: str | None = None, limit: int = 100) -> list[Timer]:
    q = (
        sa.select(deferred_attempts)
        .where(deferred_attempts.c.status == "waiting", deferred_attempts.c.due_at <= now)
        .order_by(deferred_attempts.c.due_at)
        .limit(limit)
    )
    if pipeline:
        q = q.where(deferred_attempts.c.pipeline == pipeline)
    return [Timer(r.pipeline, r.entity_ref, r.attempt, r.due_at, r.payload) for r in conn.execute(q)]


def consume(conn: sa.Connection, pipeline: str, entity_ref: str, attempt: int, now: datetime) -> bool:
    """Mark the timer used by the run that serves it; False if it was already consumed."""
    result = conn.execute(
        sa.update(deferred_attempts)
        .where(deferred_attempts.c.pipeline == pipeline, deferred_attempts.c.entity_ref == entity_ref,
               deferred_attempts.c.attempt == attempt, deferred_attempts.c.status == "waiting")
        .values(status="requested", requested_at=now)
    )
    return result.rowcount == 1
