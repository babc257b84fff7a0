"""A stalled pipeline is news (issue 25 §3): due work and no progress for a set time.

Progress is a pipeline's counter of settled stage attempts (the rollup every process writes,
`redrive.observations`; conversion's job events add to it through their trigger): it moves whenever
any attempt finishes, succeeds or fails. The stall watch (`sensors.core.pipeline_stall_sensor`)
reads each counter and the due work every tick and keeps, per pipeline, when it last moved
(`pipeline_progress`). `next_state` is the pure policy: a pipeline with nothing due is never
stalled; one with due work whose counter has not moved for `limit` seconds is, until it moves.
The watch alerts once per stall (the dedupe key names when it began), reports a failing
`pipeline_progressing` check on `<pipeline>_backlog`, and the metrics endpoint serves
`redrive_pipeline_seconds_without_progress`; all three clear when the counter moves again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from redrive.observations import Observation
from redrive.schema import pipeline_progress

STALLED, CLEARED = "stalled", "cleared"
Change = Literal["stalled", "cleared"] | None


@dataclass(frozen=True)
class StallState:
    progress: int  # the counter as last seen
    progressed_at: datetime  # when it last moved (or when work became due after an idle spell)
    due: int
    stalled_since: datetime | None

    def seconds_without_progress(self, now: datetime) -> float:
        return max(0.0, (now - self.progressed_at).total_seconds()) if self.due else 0.0


def next_state(prev: StallState | None, *, progress: int, due: int, now: datetime,
               limit: float) -> tuple[StallState, Change]:
    """Pure: the pipeline's new state and whether it just stalled or just cleared."""
    if prev is None:
        return StallState(progress, now, due, None), None
    moved = progress != prev.progress
    # idle is not stalled: the clock of a stall starts when work is due and nothing moves
    progressed_at = now if moved or due == 0 or prev.due == 0 else prev.progressed_at
    stalled = due > 0 and (now - progressed_at).total_seconds() > limit
    since = (prev.stalled_since or now) if stalled else None
    change: Change = STALLED if stalled and prev.stalled_since is None else \
        CLEARED if not stalled and prev.stalled_since is not None else None
    return StallState(progress, progressed_at, due, since), change


def progress_counts(observations: Iterable[Observation]) -> dict[str, int]:
    """Each pipeline's counter: every settled stage attempt and finished entity it has recorded."""
    out: dict[str, int] = {}
    for o in observations:
        out[o.pipeline] = out.get(o.pipeline, 0) + o.count
    return out


def load(conn: sa.Connection) -> dict[str, StallState]:
    t = pipeline_progress
    return {r.pipeline: StallState(r.progress, r.progressed_at, r.due, r.stalled_since)
            for r in conn.execute(sa.select(t.c.pipeline, t.c.progress, t.c.progressed_at, t.c.due,
                                            t.c.stalled_since))}


def save(conn: sa.Connection, states: Mapping[str, StallState], *, now: datetime) -> None:
    if not states:
        return
    rows = [{"pipeline": p, "progress": s.progress, "progressed_at": s.progressed_at, "due": s.due,
             "stalled_since": s.stalled_since, "checked_at": now} for p, s in states.items()]
    stmt = insert(pipeline_progress)
    conn.execute(stmt.on_conflict_do_update(index_elements=["pipeline"], set_={
        "progress": stmt.excluded.progress, "progressed_at": stmt.excluded.progressed_at, "due": stmt.excluded.due,
        "stalled_since": stmt.excluded.stalled_since, "checked_at": stmt.excluded.checked_at}), rows)
