"""All SQL of review notifications: jobs (§6.1, §10.1) and their per-recipient outbox (§6.3, §10.2).

The database enforces the idempotency the spec asks for: `review_jobs.idempotency_key` and
`(changelist_id, review_version)` are unique, one outbox row per `(changelist_id, recipient,
review_version)` is unique, and a row is `sent` exactly when `notified_at` is set (a check
constraint). Functions take a `Connection`, so a job and its delivery intents are one transaction.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, insert

from assets.review_notifications import policy
from redrive import deadletters
from redrive.deadletters import FinalFailure
from redrive.failures import Failure
from redrive.schema import NOW, TZ, metadata

review_jobs = sa.Table(
    "review_jobs",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("idempotency_key", sa.Text, nullable=False, unique=True),  # §6.1: MUST be unique
    sa.Column("changelist_id", sa.Text, nullable=False),
    sa.Column("review_version", sa.Integer, nullable=False),
    sa.Column("summary", sa.Text, nullable=False, server_default=""),
    sa.Column("request_digest", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False, server_default=policy.PENDING),
    sa.Column("result", JSONB),
    sa.Column("last_error", sa.Text),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    sa.Column("finished_at", TZ),
    # One logical attempt per changelist version (§6.2): a versioned rerun is a new row.
    sa.UniqueConstraint("changelist_id", "review_version"),
    sa.CheckConstraint("review_version >= 1", name="review_version"),
    sa.CheckConstraint(f"status IN {policy.JOB_STATUSES!r}", name="status"),
    # the pruner's range (redrive.retention): finished jobs by age
    sa.Index("ix_review_jobs_finished", "updated_at", postgresql_where=sa.text("status IN ('succeeded', 'superseded')")),
)

review_deliveries = sa.Table(
    "review_deliveries",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("job_id", sa.BigInteger, sa.ForeignKey("review_jobs.id", ondelete="CASCADE"), nullable=False),
    sa.Column("changelist_id", sa.Text, nullable=False),
    sa.Column("recipient", sa.Text, nullable=False),
    sa.Column("review_version", sa.Integer, nullable=False),
    sa.Column("provider_token", sa.Text, nullable=False, unique=True),
    sa.Column("status", sa.Text, nullable=False, server_default=policy.D_PENDING),
    sa.Column("notification_id", sa.Text),
    sa.Column("notified_at", TZ),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("reconciliations", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    # §10.2: "recipient has been notified for this changelist version" exists once.
    sa.UniqueConstraint("changelist_id", "recipient", "review_version"),
    sa.CheckConstraint(f"status IN {policy.DELIVERY_STATUSES!r}", name="status"),
    sa.CheckConstraint("(status = 'sent') = (notified_at IS NOT NULL)", name="sent_iff_notified"),
    sa.Index("ix_review_deliveries_job_id_status", "job_id", "status"),
    sa.Index("ix_review_deliveries_failed", "updated_at", postgresql_where=sa.text("status = 'failed'")),  # reconcile
    # the pruner's range: settled deliveries whose recipient is still an address
    sa.Index("ix_review_deliveries_personal", "updated_at",
             postgresql_where=sa.text("status IN ('sent', 'failed', 'waived', 'superseded') "
                                      "AND recipient NOT LIKE 'sha256:%'")),
)


class UnknownJob(LookupError):
    """No job has this key or id; the message says which."""

    code = "UNKNOWN_JOB"


@dataclass(frozen=True)
class Job:
    id: int
    idempotency_key: str
    changelist_id: str
    review_version: int
    summary: str
    request_digest: str
    status: str
    result: dict[str, Any] | None
    last_error: str | None
    created_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: sa.Row[Any]) -> Job:
        m = row._mapping
        return cls(**{f: m[f] for f in cls.__dataclass_fields__})

    @property
    def key(self) -> str:
        return policy.job_key(self.changelist_id, self.review_version)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"job_id": self.id, "job_key": self.key}
        for name in ("idempotency_key", "changelist_id", "review_version", "status", "result", "last_error"):
            out[name] = getattr(self, name)
        out["created_at"] = self.created_at.isoformat()
        out["finished_at"] = self.finished_at.isoformat() if self.finished_at else None
        return out


@dataclass(frozen=True)
class Delivery:
    id: int
    job_id: int
    changelist_id: str
    recipient: str
    review_version: int
    provider_token: str
    status: str
    notification_id: str | None
    notified_at: datetime | None
    attempts: int
    reconciliations: int
    last_error: str | None

    @classmethod
    def from_row(cls, row: sa.Row[Any]) -> Delivery:
        m = row._mapping
        return cls(**{f: m[f] for f in cls.__dataclass_fields__})

    @property
    def state(self) -> policy.DeliveryState:
        return policy.DeliveryState(self.status, self.notification_id, self.notified_at, self.attempts)


# -------------------------------------------------------------------------------------------- jobs


def insert_job(conn: sa.Connection, request: policy.ReviewRequest) -> Job | None:
    """Insert the job, or None when its idempotency key or its version is taken (§6.1).

    ON CONFLICT DO NOTHING waits for a concurrent insert of the same key to commit, so the caller's
    re-select then finds the winner's row: two requests at the same instant make one job.
    """
    row = conn.execute(
        insert(review_jobs)
        .values(idempotency_key=request.idempotency_key, changelist_id=request.changelist_id,
                review_version=request.review_version, summary=request.summary,
                request_digest=request.digest)
        .on_conflict_do_nothing()
        .returning(*review_jobs.c)
    ).first()
    return Job.from_row(row) if row else None


def job_by_idempotency_key(conn: sa.Connection, key: str) -> Job | None:
    row = conn.execute(sa.select(review_jobs).where(review_jobs.c.idempotency_key == key)).first()
    return Job.from_row(row) if row else None


def job_by_version(conn: sa.Connection, changelist_id: str, review_version: int) -> Job | None:
    row = conn.execute(sa.select(review_jobs).where(review_jobs.c.changelist_id == changelist_id,
                                                    review_jobs.c.review_version == review_version)).first()
    return Job.from_row(row) if row else None


def job_by_key(conn: sa.Connection, key: str) -> Job:
    changelist_id, sep, version = key.rpartition(":v")
    job = job_by_version(conn, changelist_id, int(version)) if sep and version.isdigit() else None
    if job is None:
        raise UnknownJob(f"{UnknownJob.code}: no review notification job {key!r}")
    return job


def job_by_id(conn: sa.Connection, job_id: int) -> Job:
    row = conn.execute(sa.select(review_jobs).where(review_jobs.c.id == job_id)).first()
    if row is None:
        raise UnknownJob(f"{UnknownJob.code}: no review notification job with id {job_id}")
    return Job.from_row(row)


def latest_version(conn: sa.Connection, changelist_id: str, *, excluding: int | None = None) -> int | None:
    q = sa.select(sa.func.max(review_jobs.c.review_version)).where(review_jobs.c.changelist_id == changelist_id)
    if excluding is not None:
        q = q.where(review_jobs.c.id != excluding)
    return conn.execute(q).scalar()


def lock_changelist(conn: sa.Connection, changelist_id: str) -> None:
    """Serialize version decisions of one changelist until the transaction ends (v3 and v4 at once)."""
    conn.execute(sa.select(sa.func.pg_advisory_xact_lock(
        sa.func.hashtextextended(f"{policy.PIPELINE}:changelist:{changelist_id}", 0))))


def insert_deliveries(conn: sa.Connection, job: Job, recipients: Sequence[str]) -> int:
    """§6.3: one outbox row per recipient, keyed by (changelist_id, recipient, review_version)."""
    if not recipients:
        return 0
    rows = [{"job_id": job.id, "changelist_id": job.changelist_id, "recipient": r,
             "review_version": job.review_version,
             "provider_token": policy.provider_token(job.changelist_id, r, job.review_version)}
            for r in recipients]
    result = conn.execute(insert(review_deliveries).values(rows).on_conflict_do_nothing()
                          .returning(review_deliveries.c.id))
    return len(result.all())


@dataclass(frozen=True)
class Superseded:
    job_keys: list[str]
    failed_delivery_refs: list[str]


def supersede_older(conn: sa.Connection, changelist_id: str, below: int) -> Superseded:
    """Unfinished jobs of older versions stop: their unsent rows will not be sent (the new version notifies)."""
    jobs = conn.execute(
        sa.update(review_jobs)
        .where(review_jobs.c.changelist_id == changelist_id, review_jobs.c.review_version < below,
               review_jobs.c.status.in_(policy.UNFINISHED))
        .values(status=policy.SUPERSEDED, updated_at=sa.func.now(), finished_at=sa.func.now())
        .returning(review_jobs.c.id, review_jobs.c.review_version)
    ).all()
    if not jobs:
        return Superseded([], [])
    keys = {j.id: policy.job_key(changelist_id, j.review_version) for j in jobs}
    failed = conn.execute(
        sa.select(review_deliveries.c.id, review_deliveries.c.job_id)
        .where(review_deliveries.c.job_id.in_(keys), review_deliveries.c.status == policy.D_FAILED)
    ).all()
    conn.execute(
        sa.update(review_deliveries)
        .where(review_deliveries.c.job_id.in_(keys),
               review_deliveries.c.status.in_((policy.D_PENDING, policy.D_SENDING, policy.D_FAILED)))
        .values(status=policy.D_SUPERSEDED, updated_at=sa.func.now())
    )
    return Superseded(list(keys.values()), [policy.delivery_ref(keys[r.job_id], r.id) for r in failed])


def set_job_status(conn: sa.Connection, job_id: int, status: str, *, last_error: str | None = None,
                   only_if: Sequence[str] = policy.UNFINISHED) -> bool:
    """Move an unfinished job; a succeeded or superseded job never moves back."""
    result = conn.execute(
        sa.update(review_jobs).where(review_jobs.c.id == job_id, review_jobs.c.status.in_(only_if))
        .values(status=status, last_error=last_error, updated_at=sa.func.now())
    )
    return result.rowcount == 1


def finish_job(conn: sa.Connection, job_id: int, outcome: policy.Outcome, at: datetime) -> Job:
    """Record the finalization decision (§6.5); the first success stays the job's result."""
    values: dict[str, Any] = {"status": outcome.status, "result": outcome.result, "updated_at": sa.func.now()}
    if outcome.status == policy.SUCCEEDED:
        values.update(finished_at=at, last_error=None)
    conn.execute(sa.update(review_jobs)
                 .where(review_jobs.c.id == job_id, review_jobs.c.status.in_(policy.UNFINISHED)).values(**values))
    return job_by_id(conn, job_id)


