"""All SQL of a conversion job: its row, its events (003 §3.7) and the API tokens of its owners.

Every write a worker makes on a job it leased is fenced: the claim hands out a lease epoch (a
fencing token) and ``complete``/``schedule_retry``/``fail``/``extend``/``requeue`` only change the
row ``WHERE id = :id AND lease_epoch = :epoch AND status = 'processing'``. A worker whose lease
expired and was reclaimed gets ``False`` back and changes nothing (Kleppmann's fencing tokens;
none of the Postgres queues we compare with have them). Lease expiry thus only decides *liveness*
(when a job is taken over), never *safety*: two workers cannot both finish one job.

Times come from the caller's clock as ``:now`` (STYLE §8). The claim and complete statements are
plain SQL constants because the benchmark hands the very same text to pgbench.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID

from redrive import deadletters
from redrive.deadletters import FinalFailure
from redrive.failures import Failure
from redrive.schema import NOW, TZ, metadata
from redrive.vocabularies import CONVERSION_PUBLIC_CODES

EVENTS = ("queued", "processing", "retry", "complete", "failed", "expired", "fenced")
"""003 §3.7's events, plus ``fenced``: a late write of a worker that had lost its lease, refused."""

_codes = ", ".join(f"'{c}'" for c in sorted(CONVERSION_PUBLIC_CODES))

