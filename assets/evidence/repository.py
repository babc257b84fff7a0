"""All SQL of the evidence pipeline: file jobs, rows, artifacts (004 §1), its outbox, and monitoring.

Functions take a `Connection`, so a state change and the outbox row it causes share one
transaction. The database enforces what must hold: deterministic primary keys with
ON CONFLICT DO NOTHING make ingest and event writes idempotent, row locks (`FOR UPDATE`,
`SKIP LOCKED`) keep the scheduler and the worker from touching a row at the same time, and the
generated `error_category` / `is_retryable` columns are 004 §1.1's own definition.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID as PG_UUID, insert

from assets.evidence import contracts, policy
from assets.evidence.policy import (
    ATTACHED,
    FAILED,
    INGEST_FAILED,
    INGESTED,
    INVALID,
    PENDING,
    PERMANENT_FAILED,
    RECEIVED,
    RETRYING,
    VALID,
)
from redrive import deadletters
from redrive.db import compiled_once
from redrive.deadletters import FinalFailure
from redrive.failures import Failure
from redrive import work
from redrive.schema import NOW, TZ, metadata

UUIDType = PG_UUID(as_uuid=True)


def _enum_check(column: str, values: Iterable[str], name: str) -> sa.CheckConstraint:
    listed = ", ".join(f"'{v}'" for v in values)
    return sa.CheckConstraint(f"{column} IN ({listed})", name=name)


PIPELINE = "evidence"  # the core's name for a row's attach work: work rows, dead letters, replay

# ------------------------------------------------------------------------------------------- tables

file_job = sa.Table(
    "file_job",
    metadata,
    sa.Column("id", UUIDType, primary_key=True),
    sa.Column("source_bucket", sa.Text, nullable=False),
    sa.Column("source_key", sa.Text, nullable=False),
    sa.Column("source_etag", sa.Text, nullable=False),
    sa.Column("notify_to", sa.Text, nullable=False),
    sa.Column("status", sa.String(20), nullable=False, server_default=RECEIVED),
    sa.Column("error_code", sa.String(64)),
    sa.Column("error_message", sa.Text),
    sa.Column("row_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("artifact_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("ingested_at", TZ),
    sa.Column("n1_requested_at", TZ),
    sa.Column("n1_sent_at", TZ),
    sa.Column("n1_message_id", sa.Text),
    sa.Column("n2_requested_at", TZ),
    sa.Column("n2_sent_at", TZ),
    sa.Column("n2_message_id", sa.Text),
    sa.Column("n2_forced", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    sa.UniqueConstraint("source_bucket", "source_key", "source_etag"),
    _enum_check("status", policy.FILE_JOB_STATUSES, "status"),
    # 004 §5 timeout safeguard: jobs whose N2 is still open, by N1 time.
    sa.Index("ix_file_job_n2_open", "n1_sent_at", postgresql_where=sa.text("n2_requested_at IS NULL")),
    sa.Index("ix_file_job_n2_sent_at", "n2_sent_at", postgresql_where=sa.text("n2_sent_at IS NOT NULL")),  # pruner
)

file_job_row = sa.Table(
    "file_job_row",
    metadata,
    sa.Column("id", UUIDType, primary_key=True),
    sa.Column("file_job_id", UUIDType, sa.ForeignKey("file_job.id"), nullable=False),
    sa.Column("line_no", sa.Integer, nullable=False),
    sa.Column("case_ref", sa.Text, nullable=False),
    sa.Column("case_id", UUIDType),
    sa.Column("row_status", sa.String(20), nullable=False, server_default=VALID),
    sa.Column("row_error_code", sa.String(64)),
    sa.Column("row_error_message", sa.Text),
    # 004 §1.2 rollups, derived from the artifacts under the row's lock
    sa.Column("evidence_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("evidence_attached_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("evidence_failed_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("evidence_status", sa.String(20), nullable=False, server_default=PENDING),
    sa.Column("evidence_failed_files", JSONB),
    sa.Column("evidence_completed_at", TZ),
    sa.Column("retry_round", sa.Integer, nullable=False, server_default="0"),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    sa.UniqueConstraint("file_job_id", "line_no"),
    _enum_check("row_status", (VALID, INVALID), "row_status"),
    _enum_check("evidence_status", policy.ROW_EVIDENCE_STATUSES, "evidence_status"),
)

# 004 §1.1 error_category, verbatim; redrive.vocabularies.evidence_category is the same table in Python.
ERROR_CATEGORY_SQL = (
    "CASE "
    "WHEN attachment_error_code IN ('ATTACHMENT_API_TIMEOUT', '503', 'NETWORK_TIMEOUT') THEN 'NETWORK' "
    "WHEN attachment_error_code IN ('500', 'SYSTEM_ERROR') THEN 'SYSTEM' "
    "WHEN attachment_error_code IN ('CORRUPTED_FILE', 'INVALID_FORMAT', 'S3_NOT_FOUND') THEN 'DATA' "
    "WHEN attachment_error_code IN ('401', '403', 'UNAUTHORIZED', 'CASE_NOT_FOUND') THEN 'AUTH' "
    "ELSE 'SYSTEM' END"
)
IS_RETRYABLE_SQL = f"({ERROR_CATEGORY_SQL}) IN ('NETWORK', 'SYSTEM') AND retry_count < 2"
# The predicate of 004's scan indexes; queries repeat it literally so the planner can use them.
RETRY_SCAN_PREDICATE = "retry_status IN ('PENDING', 'RETRY_FAILED') AND retry_count < 2"

file_job_artifact = sa.Table(
    "file_job_artifact",
    metadata,
    # core identity
    sa.Column("id", UUIDType, primary_key=True),
    sa.Column("file_job_id", UUIDType, sa.ForeignKey("file_job.id"), nullable=False),
    sa.Column("file_job_row_id", UUIDType, sa.ForeignKey("file_job_row.id"), nullable=False),
    sa.Column("case_id", UUIDType, nullable=False),
    sa.Column("file_name", sa.Text, nullable=False),
    sa.Column("file_type", sa.Text),
    sa.Column("file_size_bytes", sa.BigInteger),
    sa.Column("s3_key", sa.Text, nullable=False),
    sa.Column("content_sha256", sa.Text),
    # attachment lifecycle
    sa.Column("attachment_status", sa.String(20), nullable=False, server_default=PENDING),
    sa.Column("attachment_error_code", sa.String(64)),
    sa.Column("attachment_error_message", sa.Text),
    sa.Column("attached_at", TZ),
    sa.Column("case_attachment_id", sa.Text),
    sa.Column("attempt_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("retry_count", sa.Integer, nullable=False, server_default="0"),
    # An attempt whose outcome is not written yet: set (and committed) before the case API call.
    sa.Column("attempt_started_at", TZ),
    # retry orchestration
    sa.Column("retry_status", sa.String(20), nullable=False, server_default=PENDING),
    sa.Column("next_retry_at", TZ),
    sa.Column("last_retry_at", TZ),
    # error taxonomy
    sa.Column("error_category", sa.String(20), sa.Computed(ERROR_CATEGORY_SQL, persisted=True)),
    sa.Column("is_retryable", sa.Boolean, sa.Computed(IS_RETRYABLE_SQL, persisted=True)),
    # ops
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    _enum_check("attachment_status", policy.ATTACHMENT_STATUSES, "attachment_status"),
    _enum_check("retry_status", policy.RETRY_STATUSES, "retry_status"),
    # 004 §1.1's three indexes
    sa.Index("idx_artifact_retry_scan", "next_retry_at", "retry_count",
             postgresql_where=sa.text(RETRY_SCAN_PREDICATE)),
    sa.Index("idx_artifact_retry_cover", "next_retry_at", "retry_count",
             postgresql_include=["id", "file_job_id", "file_job_row_id", "s3_key", "case_id", "retry_status",
                                 "attachment_status"],
             postgresql_where=sa.text(RETRY_SCAN_PREDICATE)),
    sa.Index("idx_artifact_by_job_row", "file_job_id", "file_job_row_id"),
    # ours, for §6: the retry queue's depth, and outcomes in the last hour
    sa.Index("ix_file_job_artifact_in_retry", "file_job_row_id",
             postgresql_where=sa.text("retry_status IN ('RETRY_FAILED', 'RETRY_SCHEDULED', 'RETRYING')")),
    sa.Index("ix_file_job_artifact_updated_at", "updated_at"),
)

OUTBOX_STATUSES = ("PENDING", "PUBLISHED", "CONSUMED", "FAILED")

evidence_outbox = sa.Table(
    "evidence_outbox",
    metadata,
    sa.Column("event_id", UUIDType, primary_key=True),
    sa.Column("seq", sa.BigInteger, sa.Identity(), nullable=False, unique=True),
    sa.Column("event_type", sa.String(40), nullable=False),
    sa.Column("topic", sa.Text, nullable=False),
    sa.Column("file_job_id", UUIDType, nullable=False),
    sa.Column("file_job_row_id", UUIDType),
    sa.Column("case_id", UUIDType),
    sa.Column("payload", JSONB, nullable=False),
    sa.Column("status", sa.String(20), nullable=False, server_default="PENDING"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("published_at", TZ),
    sa.Column("consumed_at", TZ),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    _enum_check("status", OUTBOX_STATUSES, "status"),
    _enum_check("event_type", contracts.EVENT_TYPES, "event_type"),
    sa.Index("ix_evidence_outbox_pending", "seq", postgresql_where=sa.text("status = 'PENDING'")),
    sa.Index("ix_evidence_outbox_published", "published_at", postgresql_where=sa.text("status = 'PUBLISHED'")),
    sa.Index("ix_evidence_outbox_file_job", "file_job_id", "event_type"),
    # the pruner's range: sent notifications whose payload still names the merchant's address
    sa.Index("ix_evidence_outbox_notified", "consumed_at",
             postgresql_where=sa.text("status = 'CONSUMED' AND event_type IN ('EVIDENCE_N1_REQUESTED', "
                                      "'EVIDENCE_N2_REQUESTED') AND (payload ->> 'to') <> 'redacted'")),
)

evidence_scheduler_ticks = sa.Table(
    "evidence_scheduler_ticks",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("started_at", TZ, nullable=False),
    sa.Column("duration_ms", sa.Float, nullable=False),
    sa.Column("rows_requeued", sa.Integer, nullable=False),
    sa.Column("artifacts_requeued", sa.Integer, nullable=False),
    sa.Column("n2_forced", sa.Integer, nullable=False),
    sa.Column("batch_limit", sa.Integer, nullable=False),
    sa.Index("ix_evidence_scheduler_ticks_started_at", "started_at"),
)

evidence_metrics = sa.Table(
    "evidence_metrics",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("measured_at", TZ, nullable=False),
    sa.Column("metrics", JSONB, nullable=False),
    sa.Index("ix_evidence_metrics_measured_at", "measured_at"),
)

evidence_alert_state = sa.Table(
    "evidence_alert_state",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("firing", sa.Boolean, nullable=False),
    sa.Column("episode", sa.Integer, nullable=False),
    sa.Column("condition_since", TZ),
    sa.Column("updated_at", TZ, nullable=False),
)

# ------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class FileJob:
    id: UUID
    source_bucket: str
    source_key: str
    source_etag: str
    notify_to: str
    status: str
    error_code: str | None
    row_count: int
    artifact_count: int
    n1_requested_at: datetime | None
    n1_sent_at: datetime | None
    n1_message_id: str | None
    n2_requested_at: datetime | None
    n2_sent_at: datetime | None
    n2_message_id: str | None
    n2_forced: bool

    @classmethod
    def from_row(cls, row: Any) -> FileJob:
        m = row._mapping
        return cls(**{f: m[f] for f in cls.__dataclass_fields__})

    @property
    def source_name(self) -> str:
        return self.source_key.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class OutboxEvent:
    event_id: UUID
    seq: int
    event_type: str
    topic: str
    file_job_id: UUID
    file_job_row_id: UUID | None
    payload: Mapping[str, Any]
    status: str
    attempts: int

    @classmethod
    def from_row(cls, row: Any) -> OutboxEvent:
        m = row._mapping
        return cls(**{f: m[f] for f in cls.__dataclass_fields__})


# ----------------------------------------------------------------------------------------- file jobs


def upsert_file_job(conn: sa.Connection, job_id: UUID, *, bucket: str, key: str, etag: str, notify_to: str,
                    now: datetime) -> FileJob:
    conn.execute(
        insert(file_job)
        .values(id=job_id, source_bucket=bucket, source_key=key, source_etag=etag, notify_to=notify_to,
                created_at=now, updated_at=now)
        .on_conflict_do_nothing()
    )
    job = get_file_job(conn, job_id)
    assert job is not None
    return job


def known_file_jobs(conn: sa.Connection, job_ids: list[UUID]) -> set[UUID]:
    """Which of these file jobs are recorded (ingested, or being ingested): one lookup by primary key."""
    if not job_ids:
        return set()
    return set(conn.execute(sa.select(file_job.c.id).where(file_job.c.id.in_(job_ids))).scalars())


def get_file_job(conn: sa.Connection, job_id: UUID, *, lock: bool = False) -> FileJob | None:
    q = sa.select(file_job).where(file_job.c.id == job_id)
    row = conn.execute(q.with_for_update() if lock else q).first()
    return FileJob.from_row(row) if row else None


def mark_ingest_failed(conn: sa.Connection, job_id: UUID, code: str, message: str, now: datetime) -> None:
    conn.execute(
        sa.update(file_job).where(file_job.c.id == job_id, file_job.c.status == RECEIVED)
        .values(status=INGEST_FAILED, error_code=code, error_message=message[:500], updated_at=now)
    )


def record_ingest(conn: sa.Connection, job: FileJob, parsed: policy.ParsedArchive, *, s3_uri: Callable[[UUID, str], str],
                  now: datetime) -> dict[str, int]:
    """Rows, artifacts, one EVIDENCE_ATTACH_REQUESTED event and one due work row (the core's queue, grouped
    by file job) per attachable row, in the caller's transaction. Keys are derived from the file job, so
    a second ingest inserts nothing new."""
    rows: list[dict[str, Any]] = []
    artifacts: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for prow in parsed.rows:
        rid = policy.row_id(job.id, prow.line_no)
        rows.append({
            "id": rid, "file_job_id": job.id, "line_no": prow.line_no, "case_ref": prow.case_ref,
            "case_id": prow.case_id, "row_status": VALID if prow.ok else INVALID,
            "row_error_code": prow.error_code, "row_error_message": prow.error_message,
            "evidence_status": PENDING if prow.ok else FAILED,
            "evidence_completed_at": None if prow.ok else now,
            "created_at": now, "updated_at": now,
        })
        if not prow.ok:
            continue
        refs = []
        for f in prow.files:
            aid = policy.artifact_id(rid, f.index, f.name)
            key = s3_uri(aid, f.name)
            refs.append(contracts.ArtifactRef(artifact_id=aid, s3_key=key))
            artifacts.append({
                "id": aid, "file_job_id": job.id, "file_job_row_id": rid, "case_id": prow.case_id,
                "file_name": f.name, "file_type": f.file_type, "file_size_bytes": f.size, "s3_key": key,
                "content_sha256": f.sha256,
                # a file rejected at ingest is final at once: its check was its attempt (N1's gate counts it)
                "attachment_status": PENDING if f.ok else FAILED,
                "attachment_error_code": f.error_code, "attachment_error_message": f.error_message,
                "retry_status": PENDING if f.ok else PERMANENT_FAILED,
                "created_at": now, "updated_at": now,
            })
        if any(f.ok for f in prow.files):
            assert prow.case_id is not None
            event = contracts.EvidenceAttachRequested(
                event_id=policy.initial_event_id(rid), occurred_at=now, file_job_id=job.id, file_job_row_id=rid,
                case_id=prow.case_id, artifacts=refs)
            events.append(_event_values(event, row=rid, case=prow.case_id, now=now))
    if rows:
        conn.execute(insert(file_job_row).on_conflict_do_nothing(), rows)
    if artifacts:
        conn.execute(insert(file_job_artifact).on_conflict_do_nothing(), artifacts)
    if events:
        conn.execute(insert(evidence_outbox).on_conflict_do_nothing(index_elements=["event_id"]), events)
        work.enqueue_many(conn, PIPELINE, [(policy.row_entity(job.id, e["file_job_row_id"]), str(job.id))
                                                  for e in events], now=now)
    for prow in parsed.rows:
        if prow.ok:
            refresh_row(conn, job.id, policy.row_id(job.id, prow.line_no), now)
    conn.execute(
        sa.update(file_job).where(file_job.c.id == job.id)
        .values(status=INGESTED, ingested_at=now, row_count=len(rows), artifact_count=len(artifacts), updated_at=now)
    )
    return {"rows": len(rows), "invalid_rows": sum(1 for r in parsed.rows if not r.ok),
            "artifacts": len(artifacts), "rejected_artifacts": sum(1 for a in artifacts if a["attachment_error_code"]),
            "attach_events": len(events)}


# -------------------------------------------------------------------------------------------- outbox


def _event_values(event: contracts.Contract, *, row: UUID | None, case: UUID | None, now: datetime) -> dict[str, Any]:
    payload = contracts.dump(event)
    return {
        "event_id": UUID(str(payload["event_id"])), "event_type": payload["event_type"],
        "topic": contracts.TOPICS[str(payload["event_type"])], "file_job_id": UUID(str(payload["file_job_id"])),
        "file_job_row_id": row, "case_id": case, "payload": payload, "created_at": now, "updated_at": now,
    }


def add_event(conn: sa.Connection, event: contracts.Contract, *, row: UUID | None, case: UUID | None,
              now: datetime) -> bool:
    """Insert an outbox event; False when its (deterministic) id was already written."""
    return conn.execute(_ADD_EVENT, _event_values(event, row=row, case=case, now=now)).first() is not None


_ADD_EVENT = compiled_once(insert(evidence_outbox).on_conflict_do_nothing(index_elements=["event_id"])
                           .returning(evidence_outbox.c.event_id),
                           "event_id", "event_type", "topic", "file_job_id", "file_job_row_id", "case_id", "payload",
                           "created_at", "updated_at")


def get_event(conn: sa.Connection, event_id: UUID) -> OutboxEvent | None:
    row = conn.execute(sa.select(evidence_outbox).where(evidence_outbox.c.event_id == event_id)).first()
    return OutboxEvent.from_row(row) if row else None


def mark_consumed(conn: sa.Connection, event_id: UUID, now: datetime) -> None:
    conn.execute(
        sa.update(evidence_outbox).where(evidence_outbox.c.event_id == event_id)
        .values(status="CONSUMED", consumed_at=now, updated_at=now)
    )


def consume_row_events(conn: sa.Connection, job_id: UUID, row_id: UUID, now: datetime) -> int:
    """The row's attach events (initial and retries) are consumed by the pass that worked the row."""
    o = evidence_outbox
    return conn.execute(
        sa.update(o).where(o.c.file_job_id == job_id, o.c.file_job_row_id == row_id,
                           o.c.event_type.in_((contracts.ATTACH_REQUESTED, contracts.ATTACH_RETRY)),
                           o.c.status.in_(("PENDING", "PUBLISHED")))
        .values(status="CONSUMED", consumed_at=now, updated_at=now)
    ).rowcount