def job_status_counts(conn: sa.Connection) -> dict[str, int]:
    """Jobs per status, in the order of `policy.JOB_STATUSES`."""
    found = dict(conn.execute(sa.select(review_jobs.c.status, sa.func.count()).group_by(review_jobs.c.status)).all())
    return {status: found[status] for status in policy.JOB_STATUSES if status in found}


@contextmanager
def job_lock(engine: sa.Engine, job_id: int) -> Iterator[bool]:
    """One deliverer per job at a time: a session advisory lock, released on exit or when the process dies.

    Yields False when another run holds it. The lock lives on its own connection, so the
    deliverer's writes still commit one by one (the `sending` marker must be durable before a send).
    """
    key = sa.func.hashtextextended(f"{policy.PIPELINE}:job:{job_id}", 0)
    with engine.connect() as conn:
        acquired = bool(conn.execute(sa.select(sa.func.pg_try_advisory_lock(key))).scalar())
        conn.commit()
        try:
            yield acquired
        finally:
            if acquired:
                conn.execute(sa.select(sa.func.pg_advisory_unlock(key)))
                conn.commit()


# -------------------------------------------------------------------------------------- deliveries


def deliveries_of(conn: sa.Connection, job_id: int) -> list[Delivery]:
    rows = conn.execute(sa.select(review_deliveries).where(review_deliveries.c.job_id == job_id)
                        .order_by(review_deliveries.c.id))
    return [Delivery.from_row(r) for r in rows]


