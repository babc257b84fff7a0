"""Send-and-mark for one job's outbox, retry-safe (002 review notifications §6.4, §8.2, §8.3, §10.3).

For one job, under a per-job lock:
1. **Reconcile first** (§8.3): every row marked sent is checked against the provider (by its
   notification_id, then by its deterministic token). No evidence → the ordering contract was
   broken: alert once per episode, clear `notified_at`/`notification_id`, requeue. Only then
   does anything get sent.
2. **Send-and-mark** each unsent row, in the spec's exact order: re-read the row; a row that may
   have been sent (`sending`, or a `notification_id` without `notified_at`) is looked up first and
   backfilled if the provider has it; otherwise record `sending`, call the provider with the
   deterministic payload and token, then write `notification_id`, `notified_at` and `sent` in one
   statement. Each row's attempt runs under the core's in-process retry loop; every retry starts
   again at the re-read, so a lost response or a failed mark write ends in a lookup, not a resend.
3. Failures are classified by the core and named by `policy.NOTIFICATION`: an invalid recipient
   or policy rejection fails that row (its own dead letter + alert through the core, in one
   transaction); a transient failure that outlasts the in-process attempts (`row_attempts`; the
   drain uses 1) stops the pass and is raised, so the job's work row falls due later under the
   send stage's policy; any other permanent failure is raised for the job.

No Dagster here: the drain handler (`pipeline.ReviewJobHandler`), the tests, the crash workers
and the benchmark all call `Deliverer`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import sqlalchemy as sa

from assets.review_notifications import policy, repository
from assets.review_notifications.repository import Delivery, Job
from redrive import work
from redrive.alerts import Alert
from redrive.clock import Sleep
from redrive.failures import Failure, RedriveError, classify_exception, raise_failure
from redrive.reliability import Reliability
from redrive.retrying import call_with_retries
from redrive.sanitize import digest, sanitize_exception
from redrive.settle import Budget, Verdict, settle
from resources.review_notifications import MailProvider, OutgoingMail, ProviderMessage

log = logging.getLogger(__name__)


class Hooks(Protocol):
    """Test seam: called between the provider's acceptance and our mark write (the crash window of §8.2)."""

    def after_provider_accept(self, delivery_id: int, message_id: str) -> None: ...


class NoHooks:
    def after_provider_accept(self, delivery_id: int, message_id: str) -> None:
        return None


@dataclass
class DeliveryReport:
    job_key: str
    busy: bool = False
    sent: int = 0
    backfilled: int = 0  # §8.2 row 1: the provider had it; recorded without resending
    skipped: int = 0
    failed: int = 0  # permanent, per recipient: dead-lettered
    waiting: int = 0  # transient: left for the job's next attempt (its work row falls due later)
    verified: int = 0
    reconciled: int = 0  # §8.2 row 2: marked sent without evidence, cleared and requeued
    retries: int = 0  # in-process retries across rows
    lookups: int = 0
    transient: Failure | None = None
    dead_letters: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("transient", "dead_letters")}
        out["dead_letters"] = list(self.dead_letters)
        out["transient"] = self.transient.code if self.transient else None
        return out


def classify(exc: BaseException) -> Failure:
    """The core's classifier, then this pipeline's names and retryability."""
    return policy.NOTIFICATION.apply(classify_exception(exc))