def notification_events(conn: sa.Connection, job_id: UUID) -> list[OutboxEvent]:
    """The file job's N1/N2 events, N1 first."""
    o = evidence_outbox
    rows = conn.execute(
        sa.select(o).where(o.c.file_job_id == job_id,
                           o.c.event_type.in_((contracts.N1_REQUESTED, contracts.N2_REQUESTED)))
        .order_by(o.c.event_type)  # N1 < N2
    )
    return [OutboxEvent.from_row(r) for r in rows]


def outbox_counts(conn: sa.Connection) -> dict[str, int]:
    rows = conn.execute(sa.select(evidence_outbox.c.status, sa.func.count()).group_by(evidence_outbox.c.status))
    return {status: count for status, count in rows}


def failed_events(conn: sa.Connection, since: datetime) -> list[OutboxEvent]:
    o = evidence_outbox
    rows = conn.execute(sa.select(o).where(o.c.status == "FAILED", o.c.updated_at >= since).order_by(o.c.seq))
    return [OutboxEvent.from_row(r) for r in rows]


# -------------------------------------------------------------------------------------------- worker

_ARTIFACT_STATE = [file_job_artifact.c[name] for name in policy.ArtifactState.__dataclass_fields__]


def lock_row(conn: sa.Connection, job_id: UUID, row_id: UUID) -> Any:
    """004 §4 Rule 0 at row level: the row's lock is held while its artifacts are attempted."""
    return conn.execute(
        sa.select(file_job_row).where(file_job_row.c.id == row_id, file_job_row.c.file_job_id == job_id)
        .with_for_update()
    ).first()


