"""All SQL of matchmaking: users (what matching needs), per-user jobs (ADR-0004) and the offers.

The database enforces what the ADR promises: one job per (date, user) (`UNIQUE(date, user_id)`),
one offer per (date, user, candidate) (the primary key is the deterministic uuid5), one offer per
(date, user, rank) — so a second, different set for a user's day is refused, not stored — and
offers exist only under their job (foreign key). Every statement takes a whole chunk of users
(`unnest` of arrays), never one user at a time. Functions take a `Connection`; the caller owns
the transaction.
"""

from __future__ import annotations

from typing import Any

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from assets.matchmaking.policy import GENDER_BITS, POOL_COLUMNS, OfferRow, PartitionHealth
from redrive.schema import NOW, TZ, metadata

if TYPE_CHECKING:  # imported where the pool is read (~0.25 s of CPU): every run worker loads this module
    import pandas as pd

JOB_STATUSES = ("pending", "running", "completed", "failed")
UUID = sa.Uuid(as_uuid=False)

# What matching needs of a user. The app owns these rows; profile fields are nullable because the
# app's data can be incomplete, and matchmaking re-validates them (ADR-0004 "data inconsistency").
matchmaking_users = sa.Table(
    "matchmaking_users",
    metadata,
    sa.Column("id", UUID, primary_key=True, server_default=sa.text("gen_random_uuid()")),
    sa.Column("timezone", sa.Text, nullable=False),
    sa.Column("active", sa.Boolean, nullable=False, server_default=sa.true()),
    sa.Column("region", sa.Text),  # metro area: candidates come from the same region
    sa.Column("gender", sa.Text),  # f, m, x
    sa.Column("seeking", ARRAY(sa.Text), nullable=False, server_default=sa.text("'{}'::text[]")),
    sa.Column("birth_date", sa.Date),
    sa.Column("age_min", sa.SmallInteger),
    sa.Column("age_max", sa.SmallInteger),
    sa.Column("latitude", sa.Double),
    sa.Column("longitude", sa.Double),
    sa.Column("max_distance_km", sa.SmallInteger),
    sa.Column("interests", ARRAY(sa.SmallInteger), nullable=False, server_default=sa.text("'{}'::smallint[]")),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    sa.Index("ix_matchmaking_users_pool", "timezone", "region", "id", postgresql_where=sa.text("active")),
)

