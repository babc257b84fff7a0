"""What every pipeline's work did, counted in PostgreSQL: stage outcomes and stage latency buckets.

Work runs in many processes (run workers, conversion workers, drains), so counters in one
process's memory would each see a slice, and a run worker's die with it; a Prometheus
multiprocess directory needs one shared disk, which run workers on other hosts (Kubernetes
pods, ECS tasks) do not have. So the core adds each outcome to one row per (pipeline, stage,
outcome, error class) — a counter and the latency histogram's buckets, spread over a few
shard rows against hot-row contention (:mod:`redrive.counters`) — and the metrics endpoint
reads the rows at scrape time (:mod:`redrive.metrics`). Counters survive restarts, agree
across processes and never go back (the pruner deletes history, never these rows); a scrape
reads one row per series and shard however long the history; the cost is one upsert per stage
attempt, in the transaction the caller already has where it has one.

Outcomes: ``ok`` (a stage attempt succeeded), ``retry`` (a failed attempt given another attempt
later), ``failed`` (an attempt that failed for good: every one, a rerun's repeat of a dead-lettered
failure too; how many *entities* were dead-lettered is the counter ``items_failed``),
``done`` (an entity finished all its stages).
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
    # the writer's backend picks one of a few rows per key (redrive.counters: hot rows); readers sum them
    sa.Column("shard", sa.SmallInteger, primary_key=True, server_default="0"),
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
    conn.execute(_ADD, {"pipeline": pipeline, "stage": stage, "outcome": outcome, "error_class": error_class or "",
                        "count": count, "seconds": [float(s) for s in timed]})


# `redrive_observe` (migration 0020) buckets the durations the way `bucket_of` does and adds count,
# buckets and sum to the row of the writer's shard: one implementation in SQL, so a pipeline that
# counts in a trigger (conversion's job events) and a Python caller fill the same rows the same way.
_ADD = sa.text("SELECT redrive_observe(:pipeline, :stage, :outcome, :error_class, :count, "
               "CAST(:seconds AS float8[]))")

# The function's bucket bounds are these (a test compares it with `bucket_of`).
OBSERVE_FUNCTION_BOUNDS = "{" + ",".join(repr(b) for b in BUCKETS) + "}"


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
    """Every (pipeline, stage, outcome, error class), its shards summed."""
    t = stage_observations
    merged: dict[tuple[str, str, str, str], tuple[int, list[int], float]] = {}
    rows = conn.execute(sa.select(t.c.pipeline, t.c.stage, t.c.outcome, t.c.error_class, t.c.count, t.c.buckets,
                                  t.c.sum_seconds))
    for r in rows:
        key = (r.pipeline, r.stage, r.outcome, r.error_class)
        count, buckets, total = merged.get(key, (0, [0] * (len(BUCKETS) + 1), 0.0))
        merged[key] = (count + r.count, [a + b for a, b in zip(buckets, r.buckets, strict=False)],
                       total + r.sum_seconds)
    return [Observation(*key, count, tuple(buckets), total)
            for key, (count, buckets, total) in sorted(merged.items())]