def row_artifacts(conn: sa.Connection, job_id: UUID, row_id: UUID) -> list[policy.ArtifactState]:
    a = file_job_artifact
    rows = conn.execute(
        sa.select(*_ARTIFACT_STATE).where(a.c.file_job_id == job_id, a.c.file_job_row_id == row_id)
        .order_by(a.c.file_name, a.c.id)
    )
    return [policy.ArtifactState(**r._mapping) for r in rows]


def claim_attempts(conn: sa.Connection, planned: Sequence[policy.PlannedAttempt], now: datetime) -> None:
    """Record that these attempts start, before any call: the "recorded attempt" a retry looks up."""
    if not planned:
        return
    a = file_job_artifact
    retrying = [p.artifact.id for p in planned if p.attempt > 1]
    conn.execute(
        sa.update(a).where(a.c.id.in_([p.artifact.id for p in planned]))
        .values(attempt_started_at=now, updated_at=now,
                retry_status=sa.case((a.c.id.in_(retrying), RETRYING), else_=a.c.retry_status) if retrying
                else a.c.retry_status)
    )


def write_outcome(conn: sa.Connection, w: policy.ArtifactWrite, now: datetime) -> bool:
    """Write one attempt's outcome; guarded by the attempt number so a replayed write changes nothing."""
    a = file_job_artifact
    values: dict[str, Any] = {
        "attachment_status": w.attachment_status, "attachment_error_code": w.attachment_error_code,
        "attachment_error_message": w.attachment_error_message, "attempt_count": w.attempt_count,
        "retry_count": w.retry_count, "retry_status": w.retry_status, "next_retry_at": w.next_retry_at,
        "attempt_started_at": None, "updated_at": now,
    }
    if w.attached_at is not None:
        values["attached_at"] = w.attached_at
        values["case_attachment_id"] = w.case_attachment_id
    if w.last_retry_at is not None:
        values["last_retry_at"] = w.last_retry_at
    result = conn.execute(sa.update(a).where(a.c.id == w.artifact_id, a.c.attempt_count == w.attempt_count - 1)
                          .values(**values))
    return result.rowcount == 1


