"""Counters that never go back: named, labelled totals kept by increments where the event happens.

A metric read by scanning history costs more every day and drops when the pruner deletes the
history (issue 28). So an event adds to its counter in the transaction that records it
(`INSERT … ON CONFLICT DO UPDATE SET value = value + n`), and a scrape sums a table whose size
is the number of series, not the number of events. Nothing ever deletes a counter row.

Hot rows: every drain settle, worker turn and alert delivery adds to a handful of keys. Each key
is spread over :data:`SHARDS` rows, picked by the writer's backend (`pg_backend_pid() % SHARDS`),
so concurrent writers on different connections mostly lock different rows; a scrape sums the
shards. Rows of one statement are written in key order, so two writers never lock in opposite
orders.

Order of counting in one transaction, kept everywhere so two writers cannot deadlock: stage
observations (:mod:`redrive.observations`) before counters of this table, except pipeline event
counters written by a trigger before observations of the same statement (conversion's events).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

from redrive.schema import NOW, TZ, metadata

SHARDS = 16

# Counter names of the core (pipelines may keep their own under their own prefix).
ITEMS_FAILED = "items_failed"  # labels: pipeline, error_class — an entity newly dead-lettered (or its replay failed)
ALERTS_SENT = "alerts_sent"  # labels: pipeline, channel — one per message a channel accepted

metric_counters = sa.Table(
    "metric_counters",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("labels", JSONB, primary_key=True, server_default=sa.text("'{}'::jsonb")),
    sa.Column("shard", sa.SmallInteger, primary_key=True, server_default="0"),
    sa.Column("value", sa.Float, nullable=False, server_default="0"),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
)


@dataclass(frozen=True)
class Increment:
    name: str
    labels: Mapping[str, str]
    value: float = 1.0


def _key(labels: Mapping[str, str]) -> str:
    return json.dumps({k: str(v) for k, v in labels.items()}, sort_keys=True)


# One statement for any number of increments: merged per key by the caller, written in key order.
_ADD = sa.text(
    "INSERT INTO metric_counters (name, labels, shard, value) "
    "SELECT n, CAST(l AS jsonb), CAST(pg_backend_pid() % :shards AS smallint), v "
    "FROM unnest(CAST(:names AS text[]), CAST(:labels AS text[]), CAST(:values AS float8[])) AS x(n, l, v) "
    "ORDER BY n, l "
    "ON CONFLICT (name, labels, shard) DO UPDATE SET value = metric_counters.value + excluded.value, "
    "updated_at = now()"
)


def add(conn: sa.Connection, name: str, labels: Mapping[str, str], value: float = 1.0) -> None:
    """Add ``value`` to one counter, in the caller's transaction."""
    add_many(conn, [Increment(name, labels, value)])


def add_many(conn: sa.Connection, increments: Iterable[Increment]) -> None:
    """Add every increment in ONE statement (a batch's events add to each hot row once)."""
    merged: dict[tuple[str, str], float] = defaultdict(float)
    for inc in increments:
        if inc.value < 0:
            raise ValueError(f"counter {inc.name} cannot go back ({inc.value})")
        if inc.value:
            merged[(inc.name, _key(inc.labels))] += inc.value
    if not merged:
        return
    keys = sorted(merged)
    conn.execute(_ADD, {"shards": SHARDS, "names": [k[0] for k in keys], "labels": [k[1] for k in keys],
                        "values": [merged[k] for k in keys]})


def read(conn: sa.Connection, names: Iterable[str] | None = None) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{name: {sorted label pairs: total over shards}}; a scrape reads one row per series and shard."""
    t = metric_counters
    q = sa.select(t.c.name, t.c.labels, sa.func.sum(t.c.value)).group_by(t.c.name, t.c.labels)
    if names is not None:
        q = q.where(t.c.name.in_(list(names)))
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    for name, labels, total in conn.execute(q):
        out[name][tuple(sorted((k, str(v)) for k, v in (labels or {}).items()))] = float(total)
    return out
