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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY

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
    if seconds is not None and count != 1:
        raise ValueError("a timed observation counts one attempt")
    if seconds is not None:
        observe_many(conn, pipeline, stage, outcome, [seconds], error_class=error_class)
    else:
        _add(conn, pipeline, stage, outcome, error_class, count, [])


def observe_many(conn: sa.Connection, pipeline: str, stage: str, outcome: str, seconds: Sequence[float], *,
                 error_class: str | None = None) -> None:
    """One timed observation per element of ``seconds`` (a negative one is counted, not timed), as ONE
    upsert: a batch of work adds its outcomes to the hot row once instead of once per item."""
    _add(conn, pipeline, stage, outcome, error_class, len(seconds), [s for s in seconds if s >= 0])


def _add(conn: sa.Connection, pipeline: str, stage: str, outcome: str, error_class: str | None, count: int,
         timed: Sequence[float]) -> None:
    if outcome not in OUTCOMES:
        raise ValueError(f"unknown outcome {outcome!r}")
    if count <= 0:
        return
    buckets = [0] * (len(BUCKETS) + 1)
    for seconds in timed:
        buckets[bucket_of(seconds)] += 1
    conn.execute(_ADD, {"pipeline": pipeline, "stage": stage, "outcome": outcome, "error_class": error_class or "",
                        "count": count, "buckets": buckets, "sum_seconds": float(sum(timed))})


# Adds a count, per-bucket counts and a sum to the row (element by element for the buckets); one
# compiled statement for every pipeline, stage and bucket.
_ADD = sa.text(
    "INSERT INTO stage_observations (pipeline, stage, outcome, error_class, count, buckets, sum_seconds) "
    "VALUES (:pipeline, :stage, :outcome, :error_class, :count, CAST(:buckets AS bigint[]), :sum_seconds) "
    "ON CONFLICT (pipeline, stage, outcome, error_class) DO UPDATE SET "
    "count = stage_observations.count + excluded.count, "
    "buckets = ARRAY(SELECT o.n + a.n FROM unnest(stage_observations.buckets) WITH ORDINALITY AS o(n, i) "
    "JOIN unnest(excluded.buckets) WITH ORDINALITY AS a(n, i) USING (i) ORDER BY i), "
    "sum_seconds = stage_observations.sum_seconds + excluded.sum_seconds, updated_at = now()"
)


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