conversion_jobs = sa.Table(
    "conversion_jobs",
    metadata,
    sa.Column("id", UUID(as_uuid=False), primary_key=True, server_default=sa.text("gen_random_uuid()")),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("filename", sa.Text, nullable=False),
    sa.Column("source_location", sa.Text, nullable=False),  # relative to UPLOADS_DIR; never shown
    sa.Column("source_bytes", sa.BigInteger, nullable=False),
    sa.Column("source_sha256", sa.Text, nullable=False),
    sa.Column("result_location", sa.Text),  # relative to RESULTS_DIR
    sa.Column("status", sa.Text, nullable=False, server_default="queued"),
    sa.Column("attempt_count", sa.Integer, nullable=False, server_default="0"),  # attemptCount
    # leases that expired (a worker lost, paused or cut off): counted apart, they give their attempt back
    sa.Column("lost_leases", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_attempt_at", TZ),  # lastAttemptAt
    sa.Column("retry_after", TZ),  # retryAfter
    sa.Column("leased_by", sa.Text),
    sa.Column("lease_expires_at", TZ),
    sa.Column("lease_epoch", sa.BigInteger, nullable=False, server_default="0"),  # the fencing token
    sa.Column("started_at", TZ),
    sa.Column("queued_at", TZ, nullable=False, server_default=NOW),  # queuedAt
    sa.Column("completed_at", TZ),
    sa.Column("error_code", sa.Text),
    sa.Column("error_message", sa.Text),
    sa.Column("dead_letter", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("files_deleted_at", TZ),  # retention removed its PDF and XML: download and Retry say EXPIRED
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    sa.CheckConstraint("status IN ('queued', 'processing', 'succeeded', 'failed')", name="status"),
    sa.CheckConstraint(f"error_code IS NULL OR error_code IN ({_codes})", name="canonical_error_code"),
    sa.CheckConstraint("status <> 'processing' OR (leased_by IS NOT NULL AND lease_expires_at IS NOT NULL)",
                       name="processing_is_leased"),
    sa.CheckConstraint("status <> 'succeeded' OR result_location IS NOT NULL", name="succeeded_has_result"),
    sa.CheckConstraint("attempt_count >= 0", name="attempt_count"),
    sa.Index("ix_conversion_jobs_status_retry_after", "status", "retry_after"),  # 003 §3.2
    sa.Index("ix_conversion_jobs_queued_created", "created_at", postgresql_where=sa.text("status = 'queued'")),
    # fresh jobs (no retry scheduled), oldest first: the claim's first index range (issue 13 §10)
    sa.Index("ix_conversion_jobs_fresh", "created_at", "id",
             postgresql_where=sa.text("status = 'queued' AND retry_after IS NULL")),
    sa.Index("ix_conversion_jobs_lease", "lease_expires_at", postgresql_where=sa.text("status = 'processing'")),
    sa.Index("ix_conversion_jobs_owner_created", "owner", "created_at"),
    # the pruner's ranges (redrive.retention): finished jobs by age, with and without their files
    sa.Index("ix_conversion_jobs_finished_files", "updated_at",
             postgresql_where=sa.text("status IN ('succeeded', 'failed') AND files_deleted_at IS NULL")),
    sa.Index("ix_conversion_jobs_finished", "updated_at",
             postgresql_where=sa.text("status IN ('succeeded', 'failed') AND files_deleted_at IS NOT NULL")),
    sa.Index("ix_conversion_jobs_failed", "updated_at", postgresql_where=sa.text("status = 'failed'")),  # reconcile
)

conversion_job_events = sa.Table(
    "conversion_job_events",  # 003 §3.7 `job_events`, named after its pipeline in the shared schema
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("job_id", UUID(as_uuid=False), sa.ForeignKey("conversion_jobs.id", ondelete="CASCADE"),
              nullable=False),
    sa.Column("event", sa.Text, nullable=False),
    sa.Column("attempt", sa.Integer),
    sa.Column("at", TZ, nullable=False),
    sa.Column("meta", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.CheckConstraint(
        "event IN ('queued', 'processing', 'retry', 'complete', 'failed', 'expired', 'fenced')", name="event"),
    sa.Index("ix_conversion_job_events_job_id_id", "job_id", "id"),
    sa.Index("ix_conversion_job_events_event_at", "event", "at"),
)

conversion_api_tokens = sa.Table(
    "conversion_api_tokens",
    metadata,
    sa.Column("token_sha256", sa.Text, primary_key=True),  # only the hash is kept
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("label", sa.Text),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("revoked_at", TZ),
    sa.Index("ix_conversion_api_tokens_revoked_at", "revoked_at", postgresql_where=sa.text("revoked_at IS NOT NULL")),
)

# ------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class Job:
    id: str
    owner: str
    filename: str
    source_location: str
    source_bytes: int
    source_sha256: str
    result_location: str | None
    status: str
    attempt_count: int
    last_attempt_at: datetime | None
    retry_after: datetime | None
    leased_by: str | None
    lease_expires_at: datetime | None
    lease_epoch: int
    started_at: datetime | None
    queued_at: datetime
    completed_at: datetime | None
    error_code: str | None
    error_message: str | None
    dead_letter: bool
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: sa.Row[Any]) -> Job:
        m = row._mapping
        return cls(**{f: m[f] for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Lease:
    """What a claim hands the worker: the job and the fencing token every later write must present."""

    job_id: str
    epoch: int
    attempt: int
    source_location: str
    owner: str
    worker: str
    has_dead_letter: bool = False  # a retried or replayed job: completing it closes its dead letter


@dataclass(frozen=True)
class Reclaimed:
    job_id: str
    leased_by: str | None
    epoch: int
    attempt: int
    outcome: str  # "requeue" | "fail"


@dataclass(frozen=True)
class NewJob:
    id: str
    owner: str
    filename: str
    source_location: str
    source_bytes: int
    source_sha256: str


def _meta(values: Mapping[str, Any]) -> str:
    return json.dumps({k: v for k, v in values.items() if v is not None}, sort_keys=True, default=str)


def _event(conn: sa.Connection, job_id: str, event: str, attempt: int | None, at: datetime,
           meta: Mapping[str, Any]) -> None:
    conn.execute(sa.insert(conversion_job_events).values(job_id=job_id, event=event, attempt=attempt, at=at,
                                                         meta=json.loads(_meta(meta))))


# -------------------------------------------------------------------------------------------- create


def create(conn: sa.Connection, job: NewJob, now: datetime) -> Job:
    row = conn.execute(
        sa.insert(conversion_jobs)
        .values(id=job.id, owner=job.owner, filename=job.filename, source_location=job.source_location,
                source_bytes=job.source_bytes, source_sha256=job.source_sha256, status="queued",
                queued_at=now, created_at=now, updated_at=now)
        .returning(*conversion_jobs.c)
    ).one()
    _event(conn, job.id, "queued", 0, now, {"reason": "upload"})
    return Job.from_row(row)


def get(conn: sa.Connection, job_id: str, owner: str | None = None) -> Job | None:
    """The job, or None when it does not exist or (with ``owner``) belongs to someone else."""
    q = sa.select(conversion_jobs).where(conversion_jobs.c.id == job_id)
    if owner is not None:
        q = q.where(conversion_jobs.c.owner == owner)
    row = conn.execute(q).first()
    return Job.from_row(row) if row else None


def list_for(conn: sa.Connection, owner: str, limit: int = 100) -> list[Job]:
    rows = conn.execute(
        sa.select(conversion_jobs)
        .where(conversion_jobs.c.owner == owner)
        .order_by(conversion_jobs.c.created_at.desc(), conversion_jobs.c.id)
        .limit(limit)
    )
    return [Job.from_row(r) for r in rows]


def events(conn: sa.Connection, job_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        sa.select(conversion_job_events).where(conversion_job_events.c.job_id == job_id)
        .order_by(conversion_job_events.c.id)
    )
    return [dict(r._mapping) for r in rows]


# ------------------------------------------------------------------------------------- worker: claim

# Due jobs as two index ranges (issue 13 §10): fresh jobs (no retry_after) oldest first from their partial
# index, and retries whose time has come from the (status, retry_after) index of 003 §3.2. One predicate
# `retry_after IS NULL OR retry_after <= now` would walk queued jobs in created order and filter out the
# ones scheduled in the future: with many of those ahead of the due ones, a scan. Each range is bounded
# (a few times the claim size; SKIP LOCKED skips what other workers hold), then the oldest are claimed.
# The claims read them as `id = ANY (ARRAY(…))`: the ranges are evaluated first and the rows fetched by
# primary key, whatever the queue's size, so the worker's one generic plan (HotPath) fits a small queue and
# a large one; as `id IN (…)` the planner hash-joins them against every queued row on a small queue.
DUE_IDS_SQL = """\
(SELECT id FROM conversion_jobs WHERE status = 'queued' AND retry_after IS NULL
 ORDER BY created_at, id LIMIT {limit})
UNION ALL
(SELECT id FROM conversion_jobs WHERE status = 'queued' AND retry_after <= {now}
 ORDER BY retry_after, id LIMIT {limit})"""


# 003 §3.4: a short transaction (one statement) from `queued` where retryAfter is null or due, oldest
# first, FOR UPDATE SKIP LOCKED; the claim bumps the lease epoch and logs the `processing` event. While
# the gateway's circuit breaker is open it claims nothing (003 §3.3 hold-queue), in the same statement.
CLAIM_SQL = """\
WITH candidate AS (
    SELECT id FROM conversion_jobs
    WHERE id = ANY (ARRAY({due_ids}))
      AND status = 'queued'
      AND NOT EXISTS (SELECT 1 FROM circuit_breakers WHERE name = :breaker AND state = 'open')
    ORDER BY created_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE conversion_jobs AS j
    SET status = 'processing', leased_by = :worker, lease_expires_at = :lease_expires_at,
        lease_epoch = j.lease_epoch + 1, started_at = COALESCE(j.started_at, :now),
        attempt_count = j.attempt_count + 1, last_attempt_at = :now, updated_at = :now
    FROM candidate
    WHERE j.id = candidate.id
    RETURNING j.id, j.lease_epoch AS epoch, j.attempt_count AS attempt, j.source_location, j.owner
), logged AS (
    INSERT INTO conversion_job_events (job_id, event, attempt, at, meta)
    SELECT id, 'processing', attempt, :now, jsonb_build_object('worker', CAST(:worker AS text), 'epoch', epoch)
    FROM claimed
)
SELECT c.id, c.epoch, c.attempt, c.source_location, c.owner,
       EXISTS (SELECT 1 FROM dead_letters AS d WHERE d.pipeline = 'conversion'
               AND d.entity_ref = CAST(c.id AS text) AND d.status <> 'resolved') AS has_dead_letter
FROM claimed AS c""".replace("{due_ids}", DUE_IDS_SQL.format(limit=":window", now=":now"))

# Fenced completion; the caller publishes the result file between this statement and COMMIT, while
# the row lock keeps a reclaim away, so the file and the row agree.
COMPLETE_SQL = """\
WITH done AS (
    UPDATE conversion_jobs
    SET status = 'succeeded', result_location = :result_location, completed_at = :now, updated_at = :now,
        leased_by = NULL, lease_expires_at = NULL, retry_after = NULL,
        error_code = NULL, error_message = NULL, dead_letter = false
    WHERE id = :id AND lease_epoch = :epoch AND status = 'processing'
    RETURNING id, attempt_count
), logged AS (
    INSERT INTO conversion_job_events (job_id, event, attempt, at, meta)
    SELECT id, 'complete', attempt_count, :now, CAST(:meta AS jsonb) FROM done
)
SELECT id FROM done"""


# ------------------------------------------------------------------ worker: the hot path (issue 14)

# One statement per worker turn, PREPAREd once per held connection: complete every finished job of
# this turn (fenced, as COMPLETE_SQL), log their `complete` events, append their gateway calls to the
# breaker's window (a success never opens a breaker, so no window read is needed) and claim up to $8
# due jobs for the slots that just freed (as CLAIM_SQL). The worker publishes the completed results
# between this statement and COMMIT, while the row locks keep a reclaim away. Arrays are sorted by id
# so two multi-row writers always lock in the same order.
CYCLE_NAME = "redrive_conversion_cycle"
CYCLE_SQL = f"""\
PREPARE {CYCLE_NAME} (uuid[], bigint[], text[], jsonb[], float8[], timestamptz, text, int, text, timestamptz) AS
WITH done AS (
    UPDATE conversion_jobs AS j
    SET status = 'succeeded', result_location = d.location, completed_at = $6, updated_at = $6,
        leased_by = NULL, lease_expires_at = NULL, retry_after = NULL,
        error_code = NULL, error_message = NULL, dead_letter = false
    FROM unnest($1, $2, $3, $4) AS d(id, epoch, location, meta)
    WHERE j.id = d.id AND j.lease_epoch = d.epoch AND j.status = 'processing'
    RETURNING j.id, j.attempt_count, d.meta
), done_logged AS (
    INSERT INTO conversion_job_events (job_id, event, attempt, at, meta)
    SELECT id, 'complete', attempt_count, $6, meta FROM done
), calls AS (
    {{calls}}
), candidate AS (
    SELECT id FROM conversion_jobs
    WHERE id = ANY (ARRAY({DUE_IDS_SQL.format(limit="($8 * 4 + 64)", now="$6")}))
      AND status = 'queued'
      AND NOT EXISTS (SELECT 1 FROM circuit_breakers WHERE name = $7 AND state = 'open')
    ORDER BY created_at, id
    LIMIT $8
    FOR UPDATE SKIP LOCKED
), claimed AS (
    UPDATE conversion_jobs AS j
    SET status = 'processing', leased_by = $9, lease_expires_at = $10,
        lease_epoch = j.lease_epoch + 1, started_at = COALESCE(j.started_at, $6),
        attempt_count = j.attempt_count + 1, last_attempt_at = $6, updated_at = $6
    FROM candidate
    WHERE j.id = candidate.id
    RETURNING j.id, j.lease_epoch AS epoch, j.attempt_count AS attempt, j.source_location, j.owner
), claim_logged AS (
    INSERT INTO conversion_job_events (job_id, event, attempt, at, meta)
    SELECT id, 'processing', attempt, $6, jsonb_build_object('worker', $9, 'epoch', epoch)
    FROM claimed
)
SELECT 'done' AS kind, CAST(id AS text) AS id, NULL::bigint AS epoch, NULL::int AS attempt,
       NULL::text AS source_location, NULL::text AS owner, NULL::bool AS has_dead_letter
FROM done
UNION ALL
SELECT 'claimed', CAST(c.id AS text), c.epoch, c.attempt, c.source_location, c.owner,
       EXISTS (SELECT 1 FROM dead_letters AS d WHERE d.pipeline = 'conversion'
               AND d.entity_ref = CAST(c.id AS text) AND d.status <> 'resolved')
FROM claimed AS c
UNION ALL
SELECT 'calls', NULL, max(id), CAST(max(id) - min(id) AS int), NULL, NULL, NULL FROM calls HAVING count(*) > 0"""


@dataclass(frozen=True)
class Completion:
    """A finished job's fenced completion: its lease, where its staged result goes, and the call's duration."""

    lease: Lease
    result_location: str
    call_ms: float | None
    meta: Mapping[str, Any]


@dataclass(frozen=True)
class Cycle:
    completed: frozenset[str]
    claimed: list[Lease]
    call_ids: tuple[int, int] | None  # (first, last) id of the breaker calls appended, for pruning


class HotPath:
    """The worker's held DB-API connection for its per-turn statement (no pool checkout, no pre-ping).

    Autocommit on: a turn without results to publish is one implicit transaction; a turn with some is
    ``BEGIN; SET LOCAL …; EXECUTE …`` in one round trip, the caller's publishing, then ``COMMIT``. The
    transaction carries ``idle_limit_ms`` as its idle-in-transaction timeout: a worker frozen while it
    publishes must not keep its rows locked (so unreclaimable) for longer than a lease.
    """

    def __init__(self, engine: sa.Engine, breaker: str, idle_limit_ms: int = 60_000) -> None:
        from redrive.breaker import OK_CALLS_CTE

        self.engine, self.breaker, self.idle_limit_ms = engine, breaker, int(idle_limit_ms)
        self._sql = CYCLE_SQL.format(calls=OK_CALLS_CTE.format(breaker="$7", durations="$5", at="$6"))
        self._raw: Any = None
        self._open = False

    def _cursor(self) -> Any:
        if self._raw is None:
            raw = self.engine.raw_connection()
            try:
                raw.driver_connection.autocommit = True
                with raw.driver_connection.cursor() as cur:
                    cur.execute(self._sql)
                    # Its one generic plan: on a small queue PostgreSQL keeps re-planning the custom one
                    # (~0.4 ms a turn, as long as the statement runs); the plan reads the due ids first
                    # (`= ANY (ARRAY(…))`), so it does not depend on the parameters' values.
                    cur.execute("SET plan_cache_mode = force_generic_plan")
            except BaseException:
                raw.invalidate()
                raise
            self._raw = raw
        return self._raw.driver_connection.cursor()

    def cycle(self, done: Sequence[Completion], claim: int, now: datetime, worker: str,
              lease_expires_at: datetime) -> Cycle:
        """Complete ``done`` and claim up to ``claim`` jobs in one statement; leaves a transaction open
        when ``done`` is not empty (the caller publishes, then :meth:`commit`)."""
        ordered = sorted(done, key=lambda c: c.lease.job_id)
        calls = [c.call_ms for c in ordered if c.call_ms is not None]
        params = ([c.lease.job_id for c in ordered], [c.lease.epoch for c in ordered],
                  [c.result_location for c in ordered], [_meta(c.meta) for c in ordered], calls,
                  now, self.breaker, claim, worker, lease_expires_at)
        execute = (f"EXECUTE {CYCLE_NAME} (%s::uuid[], %s::bigint[], %s::text[], %s::jsonb[], %s::float8[], "
                   "%s, %s, %s, %s, %s)")
        try:
            cur = self._cursor()
            with cur:
                if ordered:
                    cur.execute(f"BEGIN; SET LOCAL idle_in_transaction_session_timeout = {self.idle_limit_ms}; "
                                + execute, params)
                    self._open = True
                else:
                    cur.execute(execute, params)
                rows = cur.fetchall()
        except BaseException:
            self.reset()
            raise
        completed, claimed, call_ids = set(), [], None
        for kind, job_id, epoch, attempt, source, owner, has_dl in rows:
            if kind == "done":
                completed.add(job_id)
            elif kind == "claimed":
                claimed.append(Lease(job_id, epoch, attempt, source, owner, worker, bool(has_dl)))
            else:  # 'calls': the last id and how far back the first one is
                call_ids = (int(epoch) - int(attempt), int(epoch))
        claimed.sort(key=lambda lease: lease.job_id)
        return Cycle(frozenset(completed), claimed, call_ids)

    def commit(self) -> None:
        if not self._open:
            return
        try:
            with self._raw.driver_connection.cursor() as cur:
                cur.execute("COMMIT")
        except BaseException:
            self.reset()
            raise
        finally:
            self._open = False

    def reset(self) -> None:
        """Drop the connection (after an error, or at the end): the next turn opens and prepares a fresh one."""
        raw, self._raw, self._open = self._raw, None, False
        if raw is not None:
            try:
                raw.invalidate()
            except Exception:  # noqa: BLE001 - it is being thrown away
                pass

    close = reset


def completed_before(conn: sa.Connection, leases: Sequence[Lease]) -> set[str]:
    """Jobs these very leases already completed (a turn whose COMMIT was lost in transit and then retried)."""
    if not leases:
        return set()
    rows = conn.execute(sa.text(
        "SELECT CAST(j.id AS text) FROM conversion_jobs AS j "
        "JOIN unnest(CAST(:ids AS uuid[]), CAST(:epochs AS bigint[])) AS l(id, epoch) "
        "ON j.id = l.id AND j.lease_epoch = l.epoch WHERE j.status = 'succeeded'"),
        {"ids": [x.job_id for x in leases], "epochs": [x.epoch for x in leases]})
    return {r[0] for r in rows}


def claim_many(conn: sa.Connection, worker: str, now: datetime, lease_ttl: float, breaker: str,
               limit: int) -> list[Lease]:
    """Up to ``limit`` due jobs in one statement (CLAIM_SQL with a bigger LIMIT)."""
    rows = conn.execute(
        sa.text(CLAIM_SQL.replace("LIMIT 1", "LIMIT :limit")),
        {"now": now, "worker": worker, "lease_expires_at": now + timedelta(seconds=lease_ttl), "breaker": breaker,
         "limit": limit, "window": limit * 4 + 64},
    ).all()
    return sorted((Lease(str(r.id), r.epoch, r.attempt, r.source_location, r.owner, worker, r.has_dead_letter)
                   for r in rows), key=lambda lease: lease.job_id)


def extend_many(conn: sa.Connection, leases: Sequence[Lease], now: datetime, lease_ttl: float) -> set[str]:
    """003 §3.5 for every held lease at once, each fenced by its own epoch; returns the ids still held."""
    if not leases:
        return set()
    ordered = sorted(leases, key=lambda x: x.job_id)
    rows = conn.execute(sa.text(
        "UPDATE conversion_jobs AS j SET lease_expires_at = :expires, updated_at = :now "
        "FROM unnest(CAST(:ids AS uuid[]), CAST(:epochs AS bigint[])) AS l(id, epoch) "
        "WHERE j.id = l.id AND j.lease_epoch = l.epoch AND j.status = 'processing' RETURNING CAST(j.id AS text)"),
        {"ids": [x.job_id for x in ordered], "epochs": [x.epoch for x in ordered], "now": now,
         "expires": now + timedelta(seconds=lease_ttl)})
    return {r[0] for r in rows}


def lease_epochs(conn: sa.Connection, job_ids: Sequence[str]) -> dict[str, tuple[str, int]]:
    """Status and lease epoch of each job (the staged-file sweep keeps only files of leases still held)."""
    if not job_ids:
        return {}
    rows = conn.execute(sa.text(
        "SELECT CAST(id AS text), status, lease_epoch FROM conversion_jobs WHERE id = ANY(CAST(:ids AS uuid[]))"),
        {"ids": list(job_ids)})
    return {r[0]: (r[1], int(r[2])) for r in rows}


def claim(conn: sa.Connection, worker: str, now: datetime, lease_ttl: float, breaker: str) -> Lease | None:
    row = conn.execute(
        sa.text(CLAIM_SQL),
        {"now": now, "worker": worker, "lease_expires_at": now + timedelta(seconds=lease_ttl), "breaker": breaker,
         "window": 64},
    ).first()
    if row is None:
        return None
    return Lease(str(row.id), row.epoch, row.attempt, row.source_location, row.owner, worker, row.has_dead_letter)


def complete(conn: sa.Connection, lease: Lease, result_location: str, now: datetime,
             meta: Mapping[str, Any]) -> bool:
    """Fenced: True when this lease still held the job and it is now ``succeeded``."""
    row = conn.execute(
        sa.text(COMPLETE_SQL),
        {"id": lease.job_id, "epoch": lease.epoch, "now": now, "result_location": result_location,
         "meta": _meta(meta)},
    ).first()
    return row is not None


def _fenced_update(conn: sa.Connection, lease: Lease, **values: Any) -> bool:
    row = conn.execute(
        sa.update(conversion_jobs)
        .where(conversion_jobs.c.id == lease.job_id, conversion_jobs.c.lease_epoch == lease.epoch,
               conversion_jobs.c.status == "processing")
        .values(**values)
        .returning(conversion_jobs.c.id)
    ).first()
    return row is not None


def extend(conn: sa.Connection, lease: Lease, now: datetime, lease_ttl: float) -> bool:
    """003 §3.5 lease extension; fenced, so a worker that lost the job cannot take it back."""
    return _fenced_update(conn, lease, lease_expires_at=now + timedelta(seconds=lease_ttl), updated_at=now)


def schedule_retry(conn: sa.Connection, lease: Lease, code: str, message: str, retry_after: datetime,
                   now: datetime, meta: Mapping[str, Any]) -> bool:
    """003 §3.2: back to ``queued`` with ``retryAfter``, lease cleared; the last error stays visible."""
    ok = _fenced_update(conn, lease, status="queued", retry_after=retry_after, leased_by=None,
                        lease_expires_at=None, error_code=code, error_message=message, updated_at=now)
    if ok:
        _event(conn, lease.job_id, "retry", lease.attempt, now,
               {**meta, "error_code": code, "retry_after": retry_after.isoformat()})
    return ok


def fail(conn: sa.Connection, lease: Lease, code: str, message: str, now: datetime,
         meta: Mapping[str, Any]) -> bool:
    """Failed for good: ``failed`` with the canonical code and the dead-letter mark."""
    ok = _fenced_update(conn, lease, status="failed", retry_after=None, leased_by=None, lease_expires_at=None,
                        error_code=code, error_message=message, dead_letter=True, updated_at=now)
    if ok:
        _event(conn, lease.job_id, "failed", lease.attempt, now, {**meta, "error_code": code})
    return ok


def requeue(conn: sa.Connection, lease: Lease, now: datetime, reason: str,
            retry_after: datetime | None = None) -> bool:
    """003 §3.5 clean requeue on shutdown: ``queued``, lease cleared, and the unfinished attempt given back;
    with ``retry_after``, not claimed before then (a retry the gateway's retry budget held back)."""
    ok = _fenced_update(conn, lease, status="queued", leased_by=None, lease_expires_at=None, retry_after=retry_after,
                        attempt_count=sa.func.greatest(conversion_jobs.c.attempt_count - 1, 0), updated_at=now)
    if ok:
        meta = {"reason": reason, "worker": lease.worker}
        _event(conn, lease.job_id, "queued", lease.attempt - 1, now,
               meta if retry_after is None else {**meta, "retry_after": retry_after.isoformat()})
    return ok


def record_fenced(conn: sa.Connection, lease: Lease, write: str, now: datetime) -> None:
    """Count a refused late write (the job's current holder and epoch are in the row, the loser's here)."""
    _event(conn, lease.job_id, "fenced", lease.attempt, now,
           {"write": write, "worker": lease.worker, "epoch": lease.epoch})


# ----------------------------------------------------------------------------------- worker: reclaim


def reclaim_expired(conn: sa.Connection, now: datetime, max_attempts: int, limit: int = 100) -> list[Reclaimed]:
    """003 §3.4 reclaim: ``processing`` rows whose lease expired go back to ``queued`` (leased_by cleared).

    Locked rows are skipped (their holder is writing right now, so the lease is not dead). An expired
    lease is our infrastructure's loss, not the gateway's (issue 26 §2): the attempt is given back and
    counted in ``lost_leases`` instead; the job whose worker was lost ``max_attempts`` times fails
    (:func:`assets.conversion.policy.reclaim_outcome`, a poison pill); the caller dead-letters those.
    """
    rows = conn.execute(
        sa.text("""\
WITH expired AS (
    SELECT id, leased_by, lease_epoch, attempt_count, lost_leases FROM conversion_jobs
    WHERE status = 'processing' AND lease_expires_at < :now
    ORDER BY lease_expires_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE conversion_jobs AS j
    SET status = CASE WHEN e.lost_leases + 1 >= :max_attempts THEN 'failed' ELSE 'queued' END,
        error_code = CASE WHEN e.lost_leases + 1 >= :max_attempts THEN 'UNKNOWN' ELSE j.error_code END,
        error_message = CASE WHEN e.lost_leases + 1 >= :max_attempts THEN :lost_message ELSE j.error_message END,
        dead_letter = (e.lost_leases + 1 >= :max_attempts),
        attempt_count = CASE WHEN e.lost_leases + 1 >= :max_attempts THEN e.attempt_count
                             ELSE greatest(e.attempt_count - 1, 0) END,
        lost_leases = e.lost_leases + 1,
        leased_by = NULL, lease_expires_at = NULL, updated_at = :now
    FROM expired AS e
    WHERE j.id = e.id
    RETURNING j.id, e.leased_by, e.lease_epoch, e.attempt_count, j.status, j.lost_leases
), logged AS (
    INSERT INTO conversion_job_events (job_id, event, attempt, at, meta)
    SELECT id, CASE WHEN status = 'failed' THEN 'failed' ELSE 'expired' END, attempt_count, :now,
           jsonb_build_object('leased_by', leased_by, 'epoch', lease_epoch, 'reason', 'lease_expired',
                              'lost_leases', lost_leases)
    FROM moved
)
SELECT id, leased_by, lease_epoch, attempt_count, status FROM moved"""),
        {"now": now, "max_attempts": max_attempts, "limit": limit,
         "lost_message": "the worker was lost on every attempt (lease expired)"},
    )
    return [Reclaimed(str(r.id), r.leased_by, r.lease_epoch, r.attempt_count,
                      "fail" if r.status == "failed" else "requeue") for r in rows]


# --------------------------------------------------------------------------------------- manual retry


@dataclass(frozen=True)
class RetryRefused(Exception):
    """003 §3.6 preconditions: ``code`` is the canonical API code, ``status`` the HTTP status."""

    code: str
    message: str
    status: int


def manual_retry(conn: sa.Connection, job_id: str, owner: str | None, now: datetime,
                 source_present: bool, reason: str = "manual_retry") -> Job:
    """003 §3.6: a ``failed`` job whose source still exists goes back to ``queued`` with a fresh budget.

    Scoped to ``owner`` (None: an operator's replay): another owner's job is refused exactly like a
    missing one. Error fields reset, attemptCount zeroed, queuedAt/updated_at bumped.
    """
    job = get(conn, job_id, owner)
    if job is None:
        raise RetryRefused("FORBIDDEN", "job not found", 404)
    if job.status != "failed":
        raise RetryRefused("NOT_READY", f"only failed jobs can be retried; this one is {job.status}", 409)
    if not source_present:
        raise RetryRefused("EXPIRED", "the uploaded PDF is no longer stored; upload it again", 410)
    row = conn.execute(
        sa.update(conversion_jobs)
        .where(conversion_jobs.c.id == job_id, conversion_jobs.c.status == "failed")
        .values(status="queued", attempt_count=0, error_code=None, error_message=None, retry_after=None,
                dead_letter=False, queued_at=now, updated_at=now)
        .returning(*conversion_jobs.c)
    ).first()
    if row is None:  # someone else retried it between our read and this write
        raise RetryRefused("NOT_READY", "the job is already queued again", 409)
    _event(conn, job_id, "queued", 0, now, {"reason": reason})
    return Job.from_row(row)


# ------------------------------------------------------------------------------------- queue & stats


def due_count(conn: sa.Connection, now: datetime) -> int:
    return int(conn.execute(
        sa.select(sa.func.count()).select_from(conversion_jobs).where(
            conversion_jobs.c.status == "queued",
            sa.or_(conversion_jobs.c.retry_after.is_(None), conversion_jobs.c.retry_after <= now),
        )
    ).scalar_one())


def next_retry_at(conn: sa.Connection) -> datetime | None:
    return conn.execute(
        sa.select(sa.func.min(conversion_jobs.c.retry_after)).where(conversion_jobs.c.status == "queued")
    ).scalar()


def queue_depth(conn: sa.Connection, now: datetime) -> dict[str, int]:
    """Jobs waiting (due now / scheduled for a retry) and in progress."""
    row = conn.execute(sa.text("""\
SELECT count(*) FILTER (WHERE status = 'queued' AND (retry_after IS NULL OR retry_after <= :now)) AS due,
       count(*) FILTER (WHERE status = 'queued' AND retry_after > :now) AS scheduled,
       count(*) FILTER (WHERE status = 'processing') AS processing
FROM conversion_jobs WHERE status IN ('queued', 'processing')"""), {"now": now}).one()
    return {"due": row.due, "scheduled": row.scheduled, "processing": row.processing}


def due_and_oldest(conn: sa.Connection, now: datetime) -> tuple[int, datetime | None]:
    """Queued jobs whose time has come, and when the oldest of them became due."""
    due_at = sa.func.coalesce(conversion_jobs.c.retry_after, conversion_jobs.c.queued_at)
    n, oldest = conn.execute(sa.select(sa.func.count(), sa.func.min(due_at))
                             .where(conversion_jobs.c.status == "queued", due_at <= now)).one()
    return n, oldest


def status_counts(conn: sa.Connection, ids: Sequence[str] | None = None) -> dict[str, int]:
    q = sa.select(conversion_jobs.c.status, sa.func.count()).group_by(conversion_jobs.c.status)
    if ids is not None:
        q = q.where(conversion_jobs.c.id.in_(list(ids)))
    return {status: n for status, n in conn.execute(q)}


# -------------------------------------------------------------------------------------------- tokens


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_token(conn: sa.Connection, owner: str, label: str | None = None) -> str:
    """A new API token for ``owner``; only its hash is stored, so this is the one time it is seen."""
    token = f"rdc_{secrets.token_urlsafe(24)}"
    conn.execute(sa.insert(conversion_api_tokens).values(token_sha256=token_hash(token), owner=owner, label=label))
    return token


def owner_for(conn: sa.Connection, token: str) -> str | None:
    return conn.execute(
        sa.select(conversion_api_tokens.c.owner).where(
            conversion_api_tokens.c.token_sha256 == token_hash(token), conversion_api_tokens.c.revoked_at.is_(None))
    ).scalar()


# ------------------------------------------------------------------------------------ reconciliation


def failed_for_good(conn: sa.Connection, limit: int, since: datetime | None = None) -> list[FinalFailure]:
    """Jobs ``failed`` (worker or reclaim) with no dead letter for that failure: a crash between the job's
    commit and the dead letter's (issue 13 item 3). `redrive.reconcile` writes what is missing."""
    j = conversion_jobs
    query = (sa.select(j.c.id, j.c.owner, j.c.error_code, j.c.error_message, j.c.attempt_count, j.c.updated_at)
             .where(j.c.status == "failed",
                    deadletters.unrecorded("conversion", sa.cast(j.c.id, sa.Text), j.c.updated_at)))
    if since is not None:  # ix_conversion_jobs_failed
        query = query.where(j.c.updated_at >= since)
    rows = conn.execute(query.order_by(j.c.updated_at).limit(limit))
    return [FinalFailure(
        pipeline="conversion", stage="convert", entity_ref=str(r.id), attempts=r.attempt_count, at=r.updated_at,
        tenant=r.owner, failure=Failure(code=r.error_code or "UNKNOWN", retryable=False, retry_after=None,
                                        message=f"conversion failed for good ({r.error_code or 'UNKNOWN'})",
                                        detail=r.error_message or ""),
        context={"job_id": str(r.id), "error_code": r.error_code, "reconciled": True},
        payload_ref={"table": "conversion_jobs", "id": str(r.id)},
    ) for r in rows]


# ---------------------------------------------------------------------------------------- retention


def retention_rules(settings: Any) -> list[Any]:
    """What the pruner removes of conversion (redrive.retention): a finished job's files first (its
    download and Retry then answer 410 EXPIRED, as 003 promises for a file no longer stored), its row
    and events later; revoked tokens. A job with an open dead letter keeps everything (its owner may
    still press Retry)."""
    from assets.conversion.settings import ConversionSettings, file_store
    from redrive.retention import Entity, Rule

    job = Entity("conversion", "CAST(t.id AS text)")
    finished = "t.status IN ('succeeded', 'failed')"

    def remove(rows: Sequence[Mapping[str, Any]]) -> None:
        store = file_store(ConversionSettings())
        for row in rows:
            if row.get("source_location"):
                store.delete_source(row["source_location"])
            if row.get("result_location"):
                store.delete_result(row["result_location"])

    return [
        Rule("conversion.files", "conversion_jobs", ("id",), "retention_conversion_files_days", "t.updated_at",
             f"{finished} AND t.files_deleted_at IS NULL", "a finished job's uploaded PDF and result XML",
             entity=job, scrub={"files_deleted_at": ":now"}, files=("source_location", "result_location"),
             remove=remove),
        Rule("conversion.jobs", "conversion_jobs", ("id",), "retention_conversion_job_days", "t.updated_at",
             f"{finished} AND t.files_deleted_at IS NOT NULL", "a finished job's row and its events", entity=job),
        Rule("conversion.tokens", "conversion_api_tokens", ("token_sha256",), "retention_idempotency_days",
             "t.revoked_at", "t.revoked_at IS NOT NULL", "revoked API tokens"),
    ]