@dataclass(frozen=True)
class RowSummary:
    file_job_id: UUID
    row_id: UUID
    case_ref: str
    counts: policy.RowCounts
    status: str
    failed: tuple[policy.FailedArtifact, ...]
    max_attempts: int

    @property
    def settled(self) -> bool:
        return self.counts.in_flight == 0


def refresh_row(conn: sa.Connection, job_id: UUID, row_id: UUID, now: datetime) -> RowSummary:
    """Recompute 004 §1.2's rollups of a row from its artifacts (call under the row's lock)."""
    a, r = file_job_artifact, file_job_row
    facts = conn.execute(
        sa.select(a.c.id, a.c.file_name, a.c.attachment_status, a.c.attachment_error_code, a.c.retry_status,
                  a.c.attempt_count)
        .where(a.c.file_job_id == job_id, a.c.file_job_row_id == row_id).order_by(a.c.file_name, a.c.id)
    ).all()
    row = conn.execute(sa.select(r.c.case_ref, r.c.row_status, r.c.evidence_completed_at).where(r.c.id == row_id)).one()
    counts = policy.RowCounts(
        total=len(facts),
        attached=sum(1 for f in facts if f.attachment_status == ATTACHED),
        failed=sum(1 for f in facts if f.attachment_status == FAILED),
        in_flight=sum(1 for f in facts if f.attachment_status != ATTACHED and f.retry_status != PERMANENT_FAILED),
    )
    status = policy.row_evidence_status(counts, row_valid=row.row_status == VALID)
    failed = tuple(
        policy.FailedArtifact(f.id, row.case_ref, f.file_name, f.attachment_error_code or "SYSTEM_ERROR",
                              f.retry_status == PERMANENT_FAILED)
        for f in facts if f.attachment_status == FAILED
    )
    completed_at = (row.evidence_completed_at or now) if counts.in_flight == 0 else None
    conn.execute(
        sa.update(r).where(r.c.id == row_id).values(
            evidence_count=counts.total, evidence_attached_count=counts.attached,
            evidence_failed_count=counts.failed, evidence_status=status,
            evidence_failed_files=[{"artifact_id": str(f.artifact_id), "file_name": f.file_name,
                                    "error_code": f.error_code, "final": f.final} for f in failed] or None,
            evidence_completed_at=completed_at, updated_at=now)
    )
    return RowSummary(job_id, row_id, row.case_ref, counts, status, failed,
                      max((f.attempt_count for f in facts), default=0))


