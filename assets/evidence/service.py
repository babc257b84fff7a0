"""The evidence pipeline's transactional steps: N1/N2 gates, the scheduler's tick (the N2 deadline),
and the monitor. Each step is one or a few transactions over `repository`,
deciding with `policy`; none calls an external service (those are in `worker`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from uuid import UUID

import sqlalchemy as sa

from assets.evidence import contracts, policy
from assets.evidence import repository as repo
from redrive import work
from redrive.alerts import Alert
from redrive.reliability import Reliability

# One name for all of evidence's work (issue 27): a row's attach (entity `{job}/{row}`, drained) and a file job's
# ingest and notifications (entity `{job}`, replayed as a run of its partition) are both pipeline `evidence`.
PIPELINE = repo.PIPELINE


# --------------------------------------------------------------------------------- N1 / N2 (§5)


@dataclass(frozen=True)
class ForcedClose:
    """What a forced N2 closed: the rows touched and how many artifacts became PERMANENT_FAILED."""

    rows: Sequence[UUID] = ()
    artifacts: int = 0


def request_notifications(conn: sa.Connection, job_id: UUID, now: datetime, *,
                          forced: ForcedClose | None = None) -> list[str]:
    """Evaluate N1/N2's gates under the file job's lock and write their outbox events once.

    Called in the transaction of every state change that can open a gate (ingest, each row's
    outcome, the N2 deadline). The lock serialises concurrent workers, and each reads the counts in a
    fresh snapshot after taking it, so the last one to finish always sees the gate open. The event
    ids are derived from the file job, so a gate can never produce a second N1 or N2.
    """
    job = repo.get_file_job(conn, job_id, lock=True)
    if job is None or job.n2_requested_at is not None:
        return []
    facts = repo.job_facts(conn, job, details=False)
    want_n1 = policy.n1_due(facts)
    n1_requested = facts.n1_requested or want_n1
    want_n2 = forced is not None or policy.n2_due(facts, n1_requested=n1_requested)
    if not (want_n1 or want_n2):
        return []
    facts = repo.job_facts(conn, job, details=True)
    kinds = []
    if want_n1:
        subject, text = policy.render_n1(facts)
        _notify_event(conn, job, "N1", subject, text, facts, now)
        kinds.append("N1")
    if want_n2:
        subject, text = policy.render_n2(facts, forced=forced is not None,
                                         forced_closed=forced.artifacts if forced else 0)
        _notify_event(conn, job, "N2", subject, text, facts, now, forced=forced)
        kinds.append("N2")
    return kinds


def _notify_event(conn: sa.Connection, job: repo.FileJob, kind: str, subject: str, text: str,
                  facts: policy.JobFacts, now: datetime, forced: ForcedClose | None = None) -> None:
    event = contracts.EvidenceNotificationRequested(
        event_id=policy.notification_event_id(job.id, kind),
        event_type=contracts.N1_REQUESTED if kind == "N1" else contracts.N2_REQUESTED,
        occurred_at=now, file_job_id=job.id, kind=kind, to=job.notify_to, subject=subject, text=text,
        idempotency_token=policy.notification_token(job.id, kind), forced=forced is not None,
        closed_rows=list(forced.rows) if forced else [],
        summary=contracts.NotificationSummary.model_validate(policy.summary_of(facts)),
    )
    repo.add_event(conn, event, row=None, case=None, now=now)
    repo.mark_notification_requested(conn, job.id, kind, now, forced=forced is not None)


# ------------------------------------------------------------------------------- scheduler (§3)


@dataclass(frozen=True)
class TickReport:
    due_rows: int = 0
    forced_n2: list[UUID] = field(default_factory=list)
    duration_ms: float = 0.0

    def describe(self) -> str:
        text = (f"{self.due_rows} rows due for their drain runs (the work queue is the retry schedule); "
                f"tick took {self.duration_ms:.0f} ms")
        if self.forced_n2:
            text += f"; forced N2 for {len(self.forced_n2)} file jobs past the deadline"
        return text


def scheduler_tick(engine: sa.Engine, *, now: datetime, n2_timeout: timedelta, n2_marks_permanent: bool,
                   monotonic: Callable[[], float]) -> TickReport:
    """What is left of the 004 §3 scheduler once retries are due times on work rows: force N2 at the
    deadline, and record the tick (the heartbeat §6 watches) with the rows due now."""
    started = monotonic()
    forced = force_overdue_n2(engine, now=now, timeout=n2_timeout, mark_permanent=n2_marks_permanent)
    with engine.connect() as conn:
        due = work.backlog(conn, PIPELINE, now).due
    report = TickReport(due, forced, (monotonic() - started) * 1000)
    with engine.begin() as conn:
        repo.record_tick(conn, started_at=now, duration_ms=report.duration_ms, rows=due, artifacts=0,
                         n2_forced=len(forced), batch_limit=0)
    return report


def force_overdue_n2(engine: sa.Engine, *, now: datetime, timeout: timedelta, mark_permanent: bool,
                     limit: int = 20) -> list[UUID]:
    """004 §5 timeout safeguard: N2 `timeout` after N1, closing what is still retryable first.

    Rows are locked without waiting (SKIP LOCKED); a file job one of whose rows a worker holds is
    left for the next tick, so a forced close never races an attempt in flight. The rows it touched
    fall due now, so a drain run of the file job settles them (dead letters through the core) and
    sends N2.
    """
    forced: list[UUID] = []
    with engine.begin() as conn:
        for job in repo.overdue_n2_jobs(conn, cutoff=now - timeout, limit=limit):
            if _force_n2(conn, job.id, now, mark_permanent):
                forced.append(job.id)
    return forced


class N2NotForced(Exception):
    """An operator's forced N2 that cannot happen now; the message says why, in one line."""