def marked_sent(conn: sa.Connection, job_id: int) -> list[Delivery]:
    rows = conn.execute(sa.select(review_deliveries)
                        .where(review_deliveries.c.job_id == job_id, review_deliveries.c.notified_at.is_not(None))
                        .order_by(review_deliveries.c.id))
    return [Delivery.from_row(r) for r in rows]


def unsent(conn: sa.Connection, job_id: int) -> list[Delivery]:
    rows = conn.execute(
        sa.select(review_deliveries)
        .where(review_deliveries.c.job_id == job_id, review_deliveries.c.notified_at.is_(None),
               review_deliveries.c.status.in_((policy.D_PENDING, policy.D_SENDING)))
        .order_by(review_deliveries.c.id))
    return [Delivery.from_row(r) for r in rows]


def get_delivery(conn: sa.Connection, delivery_id: int) -> Delivery:
    row = conn.execute(sa.select(review_deliveries).where(review_deliveries.c.id == delivery_id)).first()
    if row is None:
        raise UnknownJob(f"{UnknownJob.code}: no delivery row {delivery_id}")
    return Delivery.from_row(row)


def claim_for_send(conn: sa.Connection, delivery_id: int) -> Delivery | None:
    """Record that a send is starting (status `sending`, attempts + 1) and return the row as it was before.

    One statement: re-read and claim (§6.4 "retries MUST re-read the outbox row first"). None when
    the row is notified, failed or no longer required: nothing may be sent. The claim is not a
    "sent" mark (notified_at stays NULL); it tells a later attempt that a send may have reached the
    provider, so that attempt looks the token up before sending (§8.2 row 1).
    """
    # The marker only chooses "look up first" over "send"; the provider's idempotency token already
    # makes a resend harmless. So its commit need not wait for the WAL flush: only a crash of
    # PostgreSQL itself can lose it, and then the resend is deduplicated by the provider.
    conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
    prev = sa.select(review_deliveries).where(review_deliveries.c.id == delivery_id).with_for_update().cte("prev")
    row = conn.execute(
        sa.update(review_deliveries)
        .where(review_deliveries.c.id == prev.c.id, review_deliveries.c.notified_at.is_(None),
               review_deliveries.c.status.in_((policy.D_PENDING, policy.D_SENDING)))
        .values(status=policy.D_SENDING, attempts=review_deliveries.c.attempts + 1, updated_at=sa.func.now())
        .returning(*prev.c)
    ).first()
    return Delivery.from_row(row) if row else None