# --------------------------------------------------------------------------------- notifications


def job_facts(conn: sa.Connection, job: FileJob, *, details: bool) -> policy.JobFacts:
    a, r = file_job_artifact, file_job_row
    c = conn.execute(
        sa.select(
            sa.func.count().label("total"),
            sa.func.count().filter(sa.or_(a.c.attempt_count >= 1, a.c.retry_status == PERMANENT_FAILED))
            .label("attempted_or_final"),
            sa.func.count().filter(a.c.attachment_status == ATTACHED).label("attached"),
            sa.func.count().filter(a.c.attachment_status != ATTACHED, a.c.retry_status != PERMANENT_FAILED)
            .label("in_flight"),
            sa.func.count().filter(a.c.attachment_status == ATTACHED, a.c.retry_count > 0).label("recovered"),
        ).where(a.c.file_job_id == job.id)
    ).one()
    invalid = conn.execute(
        sa.select(sa.func.count()).where(r.c.file_job_id == job.id, r.c.row_status == INVALID)
    ).scalar_one()
    failed: tuple[policy.FailedArtifact, ...] = ()
    if details:
        failed = tuple(
            policy.FailedArtifact(x.id, x.case_ref, x.file_name, x.attachment_error_code or "SYSTEM_ERROR",
                                  x.retry_status == PERMANENT_FAILED)
            for x in conn.execute(
                sa.select(a.c.id, r.c.case_ref, a.c.file_name, a.c.attachment_error_code, a.c.retry_status)
                .join(r, r.c.id == a.c.file_job_row_id)
                .where(a.c.file_job_id == job.id, a.c.attachment_status == FAILED)
                .order_by(r.c.line_no, a.c.file_name)
            )
        )
    return policy.JobFacts(
        file_job_id=job.id, status=job.status, source_name=job.source_name, total=c.total,
        attempted_or_final=c.attempted_or_final, attached=c.attached, in_flight=c.in_flight,
        recovered_by_retry=c.recovered, invalid_rows=invalid, failed=failed,
        n1_requested=job.n1_requested_at is not None, n2_requested=job.n2_requested_at is not None,
        error_code=job.error_code,
    )