def force_n2_now(engine: sa.Engine, job_id: UUID, *, now: datetime, mark_permanent: bool) -> repo.FileJob:
    """The deadline's forced N2 for one file job, before the deadline (an operator's decision).

    Same steps as the deadline: what is still retryable closes, the touched rows fall due, and the
    next drain run of the file job dead-letters the closed rows and sends N2.
    """
    with engine.begin() as conn:
        job = repo.get_file_job(conn, job_id, lock=True)
        if job is None:
            raise N2NotForced(f"file job {job_id} does not exist")
        if job.n2_requested_at is not None:
            raise N2NotForced(f"file job {job_id} already has its N2 (requested {job.n2_requested_at:%Y-%m-%d %H:%M})")
        if job.n1_sent_at is None:
            raise N2NotForced(f"file job {job_id} has not sent N1 yet; N2 follows N1")
        if not _force_n2(conn, job_id, now, mark_permanent):
            raise N2NotForced(f"a worker holds a row of file job {job_id}; try again in a moment")
        found = repo.get_file_job(conn, job_id)
        assert found is not None
        return found


def _force_n2(conn: sa.Connection, job_id: UUID, now: datetime, mark_permanent: bool) -> bool:
    """Close the file job's open artifacts and request N2, in a savepoint; False if a worker holds a row."""
    with conn.begin_nested():
        if repo.lock_all_rows(conn, job_id) is None:
            return False
        still_open = repo.open_rows(conn, job_id)
        closed = repo.close_open_artifacts(conn, job_id, now) if mark_permanent else []
        rows = sorted(set(closed), key=str)
        for row in rows:
            repo.refresh_row(conn, job_id, row, now)
        requested = bool(request_notifications(conn, job_id, now, forced=ForcedClose(rows, len(closed))))
        work.poke(conn, PIPELINE, [policy.row_entity(job_id, r) for r in still_open], now=now)
    return requested


# ---------------------------------------------------------------------------------- monitor (§6)


@dataclass(frozen=True)
class MonitorReport:
    metrics: dict[str, Any]
    alerts: list[Alert]
    sent: int


def monitor(runtime: Reliability, *, thresholds: policy.Thresholds, window: timedelta) -> MonitorReport:
    """Snapshot §6's metrics into `evidence_metrics` and raise §6's alerts through the core."""
    now = runtime.now()
    alerts: list[Alert] = []
    with runtime.engine.begin() as conn:
        metrics = repo.metrics_snapshot(conn, now=now, window=window)
        repo.save_metrics(conn, now, metrics)
        view = policy.MetricsView(
            finished=metrics["evidence.attach.finished"],
            permanent_failed=metrics["evidence.permanent_failures.count"],
            queue_depth_artifacts=metrics["evidence.retry.queue.depth.artifacts"],
            n2_latency_avg_seconds=metrics["evidence.n2.latency.seconds.avg"],
            heartbeat_age_seconds=metrics["scheduler.heartbeat.age.seconds"],
            active_file_jobs=metrics["evidence.file_jobs.active"],
            permanent_by_code=metrics["evidence.permanent_failures.by_error_code"],
        )
        states = repo.alert_states(conn, lock=True)
        for check in policy.alert_checks(view, thresholds):
            step = policy.step_alert(states.get(check.name), check, now)
            repo.save_alert_state(conn, step.state, now)
            if step.fire:
                alerts.append(Alert(pipeline=PIPELINE, kind=check.name, summary=check.summary,
                                    dedupe_key=f"{PIPELINE}:{check.name}:episode-{step.state.episode}"))
        for job in repo.forced_n2_jobs(conn, since=now - timedelta(days=1)):
            alerts.append(Alert(pipeline=PIPELINE, kind="n2_forced", entity_ref=str(job.id),
                                dedupe_key=f"{PIPELINE}:n2_forced:{job.id}",
                                summary=f"N2 for file job {job.id} ({job.source_name}) was forced at the "
                                        "deadline: some evidence was still being retried"))
        for event in repo.failed_events(conn, since=now - timedelta(days=1)):
            alerts.append(Alert(pipeline=PIPELINE, kind="outbox_event_failed", entity_ref=str(event.event_id),
                                dedupe_key=f"{PIPELINE}:outbox_failed:{event.event_id}",
                                summary=f"outbox event {event.event_type} {event.event_id} of file job "
                                        f"{event.file_job_id} was published {event.attempts} times and never "
                                        "consumed; its runs failed (see run failures)"))
    sent = sum(1 for a in alerts if runtime.alert(a))
    return MonitorReport(metrics, alerts, sent)