@dataclass
class Deliverer:
    engine: sa.Engine
    mail: MailProvider
    runtime: Reliability
    sleep: Sleep = time.sleep
    hooks: Hooks = field(default_factory=NoHooks)
    row_attempts: int = policy.ROW_MAX_ATTEMPTS
    run_id: str | None = None
    on_retry: Callable[[str], None] | None = None
    # The delivery row whose dead letter is being replayed (the drain's entity): its permanent failure
    # is raised, so the core's settlement records the failed replay, instead of `_fail_row`.
    replayed_row: int | None = None

    # ------------------------------------------------------------------------------------ the pass

    def deliver(self, job: Job) -> DeliveryReport:
        """Reconcile, then send every unsent row of the job; see the module docstring."""
        report = DeliveryReport(job.key)
        with repository.job_lock(self.engine, job.id) as acquired:
            if not acquired:
                report.busy = True  # another run is delivering this job; it will finalize it
                return report
            self.reconcile(job, report)
            with self.engine.connect() as conn:
                rows = repository.unsent(conn, job.id)
            for index, row in enumerate(rows):
                if not self._send_row(job, row, report):
                    report.waiting = len(rows) - index  # this row and the ones after it
                    break
        return report

    # ------------------------------------------------------------------------- §8.3 reconciliation

    def reconcile(self, job: Job, report: DeliveryReport) -> None:
        """Every row marked sent gets provider evidence, or a reconciliation episode, before any send."""
        with self.engine.connect() as conn:
            rows = repository.marked_sent(conn, job.id)
        for row in rows:
            found = self._retrying(f"{job.key}:d{row.id}:verify", lambda r=row: self._evidence(r, report), report)
            verdict = policy.judge_sent_row(row.notification_id, found.message_id if found else None)
            if verdict is policy.Evidence.VERIFIED:
                report.verified += 1
            elif verdict is policy.Evidence.REPAIR_ID and found is not None:
                with self.engine.begin() as conn:
                    repository.repair_notification_id(conn, row.id, found.message_id)
                report.verified += 1
            else:
                self._ordering_violation(job, row)
                report.reconciled += 1

    def _ordering_violation(self, job: Job, row: Delivery) -> None:
        """§8.2 row 2: alert (once per row and episode), then clear the markers and requeue.

        Alert first: if we die between the two, the next pass finds the same row in the same
        episode, and the alert's dedupe key makes the second alert a no-op.
        """
        episode = row.reconciliations + 1
        ref = policy.delivery_ref(job.key, row.id)
        self.runtime.alert(Alert(
            pipeline=policy.PIPELINE,
            kind="ordering_violation",
            dedupe_key=f"{policy.PIPELINE}:ordering_violation:{row.id}:{episode}",
            summary=(f"delivery {ref} was marked sent but the mail provider has no such message: the "
                     f"send-then-mark contract was broken. Markers cleared and the row requeued "
                     f"(reconciliation episode {episode}); it is sent once on this pass."),
            entity_ref=ref,
            error_class=policy.ORDERING_VIOLATION,
            link=self.runtime.run_link(self.run_id),
        ))
        with self.engine.begin() as conn:
            repository.clear_markers(conn, row.id, episode=episode,
                                     note=f"{policy.ORDERING_VIOLATION}: reconciled in episode {episode}")
        log.info("%s: marked sent without provider evidence; requeued (episode %s)", ref, episode)

    # -------------------------------------------------------------------------- §6.4 send-and-mark

    def _send_row(self, job: Job, row: Delivery, report: DeliveryReport) -> bool:
        """One row to `sent`, `failed`, or left waiting; False stops the pass (provider trouble)."""
        try:
            outcome = self._retrying(f"{job.key}:d{row.id}:send", lambda: self._attempt(job, row.id, report), report)
        except RedriveError as err:
            failure = err.failure
            where = policy.scope(failure)
            with self.engine.begin() as conn:
                repository.record_error(conn, row.id, f"{failure.code}: {failure.message}")
            if where == policy.RECIPIENT and row.id != self.replayed_row:
                report.dead_letters.append(self._fail_row(job, row.id, err))
                report.failed += 1
                return True
            if where == policy.TRANSIENT:
                report.transient = failure
                return False
            raise  # the job's problem (credentials, a bug): the job-level stage decides
        setattr(report, outcome, getattr(report, outcome) + 1)
        return True

    def _attempt(self, job: Job, delivery_id: int, report: DeliveryReport) -> str:
        """One attempt, always from a fresh read of the row (§6.4 "retries MUST re-read the outbox row first")."""
        with self.engine.begin() as conn:
            row = repository.claim_for_send(conn, delivery_id)  # the row as it was, now marked `sending`
        if row is None:
            return "skipped"  # notified, failed or waived meanwhile
        if policy.next_action(row.state) is policy.Action.LOOKUP_FIRST:
            found = self._evidence(row, report)
            if found is not None:
                with self.engine.begin() as conn:
                    repository.mark_sent(conn, row.id, found.message_id, self.runtime.now())
                return "backfilled"
        subject, text = policy.render(job.changelist_id, job.review_version, job.summary)
        message_id = self.mail.send(OutgoingMail(to=row.recipient, subject=subject, text=text,
                                                 idempotency_token=row.provider_token))
        self.hooks.after_provider_accept(row.id, message_id)
        with self.engine.begin() as conn:
            repository.mark_sent(conn, row.id, message_id, self.runtime.now())
        return "sent"

    def _evidence(self, row: Delivery, report: DeliveryReport) -> ProviderMessage | None:
        """The provider's record of the row's message: by notification_id first, then by token."""
        if row.notification_id:
            report.lookups += 1
            found = self.mail.find_by_id(row.notification_id)
            if found is not None and found.idempotency_token in (None, row.provider_token):
                return found
        report.lookups += 1
        return self.mail.find_by_token(row.provider_token)

    # ----------------------------------------------------------------------------------- failures

    def _retrying(self, key: str, fn: Callable[[], Any], report: DeliveryReport) -> Any:
        def counted(failure: Failure, attempt: int, delay: float) -> None:
            report.retries += 1
            log.info("%s: attempt %s failed (%s); retrying in %.3fs", key, attempt, failure.code,
                     delay * self.runtime.time_scale)
            if self.on_retry:
                self.on_retry(f"{key}: {failure.code}")

        return call_with_retries(
            fn, classify=classify, policy=policy.ROW_BACKOFF, max_attempts=self.row_attempts,
            sleep=lambda seconds: self.sleep(seconds * self.runtime.time_scale),
            rng=self.runtime.rng_for(key), on_retry=counted,
        )

    def _fail_row(self, job: Job, delivery_id: int, err: RedriveError) -> int:
        """§8.1: this recipient's row fails for an operator: its dead letter, alert and `failed` state at once.

        One recipient of a job that has several, so not the drain's entity: the core settles it as failed
        for good (its in-process attempts are spent) and the row gets a dead work item of its own
        (`work.record_dead`), so `redrive dlq replay` makes that recipient due like any drained entity.
        One transaction: a crash leaves a retryable row without a letter, or both, never one of them.
        """
        with self.engine.connect() as conn:
            row = repository.get_delivery(conn, delivery_id)
        ref, attempts = policy.delivery_ref(job.key, row.id), max(1, row.attempts)

        def fail(conn: sa.Connection, verdict: Verdict) -> bool:
            repository.fail_delivery(conn, row.id, verdict.error)
            work.record_dead(conn, policy.PIPELINE, ref, stage="send", attempts={"send": attempts},
                             error=verdict.error, now=verdict.now)
            return True

        settled = settle(
            self.runtime, pipeline=policy.PIPELINE, stage="send", entity_ref=ref, failure=err.failure,
            attempt=attempts, budget=Budget(self.row_attempts, policy.ROW_BACKOFF), on_retry=None, on_final=fail,
            final=lambda verdict: verdict.final_failure(
                stack=sanitize_exception(err), stage_attempts={"send": attempts}, run_id=self.run_id,
                context={"job": job.key, "changelist_id": job.changelist_id, "review_version": job.review_version,
                         "delivery_id": row.id, "recipient_sha256": digest(row.recipient),
                         "dagster_run_id": self.run_id},
                payload_ref={"table": "review_deliveries", "id": row.id, "job": job.key}),
        )
        log.info("%s: %s; dead letter %s", ref, err.failure.code, settled.dead_letter_id)
        return settled.dead_letter_id  # type: ignore[return-value]


def raise_for_job(report: DeliveryReport) -> None:
    """A pass that left rows waiting on a transient failure is a retryable failure of the job's send stage."""
    if report.transient is not None:
        raise_failure(report.transient)