def mark_notification_requested(conn: sa.Connection, job_id: UUID, kind: str, now: datetime, *,
                                forced: bool = False) -> None:
    values: dict[str, Any] = {"updated_at": now}
    if kind == "N1":
        values["n1_requested_at"] = now
    else:
        values["n2_requested_at"] = now
        values["n2_forced"] = forced
    conn.execute(sa.update(file_job).where(file_job.c.id == job_id).values(**values))


def mark_notification_sent(conn: sa.Connection, job_id: UUID, kind: str, message_id: str, now: datetime) -> None:
    column = {"N1": ("n1_sent_at", "n1_message_id"), "N2": ("n2_sent_at", "n2_message_id")}[kind]
    conn.execute(sa.update(file_job).where(file_job.c.id == job_id)
                 .values({column[0]: now, column[1]: message_id, "updated_at": now}))


# ----------------------------------------------------------------------------------------- scheduler


def next_retry_at(conn: sa.Connection, job_id: UUID, row_id: UUID) -> datetime | None:
    """When the row's earliest retryable failure falls due (004 §3's `next_retry_at`, per artifact)."""
    a = file_job_artifact
    return conn.execute(
        sa.select(sa.func.min(a.c.next_retry_at))
        .where(a.c.file_job_id == job_id, a.c.file_job_row_id == row_id, a.c.attachment_status != ATTACHED,
               a.c.retry_status != PERMANENT_FAILED, a.c.is_retryable.is_(True))
    ).scalar()


def schedule_row_retry(conn: sa.Connection, job_id: UUID, row_id: UUID, now: datetime) -> UUID | None:
    """004 §3 requeue of one row, in the transaction that makes its work row due at its next retry: bump
    the row's `retry_round` and write one EVIDENCE_ATTACH_RETRY naming all its artifacts (Option A)."""
    a, r = file_job_artifact, file_job_row
    bumped = conn.execute(
        sa.update(r).where(r.c.id == row_id, r.c.file_job_id == job_id)
        .values(retry_round=r.c.retry_round + 1, updated_at=now)
        .returning(r.c.id, r.c.file_job_id, r.c.case_id, r.c.retry_round)
    ).first()
    if bumped is None or bumped.case_id is None:
        return None
    refs = [contracts.ArtifactRef(artifact_id=x.id, s3_key=x.s3_key) for x in conn.execute(
        sa.select(a.c.id, a.c.s3_key).where(a.c.file_job_id == job_id, a.c.file_job_row_id == row_id)
        .order_by(a.c.file_name, a.c.id))]
    event = contracts.EvidenceAttachRetry(
        event_id=policy.retry_event_id(row_id, bumped.retry_round), occurred_at=now, file_job_id=job_id,
        file_job_row_id=row_id, case_id=bumped.case_id, artifacts=refs, retry_round=bumped.retry_round)
    add_event(conn, event, row=row_id, case=bumped.case_id, now=now)
    return event.event_id


def open_rows(conn: sa.Connection, job_id: UUID) -> list[UUID]:
    """Rows of the file job with an artifact neither attached nor final."""
    a = file_job_artifact
    return list(conn.execute(
        sa.select(a.c.file_job_row_id).distinct()
        .where(a.c.file_job_id == job_id, a.c.attachment_status != ATTACHED, a.c.retry_status != PERMANENT_FAILED)
    ).scalars())


def overdue_n2_jobs(conn: sa.Connection, *, cutoff: datetime, limit: int) -> list[FileJob]:
    """File jobs whose N1 went out before `cutoff` and whose N2 is still open, locked (SKIP LOCKED)."""
    rows = conn.execute(
        sa.select(file_job).where(file_job.c.n2_requested_at.is_(None), file_job.c.n1_sent_at <= cutoff)
        .order_by(file_job.c.n1_sent_at).limit(limit).with_for_update(skip_locked=True)
    )
    return [FileJob.from_row(x) for x in rows]


def lock_all_rows(conn: sa.Connection, job_id: UUID) -> list[UUID] | None:
    """Every row of the file job, locked without waiting; None if a worker holds one of them."""
    r = file_job_row
    total = conn.execute(sa.select(sa.func.count()).where(r.c.file_job_id == job_id)).scalar_one()
    locked = conn.execute(
        sa.select(r.c.id).where(r.c.file_job_id == job_id).with_for_update(skip_locked=True)
    ).scalars().all()
    return list(locked) if len(locked) == total else None


def close_open_artifacts(conn: sa.Connection, job_id: UUID, now: datetime) -> list[UUID]:
    """004 §5: at the N2 deadline, what is still retryable becomes PERMANENT_FAILED. Returns their rows."""
    a = file_job_artifact
    return list(conn.execute(
        sa.update(a)
        .where(a.c.file_job_id == job_id, a.c.attachment_status != ATTACHED, a.c.retry_status != PERMANENT_FAILED)
        .values(attachment_status=FAILED, retry_status=PERMANENT_FAILED, next_retry_at=None,
                attachment_error_code=sa.func.coalesce(a.c.attachment_error_code, "SYSTEM_ERROR"),
                attachment_error_message=sa.func.coalesce(a.c.attachment_error_message,
                                                          "not attempted before the N2 deadline"),
                updated_at=now)
        .returning(a.c.file_job_row_id)
    ).scalars().all())