def mark_sent(conn: sa.Connection, delivery_id: int, notification_id: str, at: datetime) -> bool:
    """§6.4 step 3: notification_id, notified_at and `sent` in a single write, only after the provider said yes."""
    result = conn.execute(
        sa.update(review_deliveries)
        .where(review_deliveries.c.id == delivery_id, review_deliveries.c.notified_at.is_(None))
        .values(notification_id=notification_id, notified_at=at, status=policy.D_SENT, last_error=None,
                updated_at=sa.func.now())
    )
    return result.rowcount == 1


def repair_notification_id(conn: sa.Connection, delivery_id: int, notification_id: str) -> None:
    conn.execute(sa.update(review_deliveries).where(review_deliveries.c.id == delivery_id)
                 .values(notification_id=notification_id, updated_at=sa.func.now()))


def clear_markers(conn: sa.Connection, delivery_id: int, *, episode: int, note: str) -> bool:
    """§8.2 row 2: marked sent without provider evidence → markers cleared, requeued, episode counted.

    Guarded by the episode, so two reconcilers of the same row clear it once.
    """
    result = conn.execute(
        sa.update(review_deliveries)
        .where(review_deliveries.c.id == delivery_id, review_deliveries.c.reconciliations == episode - 1,
               review_deliveries.c.notified_at.is_not(None))
        .values(notified_at=None, notification_id=None, status=policy.D_PENDING, reconciliations=episode,
                last_error=note, updated_at=sa.func.now())
    )
    return result.rowcount == 1


def record_error(conn: sa.Connection, delivery_id: int, error: str) -> None:
    conn.execute(sa.update(review_deliveries).where(review_deliveries.c.id == delivery_id)
                 .values(last_error=error[:500], updated_at=sa.func.now()))


def fail_delivery(conn: sa.Connection, delivery_id: int, error: str) -> bool:
    """§8.1: a permanent failure fails this recipient's row (never a row that was notified)."""
    result = conn.execute(
        sa.update(review_deliveries)
        .where(review_deliveries.c.id == delivery_id, review_deliveries.c.notified_at.is_(None),
               review_deliveries.c.status.in_((policy.D_PENDING, policy.D_SENDING)))
        .values(status=policy.D_FAILED, last_error=error[:500], updated_at=sa.func.now())
    )
    return result.rowcount == 1