# ADR-0004 "Job Record Schema", column for column (retry_count is NOT NULL here: it is always counted).
matchmaking_jobs = sa.Table(
    "matchmaking_jobs",
    metadata,
    sa.Column("id", UUID, primary_key=True, server_default=sa.text("gen_random_uuid()")),
    sa.Column("date", sa.Date, nullable=False),
    sa.Column("timezone", sa.Text, nullable=False),
    sa.Column("user_id", UUID, sa.ForeignKey("matchmaking_users.id", ondelete="CASCADE"), nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("offers", JSONB),
    sa.Column("started_at", TZ),
    sa.Column("completed_at", TZ),
    sa.Column("error_message", sa.Text),
    sa.Column("retry_count", sa.Integer, nullable=False, server_default="0"),
    sa.UniqueConstraint("date", "user_id"),
    sa.CheckConstraint("status IN ('pending', 'running', 'completed', 'failed')", name="status"),
    sa.Index("idx_matchmaking_jobs_status", "status"),
    sa.Index("idx_matchmaking_jobs_date_timezone", "date", "timezone"),
    sa.Index("ix_matchmaking_jobs_finished", "completed_at",
             postgresql_where=sa.text("status IN ('completed', 'failed')")),  # the pruner's range
)

matchmaking_offers = sa.Table(
    "matchmaking_offers",
    metadata,
    sa.Column("id", UUID, primary_key=True),  # uuid5("{date}:{user}:{candidate}")
    sa.Column("date", sa.Date, nullable=False),
    sa.Column("timezone", sa.Text, nullable=False),
    sa.Column("user_id", UUID, nullable=False),
    sa.Column("candidate_id", UUID, sa.ForeignKey("matchmaking_users.id", ondelete="CASCADE"), nullable=False),
    sa.Column("rank", sa.SmallInteger, nullable=False),
    sa.Column("compatibility_score", sa.Double, nullable=False),
    sa.Column("algorithm_version", sa.Text, nullable=False),
    sa.Column("offered_at", TZ, nullable=False),
    sa.Column("expires_at", TZ, nullable=False),
    sa.ForeignKeyConstraint(["date", "user_id"], ["matchmaking_jobs.date", "matchmaking_jobs.user_id"],
                            ondelete="CASCADE"),
    sa.UniqueConstraint("date", "user_id", "rank"),
    sa.CheckConstraint("user_id <> candidate_id", name="not_self"),
    sa.CheckConstraint("rank >= 1", name="rank"),
    sa.CheckConstraint("compatibility_score >= 0 AND compatibility_score <= 1", name="score"),
    sa.CheckConstraint("expires_at > offered_at", name="window"),
    sa.Index("ix_matchmaking_offers_candidate_id", "candidate_id"),
)


def _bits(column: str) -> str:
    return " | ".join(f"(CASE WHEN '{g}' = ANY({column}) THEN {b} ELSE 0 END)" for g, b in GENDER_BITS.items())


_POOL_SQL = sa.text(f"""
    SELECT u.id::text AS id,
           u.region,
           CASE u.gender {" ".join(f"WHEN '{g}' THEN {b}" for g, b in GENDER_BITS.items())} ELSE 0 END AS gender_bits,
           {_bits("u.seeking")} AS seeking_bits,
           NOT (u.seeking <@ ARRAY[{", ".join(f"'{g}'" for g in GENDER_BITS)}]::text[]) AS seeking_unknown,
           date_part('year', age(CAST(:day AS date), u.birth_date))::int AS age,
           u.age_min, u.age_max, u.latitude, u.longitude, u.max_distance_km,
           COALESCE((SELECT bit_or(1::bigint << t) FROM unnest(u.interests) AS t WHERE t BETWEEN 0 AND 63), 0)
               AS interests_bits,
           EXISTS (SELECT 1 FROM unnest(u.interests) AS t WHERE t IS NULL OR t NOT BETWEEN 0 AND 63)
               AS interests_unknown
      FROM matchmaking_users u
     WHERE u.timezone = :tz AND u.active
     ORDER BY u.region, u.id
""")


def load_pool(conn: sa.Connection, day: date, timezone: str) -> pd.DataFrame:
    """The active users of a timezone with their matching features — one query for the whole pool."""
    import pandas as pd

    result = conn.execute(_POOL_SQL, {"day": day, "tz": timezone})
    return pd.DataFrame(result.fetchall(), columns=list(POOL_COLUMNS))


def set_timeouts(conn: sa.Connection, lock_timeout_ms: int, statement_timeout_ms: int) -> None:
    """A stuck lock or statement becomes a retryable error (SQLSTATE 55P03 / 57014), not a hung run."""
    conn.execute(sa.text("SELECT set_config('lock_timeout', :l, true), set_config('statement_timeout', :s, true)"),
                 {"l": f"{int(lock_timeout_ms)}ms", "s": f"{int(statement_timeout_ms)}ms"})


@dataclass(frozen=True)
class Claimed:
    user_id: str
    retry_count: int
    previous_error: str | None  # set when an earlier attempt failed (its dead letter may be open)


_CLAIM_SQL = sa.text("""
    INSERT INTO matchmaking_jobs (date, timezone, user_id, status, started_at)
    SELECT CAST(:day AS date), :tz, x.user_id, 'running', now()
      FROM unnest(CAST(:users AS uuid[])) WITH ORDINALITY AS x(user_id, n)
     ORDER BY x.n
    ON CONFLICT (date, user_id) DO UPDATE
       SET status = 'running',
           timezone = EXCLUDED.timezone,
           started_at = now(),
           retry_count = matchmaking_jobs.retry_count + 1
     WHERE matchmaking_jobs.status <> 'completed'
    RETURNING user_id::text AS user_id, retry_count, error_message
""")


def claim(conn: sa.Connection, day: date, timezone: str, user_ids: Sequence[str]) -> list[Claimed]:
    """ADR-0004's upsert for a chunk: new or unfinished jobs become `running` and are returned;
    completed ones are not returned (the idempotent path: never recomputed).

    Users go in sorted order so two runs of one partition lock rows in the same order.
    """
    rows = conn.execute(_CLAIM_SQL, {"day": day, "tz": timezone, "users": sorted(user_ids)})
    return [Claimed(r.user_id, r.retry_count, r.error_message) for r in rows]


_LOCK_UNFINISHED_SQL = sa.text("""
    SELECT user_id::text AS user_id FROM matchmaking_jobs
     WHERE date = :day AND user_id = ANY(CAST(:users AS uuid[])) AND status <> 'completed'
     ORDER BY user_id
       FOR UPDATE
""")

_COMPLETE_SQL = sa.text("""
    UPDATE matchmaking_jobs AS j
       SET status = 'completed', offers = x.offers, completed_at = now(), error_message = NULL
      FROM unnest(CAST(:users AS uuid[]), CAST(:docs AS jsonb[])) AS x(user_id, offers)
     WHERE j.date = :day AND j.user_id = x.user_id AND j.status <> 'completed'
""")

_OFFERS_SQL = sa.text("""
    INSERT INTO matchmaking_offers (id, date, timezone, user_id, candidate_id, rank, compatibility_score,
                                    algorithm_version, offered_at, expires_at)
    SELECT x.id, CAST(:day AS date), :tz, x.user_id, x.candidate_id, x.rank, x.score, :version, :offered_at,
           :expires_at
      FROM unnest(CAST(:ids AS uuid[]), CAST(:users AS uuid[]), CAST(:candidates AS uuid[]),
                  CAST(:ranks AS smallint[]), CAST(:scores AS float8[])) AS x(id, user_id, candidate_id, rank, score)
""")


def complete(conn: sa.Connection, day: date, timezone: str, offers: Mapping[str, Sequence[OfferRow]],
             documents: Mapping[str, str], *, algorithm_version: str, offered_at: datetime,
             expires_at: datetime) -> list[str]:
    """Store the offers and mark the jobs completed, in the caller's transaction; returns the users completed.

    Only users whose job is still unfinished are written: their rows are locked first (in id
    order), so when two runs race for a user exactly one writes its offers and completes it; the
    other finds it completed and writes nothing. A plain INSERT (no ON CONFLICT) for the offers: a
    second set for a user's day is a unique violation, surfaced as a data inconsistency.
    """
    users = sorted(documents)
    if not users:
        return []
    mine = [r.user_id for r in conn.execute(_LOCK_UNFINISHED_SQL, {"day": day, "users": users})]
    if not mine:
        return []
    conn.execute(_COMPLETE_SQL, {"day": day, "users": mine, "docs": [documents[u] for u in mine]})
    rows = [o for u in mine for o in offers.get(u, ())]
    if rows:
        conn.execute(_OFFERS_SQL, {
            "day": day, "tz": timezone, "version": algorithm_version, "offered_at": offered_at,
            "expires_at": expires_at, "ids": [o.id for o in rows], "users": [o.user_id for o in rows],
            "candidates": [o.candidate_id for o in rows], "ranks": [o.rank for o in rows],
            "scores": [o.score for o in rows],
        })
    return mine


_FAIL_SQL = sa.text("""
    INSERT INTO matchmaking_jobs (date, timezone, user_id, status, started_at, error_message)
    SELECT CAST(:day AS date), :tz, x.user_id, 'failed', now(), x.message
      FROM unnest(CAST(:users AS uuid[]), CAST(:messages AS text[])) WITH ORDINALITY AS x(user_id, message, n)
      JOIN matchmaking_users u ON u.id = x.user_id
     ORDER BY x.n
    ON CONFLICT (date, user_id) DO UPDATE
       SET status = 'failed', error_message = EXCLUDED.error_message
     WHERE matchmaking_jobs.status <> 'completed'
    RETURNING user_id::text AS user_id
""")


def mark_failed(conn: sa.Connection, day: date, timezone: str, messages: Mapping[str, str]) -> set[str]:
    """Jobs of these users become `failed` with their error (a later run retries them).

    Returns the users marked; a user completed meanwhile by another run, or deleted, is left alone.
    """
    users = sorted(messages)
    if not users:
        return set()
    rows = conn.execute(_FAIL_SQL, {"day": day, "tz": timezone, "users": users,
                                    "messages": [messages[u] for u in users]})
    return {r.user_id for r in rows}


def job_statuses(conn: sa.Connection, day: date, user_ids: Sequence[str]) -> dict[str, str]:
    """Status of these users' jobs on a date (users without a job are absent)."""
    rows = conn.execute(
        sa.select(matchmaking_jobs.c.user_id, matchmaking_jobs.c.status)
        .where(matchmaking_jobs.c.date == day, matchmaking_jobs.c.user_id.in_(list(user_ids))))
    return {str(r.user_id): r.status for r in rows}


_HEALTH_SQL = sa.text("""
    WITH jobs AS (
        SELECT count(*) AS jobs,
               count(*) FILTER (WHERE status = 'completed') AS completed,
               count(*) FILTER (WHERE status = 'failed') AS failed,
               count(*) FILTER (WHERE status IN ('pending', 'running')) AS unfinished
          FROM matchmaking_jobs WHERE date = :day AND timezone = :tz
    ), offers AS (
        SELECT o.id, o.user_id, o.candidate_id, j.status, j.offers
          FROM matchmaking_offers o
          LEFT JOIN matchmaking_jobs j ON j.date = o.date AND j.user_id = o.user_id
         WHERE o.date = :day AND o.timezone = :tz
    )
    SELECT jobs.*,
           (SELECT count(*) FROM offers) AS offers,
           (SELECT count(*) - count(DISTINCT (user_id, candidate_id)) FROM offers)
         + (SELECT count(*) FROM offers
             WHERE status IS DISTINCT FROM 'completed'
                OR NOT offers @> jsonb_build_array(jsonb_build_object('id', id::text))) AS duplicate_offers
      FROM jobs
""")


def partition_health(conn: sa.Connection, day: date, timezone: str) -> PartitionHealth:
    """Jobs by status and offers of a partition; a duplicate is an offer repeated or outside its user's recorded set."""
    row = conn.execute(_HEALTH_SQL, {"day": day, "tz": timezone}).one()
    return PartitionHealth(jobs=row.jobs, completed=row.completed, failed=row.failed, unfinished=row.unfinished,
                           offers=row.offers, duplicate_offers=row.duplicate_offers)


def retention_rules(settings: Any) -> list[Any]:
    """A user's finished job of a day goes with its offers (they expired the next day, ADR-0004) once the
    finished-work window has passed; a partition or user with an open dead letter keeps them. The users
    themselves are the pool, not history: never pruned."""
    from redrive.retention import FINISHED_WORK, Entity, Rule

    partition = "CAST(t.date AS text) || ':' || t.timezone"
    return [Rule("matchmaking.jobs", "matchmaking_jobs", ("id",), FINISHED_WORK, "t.completed_at",
                 "t.status IN ('completed', 'failed') AND t.completed_at IS NOT NULL",
                 "a user's finished job of a day and its offers",
                 entity=Entity("matchmaking", partition, separator=":"))]