def record_tick(conn: sa.Connection, *, started_at: datetime, duration_ms: float, rows: int, artifacts: int,
                n2_forced: int, batch_limit: int, keep: timedelta = timedelta(days=7)) -> None:
    t = evidence_scheduler_ticks
    conn.execute(sa.insert(t).values(started_at=started_at, duration_ms=duration_ms, rows_requeued=rows,
                                     artifacts_requeued=artifacts, n2_forced=n2_forced, batch_limit=batch_limit))
    conn.execute(sa.delete(t).where(t.c.started_at < started_at - keep))


# ------------------------------------------------------------------------------------------- metrics


def metrics_snapshot(conn: sa.Connection, *, now: datetime, window: timedelta) -> dict[str, Any]:
    """004 §6 core metrics, from the tables (cheap: each reads an index)."""
    a, j, t = file_job_artifact, file_job, evidence_scheduler_ticks
    since = now - window
    finished_cond = sa.or_(a.c.attachment_status == ATTACHED, a.c.retry_status == PERMANENT_FAILED)
    w = conn.execute(
        sa.select(
            sa.func.count().filter(finished_cond).label("finished"),
            sa.func.count().filter(a.c.retry_status == PERMANENT_FAILED).label("permanent"),
            sa.func.count().filter(a.c.attachment_status == ATTACHED, a.c.attempt_count == 1).label("first_ok"),
            sa.func.count().filter(finished_cond, a.c.attempt_count > 1).label("retried"),
            sa.func.count().filter(a.c.attachment_status == ATTACHED, a.c.attempt_count > 1).label("retried_ok"),
        ).where(a.c.updated_at >= since)
    ).one()
    by_code = {code: n for code, n in conn.execute(
        sa.select(a.c.attachment_error_code, sa.func.count())
        .where(a.c.updated_at >= since, a.c.retry_status == PERMANENT_FAILED).group_by(a.c.attachment_error_code))}
    depth = conn.execute(
        sa.select(sa.func.count(), sa.func.count(sa.distinct(a.c.file_job_row_id)))
        .where(sa.text("retry_status IN ('RETRY_FAILED', 'RETRY_SCHEDULED', 'RETRYING')"),
               a.c.attachment_status != ATTACHED)
    ).one()
    latency = sa.func.extract("epoch", j.c.n2_sent_at - j.c.n1_sent_at)
    n2 = conn.execute(
        sa.select(sa.func.avg(latency), sa.func.max(latency), sa.func.count(),
                  sa.func.count().filter(j.c.n2_forced.is_(True)))
        .where(j.c.n2_sent_at >= now - timedelta(days=1))
    ).one()
    active = conn.execute(sa.select(sa.func.count()).where(j.c.n2_sent_at.is_(None), j.c.status != RECEIVED)).scalar_one()
    tick = conn.execute(sa.select(t).order_by(t.c.started_at.desc()).limit(1)).first()
    outbox = outbox_counts(conn)
    finished = w.finished or 0
    return {
        "window_seconds": window.total_seconds(),
        "evidence.attach.finished": finished,
        "evidence.attach.first_attempt.success_rate": round(w.first_ok / finished, 4) if finished else None,
        "evidence.attach.retry.success_rate": round(w.retried_ok / w.retried, 4) if w.retried else None,
        "evidence.retry.queue.depth.artifacts": depth[0],
        "evidence.retry.queue.depth.rows": depth[1],
        "evidence.n2.latency.seconds.avg": float(n2[0]) if n2[0] is not None else None,
        "evidence.n2.latency.seconds.max": float(n2[1]) if n2[1] is not None else None,
        "evidence.n2.sent_last_day": n2[2],
        "evidence.n2.forced_last_day": n2[3],
        "evidence.permanent_failures.count": w.permanent,
        "evidence.permanent_failures.by_error_code": dict(sorted((k or "-", v) for k, v in by_code.items())),
        "evidence.file_jobs.active": active,
        "evidence.outbox": outbox,
        "scheduler.duration.seconds": tick.duration_ms / 1000 if tick else None,
        "scheduler.batch.size.rows": tick.rows_requeued if tick else None,
        "scheduler.batch.size.artifacts": tick.artifacts_requeued if tick else None,
        "scheduler.heartbeat.age.seconds": (now - tick.started_at).total_seconds() if tick else None,
    }


def save_metrics(conn: sa.Connection, now: datetime, metrics: Mapping[str, Any]) -> None:
    conn.execute(sa.insert(evidence_metrics).values(measured_at=now, metrics=dict(metrics)))
    conn.execute(sa.delete(evidence_metrics).where(evidence_metrics.c.measured_at < now - timedelta(days=30)))


def alert_states(conn: sa.Connection, *, lock: bool = False) -> dict[str, policy.AlertState]:
    q = sa.select(evidence_alert_state)
    rows = conn.execute(q.with_for_update() if lock else q)
    return {x.name: policy.AlertState(x.name, x.firing, x.episode, x.condition_since) for x in rows}


