"""All SQL of a critique request: the request (the payload a dead letter refers to), its progress, its deliveries.

Stage outputs live in the core's `stage_checkpoints` (replay from the failed stage);
this module keeps what the criticizer alone knows: the request as submitted, how many
attempts each completed stage took, since when it has been failing, the final critique,
and which deliveries of which critique were made (so a retried notify posts only
what is missing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from cryptography.fernet import InvalidToken
from sqlalchemy.dialects.postgresql import JSONB, insert

from redrive import keys
from redrive.db import compiled_once
from redrive.schema import NOW, TZ, metadata

SUBMITTED, PROCESSING, DONE = "submitted", "processing", "done"
WEBHOOK, SLACK = "webhook", "slack"

criticizer_requests = sa.Table(
    "criticizer_requests",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    sa.Column("tenant", sa.Text),
    sa.Column("artifact_url", sa.Text, nullable=False),
    sa.Column("rubric", sa.Text, nullable=False),
    sa.Column("webhook_url", sa.Text, nullable=False),
    # credentials for the requester's webhook: sent with the delivery, copied nowhere else, and stored
    # encrypted (`seal_headers`; issue 13 item 14): a database dump or a SELECT shows no header value
    sa.Column("webhook_headers", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("fingerprint", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False, server_default=SUBMITTED),
    sa.Column("stage_attempts", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("failing_since", TZ),
    sa.Column("last_failure_at", TZ),
    sa.Column("critique", JSONB),
    sa.Column("critique_sha256", sa.Text),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("started_at", TZ),
    sa.Column("completed_at", TZ),
    sa.CheckConstraint("status IN ('submitted', 'processing', 'done')", name="status"),
    # the new-requests sensor reads only these
    sa.Index("ix_criticizer_requests_submitted", "created_at", postgresql_where=sa.text("status = 'submitted'")),
    # the pruner's ranges (redrive.retention): done requests, before and after their personal fields went
    sa.Index("ix_criticizer_requests_done_personal", "completed_at",
             postgresql_where=sa.text("status = 'done' AND artifact_url <> ''")),
    sa.Index("ix_criticizer_requests_done", "completed_at", postgresql_where=sa.text("status = 'done'")),
)

criticizer_deliveries = sa.Table(
    "criticizer_deliveries",
    metadata,
    sa.Column("request_id", sa.Text, sa.ForeignKey("criticizer_requests.request_id", ondelete="CASCADE"),
              primary_key=True),
    sa.Column("target", sa.Text, primary_key=True),
    sa.Column("idempotency_key", sa.Text, primary_key=True),
    sa.Column("upstream_status", sa.Integer),
    sa.Column("delivered_at", TZ, nullable=False),
    sa.CheckConstraint("target IN ('webhook', 'slack')", name="target"),
)


SEALED = "fernet:"
"""Prefix of an encrypted header value; a value without it was stored before encryption (read as is)."""


def seal_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Header values encrypted with the install's secrets key (REDRIVE_SECRETS_KEY), names kept readable."""
    if not headers:
        return {}
    cipher = keys.secrets_cipher()
    return {name: SEALED + cipher.encrypt(value.encode()).decode() for name, value in headers.items()}


def open_headers(stored: Mapping[str, str]) -> dict[str, str]:
    """The header values to send, decrypted when the run needs them (a wrong key raises InvalidToken)."""
    if not any(v.startswith(SEALED) for v in stored.values()):
        return dict(stored)
    cipher = keys.secrets_cipher()
    try:
        return {name: cipher.decrypt(value[len(SEALED):].encode()).decode() if value.startswith(SEALED) else value
                for name, value in stored.items()}
    except InvalidToken as exc:  # a deploy without the key the headers were sealed with: a config bug (002 §8.1)
        raise RuntimeError("webhook headers cannot be decrypted: REDRIVE_SECRETS_KEY is not the key they "
                           "were stored with") from exc


class RequestIdConflict(Exception):
    """A request id submitted again with different content: refused, the first request is kept."""


class UnknownRequest(LookupError):
    """No critique request has this id."""


@dataclass(frozen=True)
class CritiqueRequestRow:
    request_id: str
    tenant: str | None
    artifact_url: str
    rubric: str
    webhook_url: str
    webhook_headers: Mapping[str, str]
    fingerprint: str
    status: str
    stage_attempts: Mapping[str, int] = field(default_factory=dict)
    failing_since: datetime | None = None
    last_failure_at: datetime | None = None
    critique: Mapping[str, Any] | None = None
    critique_sha256: str | None = None
    created_at: datetime | None = None
    completed_at: datetime | None = None

    @classmethod
    def from_row(cls, row: sa.Row[Any]) -> CritiqueRequestRow:
        m = row._mapping
        return cls(**{f: m[f] for f in cls.__dataclass_fields__})

    def delivery_headers(self) -> dict[str, str]:
        """The webhook headers in clear, for the delivery only."""
        return open_headers(self.webhook_headers)

    def __repr__(self) -> str:  # never print the rubric or header values by accident
        return f"CritiqueRequestRow({self.request_id!r}, status={self.status!r})"


