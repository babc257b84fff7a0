"""Reading dead letters: the record, the filter and the two queries, with no SQLAlchemy import.

`redrive.deadletters` runs these queries through a SQLAlchemy connection; `redrive dlq list/show`
runs the same text on a bare DB-API (psycopg2) cursor, so an operator's read pays for neither
SQLAlchemy nor Dagster (issue 16 §6). One query text, two drivers: nothing is copied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

OPEN, REPLAYING, ESCALATED, RESOLVED = "open", "replaying", "escalated", "resolved"
STATUSES = (OPEN, REPLAYING, ESCALATED, RESOLVED)


@dataclass(frozen=True)
class DeadLetter:
    id: int
    pipeline: str
    stage: str
    entity_ref: str
    tenant: str | None
    error_class: str
    error_message: str
    retryable: bool
    last_stack: str
    sanitized_context: Mapping[str, Any]
    payload_ref: Mapping[str, Any]
    attempts: int
    stage_attempts: Mapping[str, int]
    upstream_status: int | None
    first_failure_at: datetime
    last_failure_at: datetime
    occurrences: int
    status: str
    replay_count: int
    replay_from: str | None
    remediation_evidence: str | None
    notes: Sequence[Mapping[str, Any]]
    run_id: str | None
    escalated_at: datetime | None
    resolved_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> DeadLetter:
        m = row._mapping if hasattr(row, "_mapping") else row
        return cls(**{f: m[f] for f in cls.__dataclass_fields__})

    def as_json(self) -> dict[str, Any]:
        out = {}
        for key, value in self.__dict__.items():
            out[key] = value.isoformat() if isinstance(value, datetime) else value
        return out


@dataclass(frozen=True)
class Filter:
    pipeline: str | None = None
    error_class: str | None = None
    statuses: Sequence[str] = (OPEN, ESCALATED)
    since: datetime | None = None
    until: datetime | None = None
    limit: int = 100
    entity: str | None = None  # the entity, or entities under it (a partition's users, a file job's rows)
    search: str | None = None  # text in the message, entity, stage or error class (case-insensitive)
    stage: str | None = None
    fingerprint: str | None = None  # a root-cause group (GROUPS_SQL)


# A root cause: letters of one pipeline, stage and error class whose sanitized messages differ only in ids and
# numbers (uuids, hex digests, counts, ports…) share a fingerprint, computed by the database so a group is one
# query however many letters it holds.
NORMALIZED_MESSAGE = (
    "regexp_replace(regexp_replace(regexp_replace(error_message,"
    " '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}', '<id>', 'gi'),"
    " '[0-9a-f]{16,}', '<hex>', 'gi'), '[0-9]+', '<n>', 'g')")
FINGERPRINT = f"left(md5(pipeline || '|' || stage || '|' || error_class || '|' || {NORMALIZED_MESSAGE}), 12)"


COLUMNS = ", ".join(f.name for f in fields(DeadLetter))

# pyformat parameters: what psycopg2 takes, and SQLAlchemy's exec_driver_sql passes through.
GET_SQL = f"SELECT {COLUMNS} FROM dead_letters WHERE id = %(id)s"
LIST_SQL = f"""
SELECT {COLUMNS} FROM dead_letters
WHERE (%(pipeline)s::text IS NULL OR pipeline = %(pipeline)s)
  AND (%(error_class)s::text IS NULL OR error_class = %(error_class)s)
  AND (cardinality(%(statuses)s::text[]) = 0 OR status = ANY(%(statuses)s::text[]))
  AND (%(since)s::timestamptz IS NULL OR last_failure_at >= %(since)s)
  AND (%(until)s::timestamptz IS NULL OR last_failure_at < %(until)s)
  AND (%(stage)s::text IS NULL OR stage = %(stage)s)
  AND (%(entity)s::text IS NULL OR entity_ref = %(entity)s OR starts_with(entity_ref, %(entity)s || ':')
       OR starts_with(entity_ref, %(entity)s || '/'))
  AND (%(search)s::text IS NULL OR strpos(lower(error_message || ' ' || entity_ref || ' ' || stage || ' '
       || error_class), lower(%(search)s)) > 0)
  AND (%(fingerprint)s::text IS NULL OR {FINGERPRINT} = %(fingerprint)s)
ORDER BY last_failure_at DESC, id DESC
LIMIT %(limit)s
"""

# The open letters by root cause: counts, first and last seen, the newest one as a sample.
GROUPS_SQL = f"""
SELECT pipeline, stage, error_class, {FINGERPRINT} AS fingerprint, count(*) AS letters,
       sum(occurrences) AS occurrences, min(first_failure_at) AS first_seen, max(last_failure_at) AS last_seen,
       (array_agg(id ORDER BY last_failure_at DESC, id DESC))[1] AS sample_id,
       (array_agg(entity_ref ORDER BY last_failure_at DESC, id DESC))[1] AS sample_entity,
       (array_agg(error_message ORDER BY last_failure_at DESC, id DESC))[1] AS sample_message
FROM dead_letters
WHERE (%(pipeline)s::text IS NULL OR pipeline = %(pipeline)s)
  AND (cardinality(%(statuses)s::text[]) = 0 OR status = ANY(%(statuses)s::text[]))
GROUP BY pipeline, stage, error_class, {FINGERPRINT}
ORDER BY letters DESC, last_seen DESC
LIMIT %(limit)s
"""


@dataclass(frozen=True)
class Group:
    """A root cause of dead letters (GROUPS_SQL)."""

    pipeline: str
    stage: str
    error_class: str
    fingerprint: str
    letters: int
    occurrences: int
    first_seen: datetime
    last_seen: datetime
    sample_id: int
    sample_entity: str
    sample_message: str

    def as_json(self) -> dict[str, Any]:
        return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in self.__dict__.items()}


def list_params(flt: Filter) -> dict[str, Any]:
    return {"pipeline": flt.pipeline or None, "error_class": flt.error_class or None,
            "statuses": list(flt.statuses), "since": flt.since, "until": flt.until, "limit": flt.limit,
            "stage": flt.stage or None, "entity": flt.entity or None, "search": flt.search or None,
            "fingerprint": flt.fingerprint or None}


def groups(cursor: Any, flt: Filter = Filter()) -> list[Group]:
    """The letters by root cause, largest group first, on a DB-API cursor (or SQLAlchemy's exec_driver_sql)."""
    cursor.execute(GROUPS_SQL, list_params(flt))
    names = [d[0] for d in cursor.description]
    return [Group(**dict(zip(names, r, strict=True))) for r in cursor.fetchall()]


def rows_of(cursor: Any) -> list[DeadLetter]:
    """The cursor's rows (after GET_SQL or LIST_SQL) as dead letters."""
    names = [d[0] for d in cursor.description]
    return [DeadLetter.from_row(dict(zip(names, r, strict=True))) for r in cursor.fetchall()]


def list_(cursor: Any, flt: Filter = Filter()) -> list[DeadLetter]:
    """Dead letters by filter, newest failure first, on a DB-API cursor."""
    cursor.execute(LIST_SQL, list_params(flt))
    return rows_of(cursor)


def get(cursor: Any, dead_letter_id: int) -> DeadLetter | None:
    cursor.execute(GET_SQL, {"id": dead_letter_id})
    found = rows_of(cursor)
    return found[0] if found else None
