"""Alerts: written in the caller's transaction, delivered later through every configured channel.

An alert is a row first (so a notifier outage loses nothing), one per dedupe key
(so an entity's final failure alerts once however often it is reported), and its
deliveries are sent by `dispatch`: the first of a group at once, later ones of the
same pipeline and error class within the burst window folded into one message with
a count. Channels only carry text; formatting and grouping are decided here.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from redrive import counters
from redrive.sanitize import sanitize_text
from redrive.schema import alert_deliveries, alerts

log = logging.getLogger(__name__)

MAX_DELIVERY_ATTEMPTS = 50


@dataclass(frozen=True)
class Alert:
    pipeline: str
    kind: str
    dedupe_key: str
    summary: str
    entity_ref: str | None = None
    tenant: str | None = None
    error_class: str | None = None
    attempts: int | None = None
    link: str | None = None

    @property
    def group_key(self) -> str:
        return f"{self.pipeline}:{self.kind}:{self.error_class or '-'}"


class Channel(Protocol):
    """Where alert text goes: Slack, email, … Raises on failure; returns a provider message id or None."""

    name: str

    def send(self, subject: str, text: str, token: str) -> str | None: ...


def enqueue(conn: sa.Connection, alert: Alert, channels: Sequence[str], now: datetime) -> bool:
    """Insert the alert and one pending delivery per channel; False when its dedupe key was already used."""
    row = conn.execute(
        insert(alerts)
        .values(
            dedupe_key=alert.dedupe_key,
            group_key=alert.group_key,
            pipeline=alert.pipeline,
            kind=alert.kind,
            entity_ref=alert.entity_ref,
            tenant=alert.tenant,
            error_class=alert.error_class,
            summary=sanitize_text(alert.summary)[:1000],
            attempts=alert.attempts,
            link=alert.link,
            created_at=now,
        )
        .on_conflict_do_nothing(index_elements=["dedupe_key"])
        .returning(alerts.c.id)
    ).first()
    if row is None:
        return False
    for channel in channels:
        conn.execute(insert(alert_deliveries).values(alert_id=row.id, channel=channel, next_attempt_at=now))
    return True


def render(rows: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """Subject and text of one message for one or many alerts of a group (pure)."""
    first = rows[0]
    head = f"[redrive/{first['pipeline']}] {first['kind'].replace('_', ' ')}"
    if first.get("error_class"):
        head += f": {first['error_class']}"
    if len(rows) == 1:
        parts = [head, first["summary"]]
        details = []
        if first.get("entity_ref"):
            details.append(f"entity: {first['entity_ref']}")
        if first.get("tenant"):
            details.append(f"tenant: {first['tenant']}")
        if first.get("attempts") is not None:
            details.append(f"attempts: {first['attempts']}")
        if details:
            parts.append(" · ".join(details))
        if first.get("link"):
            parts.append(f"link: {first['link']}")
        return head, "\n".join(parts)
    entities = [r["entity_ref"] for r in rows if r.get("entity_ref")]
    shown = ", ".join(entities[:5]) + (f" and {len(entities) - 5} more" if len(entities) > 5 else "")
    subject = f"{head} ×{len(rows)}"
    text = "\n".join(
        [subject, f"{len(rows)} alerts of this kind in the burst window.", f"entities: {shown}", rows[-1]["summary"]]
        + ([f"latest: {rows[-1]['link']}"] if rows[-1].get("link") else [])
    )
    return subject, text


@dataclass(frozen=True)
class DispatchReport:
    sent_messages: int = 0
    sent_alerts: int = 0
    deferred: int = 0
    failed_attempts: int = 0


def delivery_token(channel: str, alert_uids: Sequence[str]) -> str:
    """The provider idempotency token of one message: from the alerts' UUIDs, never serial ids (pure).

    A recreated or restored database reuses ids 1, 2, …; a provider that saw `alerts:email:1-1` before
    would take a new alert for a resend and drop it (or refuse it forever with other text). One alert
    is named by its uid; a folded group by a UUID derived from its members, so a resend of the same
    group is the same token.
    """
    uids = sorted(str(u) for u in alert_uids)
    ident = uids[0] if len(uids) == 1 else str(uuid.uuid5(_GROUP_NAMESPACE, ",".join(uids)))
    return f"alerts:{channel}:{ident}"


_GROUP_NAMESPACE = uuid.UUID("5a1e7c2e-8f6d-4c1b-9a53-2d1f0c9b7e41")


def retry_delay(attempts: int) -> float:
    """Delivery retry backoff: 5 s doubling to 10 min; a Slack outage costs minutes of delay, not alerts."""
    return min(600.0, 5.0 * 2 ** max(0, attempts - 1))


def dispatch(
    engine: sa.Engine,
    channels: Mapping[str, Channel],
    *,
    now: datetime,
    burst_window: float,
    limit: int = 500,
) -> DispatchReport:
    """Send due deliveries, one message per (channel, group), holding bursts for the window."""
    report = DispatchReport()
    with engine.begin() as conn:
        due = conn.execute(
            sa.select(alert_deliveries.c.id.label("delivery_id"), alert_deliveries.c.channel,
                      alert_deliveries.c.attempts.label("delivery_attempts"), *alerts.c)
            .join(alerts, alerts.c.id == alert_deliveries.c.alert_id)
            .where(alert_deliveries.c.status == "pending", alert_deliveries.c.next_attempt_at <= now)
            .order_by(alert_deliveries.c.id)
            .limit(limit)
            .with_for_update(of=alert_deliveries, skip_locked=True)
        ).mappings().all()
        groups: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
        for row in due:
            groups[(row["channel"], row["group_key"])].append(row)
        sent_messages = sent_alerts = deferred = failed = 0
        for (channel_name, group_key), rows in groups.items():
            ids = [r["delivery_id"] for r in rows]
            channel = channels.get(channel_name)
            if channel is None:  # channel no longer configured: keep the rows, retry later
                conn.execute(sa.update(alert_deliveries).where(alert_deliveries.c.id.in_(ids))
                             .values(next_attempt_at=now + timedelta(seconds=60), last_error="channel not configured"))
                deferred += len(ids)
                continue
            last_sent = conn.execute(
                sa.select(sa.func.max(alert_deliveries.c.sent_at))
                .join(alerts, alerts.c.id == alert_deliveries.c.alert_id)
                .where(alert_deliveries.c.channel == channel_name, alerts.c.group_key == group_key,
                       alert_deliveries.c.status == "sent")
            ).scalar()
            if last_sent is not None and now < last_sent + timedelta(seconds=burst_window):
                conn.execute(sa.update(alert_deliveries).where(alert_deliveries.c.id.in_(ids))
                             .values(next_attempt_at=last_sent + timedelta(seconds=burst_window)))
                deferred += len(ids)
                continue
            subject, text = render(rows)
            token = delivery_token(channel_name, [r["uid"] for r in rows])
            try:
                message_id = channel.send(subject, text, token)
            except Exception as exc:  # noqa: BLE001 - any channel failure is retried, never lost
                attempts = max(r["delivery_attempts"] for r in rows) + 1
                status = "failed" if attempts >= MAX_DELIVERY_ATTEMPTS else "pending"
                error = sanitize_text(f"{type(exc).__name__}: {exc}")[:500]
                log.warning("alert delivery via %s failed (attempt %s): %s", channel_name, attempts, error)
                conn.execute(sa.update(alert_deliveries).where(alert_deliveries.c.id.in_(ids)).values(
                    attempts=attempts, status=status, last_error=error,
                    next_attempt_at=now + timedelta(seconds=retry_delay(attempts))))
                failed += 1
                continue
            conn.execute(sa.update(alert_deliveries).where(alert_deliveries.c.id.in_(ids)).values(
                status="sent", sent_at=now, attempts=alert_deliveries.c.attempts + 1, message_id=message_id))
            # one message, however many alerts it folds (a burst's "×3" is one), counted as it is marked sent
            counters.add(conn, counters.ALERTS_SENT, {"pipeline": rows[0]["pipeline"], "channel": channel_name})
            sent_messages += 1
            sent_alerts += len(ids)
        report = DispatchReport(sent_messages, sent_alerts, deferred, failed)
    return report


def pending_count(conn: sa.Connection) -> int:
    return conn.execute(
        sa.select(sa.func.count()).select_from(alert_deliveries).where(alert_deliveries.c.status == "pending")
    ).scalar_one()