def create(conn: sa.Connection, *, request_id: str, tenant: str | None, artifact_url: str, rubric: str,
           webhook_url: str, webhook_headers: Mapping[str, str], fingerprint: str) -> bool:
    """Insert once; the same id with the same content again is a no-op (False), with other content an error."""
    row = conn.execute(
        insert(criticizer_requests)
        .values(request_id=request_id, tenant=tenant, artifact_url=artifact_url, rubric=rubric,
                webhook_url=webhook_url, webhook_headers=seal_headers(webhook_headers), fingerprint=fingerprint)
        .on_conflict_do_nothing(index_elements=["request_id"])
        .returning(criticizer_requests.c.request_id)
    ).first()
    if row is not None:
        return True
    existing = conn.execute(
        sa.select(criticizer_requests.c.fingerprint).where(criticizer_requests.c.request_id == request_id)
    ).scalar_one()
    if existing != fingerprint:
        raise RequestIdConflict(f"request id {request_id!r} is already used by a different request; choose another id")
    return False


def get(conn: sa.Connection, request_id: str) -> CritiqueRequestRow:
    row = conn.execute(sa.select(criticizer_requests).where(criticizer_requests.c.request_id == request_id)).first()
    if row is None:
        raise UnknownRequest(f"no critique request {request_id!r}")
    return CritiqueRequestRow.from_row(row)


def list_(conn: sa.Connection, *, status: str | None = None, limit: int = 100) -> list[CritiqueRequestRow]:
    q = sa.select(criticizer_requests).order_by(criticizer_requests.c.created_at.desc()).limit(limit)
    if status:
        q = q.where(criticizer_requests.c.status == status)
    return [CritiqueRequestRow.from_row(r) for r in conn.execute(q)]


def start(conn: sa.Connection, request_id: str, at: datetime) -> CritiqueRequestRow:
    """A run picked the request up: `submitted` → `processing` (a done request stays done)."""
    conn.execute(
        sa.update(criticizer_requests)
        .where(criticizer_requests.c.request_id == request_id, criticizer_requests.c.status == SUBMITTED)
        .values(status=PROCESSING, started_at=at)
    )
    return get(conn, request_id)


def record_stage_attempts(conn: sa.Connection, request_id: str, attempts: Mapping[str, int]) -> None:
    """How many attempts each stage has taken so far (the status command and a later dead letter show it)."""
    conn.execute(
        sa.update(criticizer_requests)
        .where(criticizer_requests.c.request_id == request_id)
        .values(stage_attempts=dict(attempts))
    )


def note_failure(conn: sa.Connection, request_id: str, at: datetime) -> datetime:
    """An attempt failed: keep when the current failure episode began (§8.4 first failure) and the latest."""
    return conn.execute(
        sa.update(criticizer_requests)
        .where(criticizer_requests.c.request_id == request_id)
        .values(failing_since=sa.func.coalesce(criticizer_requests.c.failing_since, at), last_failure_at=at)
        .returning(criticizer_requests.c.failing_since)
    ).scalar_one()


def delivered(conn: sa.Connection, request_id: str, key: str) -> set[str]:
    """Targets that already received the critique with this idempotency key."""
    return set(conn.execute(
        sa.select(criticizer_deliveries.c.target).where(
            criticizer_deliveries.c.request_id == request_id, criticizer_deliveries.c.idempotency_key == key)
    ).scalars())


def record_delivery(conn: sa.Connection, request_id: str, target: str, key: str, upstream_status: int | None,
                    at: datetime) -> None:
    conn.execute(_RECORD_DELIVERY, {"request_id": request_id, "target": target, "idempotency_key": key,
                                    "upstream_status": upstream_status, "delivered_at": at})


_RECORD_DELIVERY = compiled_once(insert(criticizer_deliveries).on_conflict_do_nothing(),
                                 "request_id", "target", "idempotency_key", "upstream_status", "delivered_at")


def deliveries(conn: sa.Connection, request_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        sa.select(criticizer_deliveries).where(criticizer_deliveries.c.request_id == request_id)
        .order_by(criticizer_deliveries.c.delivered_at)
    )
    return [dict(r._mapping) for r in rows]


def complete(conn: sa.Connection, request_id: str, critique: Mapping[str, Any], critique_sha256: str,
             at: datetime) -> None:
    """The critique was delivered: the request is done and no longer failing."""
    conn.execute(
        sa.update(criticizer_requests)
        .where(criticizer_requests.c.request_id == request_id)
        .values(status=DONE, critique=dict(critique), critique_sha256=critique_sha256, completed_at=at,
                failing_since=None)
    )


def counts(conn: sa.Connection, request_ids: Sequence[str]) -> dict[str, int]:
    rows = conn.execute(
        sa.select(criticizer_requests.c.status, sa.func.count())
        .where(criticizer_requests.c.request_id.in_(list(request_ids)))
        .group_by(criticizer_requests.c.status)
    )
    return {status: n for status, n in rows}


def retention_rules(settings: Any) -> list[Any]:
    """A done request's personal fields (artifact URL, rubric, webhook URL and headers, critique) are cleared
    after the personal-data window; the rest (its id and fingerprint: 002's idempotency on resubmission,
    and its delivery keys) is kept for the idempotency window, then deleted with its deliveries."""
    from redrive.retention import Entity, Rule

    request = Entity("criticizer", "t.request_id")
    return [
        Rule("criticizer.personal", "criticizer_requests", ("request_id",), "retention_personal_data_days",
             "t.completed_at", "t.status = 'done' AND t.artifact_url <> ''",
             "a done request's artifact URL, rubric, webhook URL and headers, critique", entity=request,
             scrub={"artifact_url": "''", "rubric": "''", "webhook_url": "''",
                    "webhook_headers": "CAST('{}' AS jsonb)", "critique": "NULL"}),
        Rule("criticizer.requests", "criticizer_requests", ("request_id",), "retention_idempotency_days",
             "t.completed_at", "t.status = 'done'", "done requests (their id and fingerprint) and deliveries",
             entity=request),
    ]
