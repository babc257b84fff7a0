"""What every pipeline's work did, counted in PostgreSQL: stage outcomes and stage latency buckets.

Work runs in many processes (run workers, conversion workers, drains), so counters in one
process's memory would each see a slice, and a run worker's die with it; a Prometheus
multiprocess directory needs one shared disk, which run workers on other hosts (Kubernetes
pods, ECS tasks) do not have. So the core adds each outcome to one row per (pipeline, stage,
outcome, error class) — a counter and the latency histogram's buckets — and the metrics
endpoint reads the rows at scrape time (:mod:`redrive.metrics`). Counters survive restarts
and agree across processes; the cost is one upsert per stage attempt, in the transaction the
caller already has where it has one.

Outcomes: ``ok`` (a stage attempt succeeded), ``retry`` (a failed attempt, retried later),
``failed`` (failed for good: dead-lettered), ``done`` (an entity finished all its stages).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, insert

from redrive.schema import NOW, TZ, metadata

OK, RETRY, FAILED, DONE = "ok", "retry", "failed", "done"
OUTCOMES = (OK, RETRY, FAILED, DONE)

# Seconds; from a cached checkpoint read to an LLM call under a slow upstream (the +Inf bucket is implied).
BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

stage_observations = sa.Table(
    "stage_observations",
    metadata,
    sa.Column("pipeline", sa.Text, primary_key=True),
    sa.Column("stage", sa.Text, primary_key=True),
    sa.Column("outcome", sa.Text, primary_key=True),
    sa.Column("error_class", sa.Text, primary_key=True, server_default=""),
    sa.Column("count", sa.BigInteger, nullable=False, server_default="0"),
    # timed observations only: per bucket (not cumulative; the last is +Inf), and their sum in seconds
    sa.Column("buckets", ARRAY(sa.BigInteger), nullable=False),
    sa.Column("sum_seconds", sa.Float, nullable=False, server_default="0"),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    sa.CheckConstraint("outcome IN ('ok', 'retry', 'failed', 'done')", name="outcome"),
)


def bucket_of(seconds: float) -> int:
    """Index of the first bucket whose upper bound holds ``seconds`` (len(BUCKETS) for +Inf)."""
    return bisect.bisect_left(BUCKETS, seconds)


def cumulative(buckets: Iterable[int]) -> list[int]:
    """Prometheus buckets are cumulative: each counts every observation at or below its bound."""
    out, total = [], 0
    for n in buckets:
        total += n
        out.append(total)
    return out


def observe(conn: sa.Connection, pipeline: str, stage: str, outcome: str, *, error_class: str | None = None,
            seconds: float | None = None, count: int = 1) -> None:
    """Count ``count`` outcomes (one, with its duration, when timed) in the caller's transaction."""
    if outcome not in OUTCOMES:
        raise ValueError(f"unknown outcome {outcome!r}")
    if seconds is not None and count != 1:
        raise ValueError("a timed observation counts one attempt")
    if count <= 0:
        return
    empty = [0] * (len(BUCKETS) + 1)
    timed = seconds is not None and seconds >= 0
    if timed:
        empty[bucket_of(seconds)] = 1
    t = stage_observations
    stmt = insert(t).values(pipeline=pipeline, stage=stage, outcome=outcome, error_class=error_class or "", count=count,
                            buckets=empty, sum_seconds=seconds if timed else 0.0)
    update: dict[str, object] = {"count": t.c.count + count, "updated_at": sa.func.now()}
    if timed:
        index = bucket_of(seconds) + 1  # PostgreSQL arrays count from 1
        update["buckets"] = _bump(index)
        update["sum_seconds"] = t.c.sum_seconds + seconds
    conn.execute(stmt.on_conflict_do_update(index_elements=["pipeline", "stage", "outcome", "error_class"],
                                            set_=update))


def _bump(index: int) -> sa.ColumnElement[object]:
    """``buckets`` with element ``index`` (1-based) plus one, as one expression over the stored row."""
    # the slices before and after around the bumped element (an empty slice when it is the first or last)
    return sa.literal_column(
        f"(stage_observations.buckets[1:{index - 1}] || (stage_observations.buckets[{index}] + 1) "
        f"|| stage_observations.buckets[{index + 1}:{len(BUCKETS) + 1}])")


@dataclass(frozen=True)
class Observation:
    pipeline: str
    stage: str
    outcome: str
    error_class: str
    count: int
    buckets: tuple[int, ...]
    sum_seconds: float


def read_all(conn: sa.Connection) -> list[Observation]:
    t = stage_observations
    rows = conn.execute(sa.select(t.c.pipeline, t.c.stage, t.c.outcome, t.c.error_class, t.c.count, t.c.buckets,
                                  t.c.sum_seconds).order_by(t.c.pipeline, t.c.stage, t.c.outcome, t.c.error_class))
    return [Observation(r.pipeline, r.stage, r.outcome, r.error_class, r.count, tuple(r.buckets), r.sum_seconds)
            for r in rows]