def save_alert_state(conn: sa.Connection, state: policy.AlertState, now: datetime) -> None:
    values = {"firing": state.firing, "episode": state.episode, "condition_since": state.condition_since,
              "updated_at": now}
    conn.execute(insert(evidence_alert_state).values(name=state.name, **values)
                 .on_conflict_do_update(index_elements=["name"], set_=values))


def forced_n2_jobs(conn: sa.Connection, since: datetime) -> list[FileJob]:
    rows = conn.execute(sa.select(file_job).where(file_job.c.n2_forced.is_(True), file_job.c.updated_at >= since))
    return [FileJob.from_row(x) for x in rows]


# ------------------------------------------------------------------------------------ reconciliation


def failed_for_good(conn: sa.Connection, limit: int, since: datetime | None = None) -> list[FinalFailure]:
    """Settled rows with a final failure an operator can act on (not DATA: N2's) and no dead letter at all:
    the worker settles the artifacts, then dead-letters the row in a second transaction. A replayed row
    keeps its letter, so any letter counts. See `redrive.reconcile`."""
    a = file_job_artifact
    entity = sa.cast(a.c.file_job_id, sa.Text) + "/" + sa.cast(a.c.file_job_row_id, sa.Text)
    final_ops = sa.and_(a.c.retry_status == PERMANENT_FAILED, a.c.error_category != policy.DATA_CATEGORY)
    query = (
        sa.select(a.c.file_job_id, a.c.file_job_row_id,
                  sa.func.array_agg(a.c.attachment_error_code).filter(final_ops).label("codes"),
                  sa.func.count().label("total"), sa.func.max(a.c.attempt_count).label("attempts"),
                  sa.func.max(a.c.updated_at).label("failed_at"))
        .group_by(a.c.file_job_id, a.c.file_job_row_id)
        .having(sa.func.bool_and(sa.or_(a.c.attachment_status == ATTACHED, a.c.retry_status == PERMANENT_FAILED)))
        .having(sa.func.count().filter(final_ops) > 0)
        .having(deadletters.unrecorded("evidence", entity))
    )
    if since is not None:  # the rows with an artifact settled since (ix_file_job_artifact_updated_at), all of each
        recent = sa.select(a.c.file_job_id, a.c.file_job_row_id).where(a.c.updated_at >= since)
        query = query.where(sa.tuple_(a.c.file_job_id, a.c.file_job_row_id).in_(recent))
    rows = conn.execute(query.order_by(sa.func.max(a.c.updated_at)).limit(limit))
    out = []
    for r in rows:
        found = policy.row_final_code([c or "SYSTEM_ERROR" for c in r.codes])
        if found is None:
            continue
        code, count = found
        out.append(FinalFailure(
            pipeline="evidence", stage="attach", entity_ref=policy.row_entity(r.file_job_id, r.file_job_row_id),
            attempts=r.attempts, at=r.failed_at,
            failure=Failure(code=code, retryable=False, retry_after=None,
                            message=f"{len(r.codes)} of {r.total} evidence files failed for good ({code}×{count})",
                            detail=""),
            context={"file_job_id": str(r.file_job_id), "row_id": str(r.file_job_row_id), "reconciled": True},
            payload_ref={"table": "file_job_row", "id": str(r.file_job_row_id), "file_job_id": str(r.file_job_id)},
        ))
    return out


def retention_rules(settings: Any) -> list[Any]:
    """A file job is finished once N2 went (004 §5). After the personal-data window the merchant's address
    is cleared from the job and from its sent notifications (their text stays, for the audit); after the
    idempotency window the job goes with its rows, artifacts and outbox events. A job with a row still
    due, leased, retrying or dead-lettered, or an event not consumed, keeps everything. The evidence
    files in S3 are not removed here: an S3 lifecycle rule on the bucket's `files/` prefix does that
    (docs/operating.md, Retention)."""
    from redrive.retention import Entity, Rule

    job = Entity("evidence", "CAST(t.id AS text)", separator="/")
    unsettled = ("NOT EXISTS (SELECT 1 FROM evidence_outbox AS o WHERE o.file_job_id = t.id "
                 "AND o.status IN ('PENDING', 'PUBLISHED'))")
    return [
        Rule("evidence.notify_to", "file_job", ("id",), "retention_personal_data_days", "t.n2_sent_at",
             f"t.n2_sent_at IS NOT NULL AND t.notify_to <> '' AND {unsettled}", "a finished file job's merchant address",
             entity=job, scrub={"notify_to": "''"}),
        Rule("evidence.notification_payloads", "evidence_outbox", ("event_id",), "retention_personal_data_days",
             "t.consumed_at", "t.status = 'CONSUMED' AND t.event_type IN ('EVIDENCE_N1_REQUESTED', "
             "'EVIDENCE_N2_REQUESTED') AND (t.payload ->> 'to') <> 'redacted'",
             "the address in a sent N1/N2 (its text stays)",
             entity=Entity("evidence", "CAST(t.file_job_id AS text)", separator="/"),
             scrub={"payload": "jsonb_set(t.payload, '{to}', to_jsonb(CAST('redacted' AS text)))"}),
        Rule("evidence.file_jobs", "file_job", ("id",), "retention_idempotency_days", "t.n2_sent_at",
             f"t.n2_sent_at IS NOT NULL AND {unsettled}", "finished file jobs with their rows, artifacts, events",
             entity=job, children=(("file_job_artifact", "file_job_id"), ("file_job_row", "file_job_id"),
                                   ("evidence_outbox", "file_job_id"))),
    ]