def requeue_failed(conn: sa.Connection, delivery_id: int) -> bool:
    """An operator replays the row's dead letter: back to `pending`, keeping its attempt count."""
    result = conn.execute(
        sa.update(review_deliveries)
        .where(review_deliveries.c.id == delivery_id, review_deliveries.c.status == policy.D_FAILED)
        .values(status=policy.D_PENDING, updated_at=sa.func.now())
    )
    return result.rowcount == 1


def waive(conn: sa.Connection, delivery_id: int, note: str) -> bool:
    """An operator removes an undeliverable recipient from the required set (never a notified row)."""
    result = conn.execute(
        sa.update(review_deliveries)
        .where(review_deliveries.c.id == delivery_id, review_deliveries.c.notified_at.is_(None),
               review_deliveries.c.status.in_((policy.D_PENDING, policy.D_SENDING, policy.D_FAILED)))
        .values(status=policy.D_WAIVED, last_error=note[:500], updated_at=sa.func.now())
    )
    return result.rowcount == 1


def status_counts(conn: sa.Connection, job_id: int) -> dict[str, int]:
    rows = conn.execute(sa.select(review_deliveries.c.status, sa.func.count())
                        .where(review_deliveries.c.job_id == job_id).group_by(review_deliveries.c.status))
    return {status: n for status, n in rows}


# ------------------------------------------------------------------------------------ reconciliation


def failed_for_good(conn: sa.Connection, limit: int, since: datetime | None = None) -> list[FinalFailure]:
    """Delivery rows ``failed`` with no dead letter at all. The sender dead-letters first and fails the row
    second (its clock, then the database's), so times cannot be compared; a failed row is final until a
    replay reopens its letter, so any letter counts. See `redrive.reconcile`."""
    d = review_deliveries
    ref = d.c.changelist_id + ":v" + sa.cast(d.c.review_version, sa.Text) + ":d" + sa.cast(d.c.id, sa.Text)
    query = (sa.select(d.c.id, d.c.changelist_id, d.c.review_version, d.c.attempts, d.c.last_error, d.c.updated_at,
                       ref.label("ref"))
             .where(d.c.status == policy.D_FAILED, deadletters.unrecorded(policy.PIPELINE, ref)))
    if since is not None:  # ix_review_deliveries_failed
        query = query.where(d.c.updated_at >= since)
    rows = conn.execute(query.order_by(d.c.updated_at).limit(limit))
    out = []
    for r in rows:
        code = (r.last_error or "INTERNAL_ERROR").split(":", 1)[0].strip() or "INTERNAL_ERROR"
        out.append(FinalFailure(
            pipeline=policy.PIPELINE, stage="send", entity_ref=r.ref, attempts=max(1, r.attempts), at=r.updated_at,
            failure=Failure(code=code[:64], retryable=False, retry_after=None,
                            message="review notification failed for good", detail=r.last_error or ""),
            context={"delivery_id": r.id, "reconciled": True},
            payload_ref={"table": "review_deliveries", "id": r.id},
        ))
    return out


def retention_rules(settings: Any) -> list[Any]:
    """A settled delivery's recipient (an e-mail address) is replaced by its SHA-256 after the personal-data
    window: the row stays unique per (changelist, recipient, version) and keeps its provider token, so
    §10.2's "notified once" still holds for a late duplicate, and no address is kept. Finished jobs (their
    idempotency key, §6.1) are deleted with their deliveries after the idempotency window."""
    from redrive.retention import Entity, Rule

    # ':' || 'v', not ':v' (a bind parameter to SQLAlchemy's text())
    job_ref = "t.changelist_id || ':' || 'v' || CAST(t.review_version AS text)"
    return [
        Rule("review_notifications.recipients", "review_deliveries", ("id",), "retention_personal_data_days",
             "t.updated_at", "t.status IN ('sent', 'failed', 'waived', 'superseded') "
             "AND t.recipient NOT LIKE 'sha256:%'", "a settled delivery's recipient address (its hash stays)",
             entity=Entity("review_notifications", f"{job_ref} || ':' || 'd' || CAST(t.id AS text)"),
             scrub={"recipient": "'sha256:' || encode(sha256(convert_to(t.recipient, 'UTF8')), 'hex')"}),
        Rule("review_notifications.jobs", "review_jobs", ("id",), "retention_idempotency_days", "t.updated_at",
             "t.status IN ('succeeded', 'superseded')", "finished jobs (their idempotency keys) and deliveries",
             entity=Entity("review_notifications", job_ref, separator=":")),
    ]
