"""Review notifications as drain runs: one work row per review job, many jobs per run (002 §6).

Creating a job enqueues its work row (`CL-4711:v3`) in the creation transaction (`api.submit`);
the due-work sensor starts a drain run when rows are due, and the run works each job as one
attempt of its `send` stage (`ReviewJobHandler`):

    pick the job (a succeeded or superseded job is left alone: §6.2's no-op)
    → reconcile and send-and-mark its outbox (`delivery.Deliverer`, §6.4, §8.2, §8.3)
    → finalize (§6.5), in the transaction that marks the work row done.

The core's drain settles every job: a transient provider failure makes the job's row fall due
again after the send stage's backoff (002 §8.2 full jitter, Retry-After honoured), never a
RetryRequested or a durable timer; a permanent failure of the whole job (bad credentials, a
non-deterministic payload) or a spent budget is the job's dead letter + alert, with the job
`retryable_failed`, in one transaction. A recipient refused for good (invalid address, policy)
gets its own dead letter and a dead work row (`CL-4711:v3:d17`); replaying that letter makes the
recipient's row due, and the drain sends that recipient and finalizes the job.

Safe to rerun: a row with `notified_at` is never sent again, a row that may have been sent is
looked up at the provider before any resend, and the provider's idempotency token is derived
from the outbox key, so a retry, a replay, a crashed run or two drains send nothing twice.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import sqlalchemy as sa

from assets.review_notifications import api, delivery, policy, repository
from assets.review_notifications.delivery import Hooks, NoHooks
from assets.review_notifications.settings import ReviewNotificationSettings
from redrive.drain import Attempt
from redrive.drain_ops import DRAIN_RETRY_POLICY, DrainConfig, drain_job, run_drain
from redrive.failures import Code, Failure, raise_failure
from redrive.reliability import Reliability
from redrive.sanitize import sanitize_text
from redrive.stages import StagePolicy, sanitized_body
from resources.reliability import ReliabilityResource
from resources.review_notifications import MailProvider, MailProviderResource

PIPELINE = policy.PIPELINE
JOB_NAME = "review_notifications_job"
SEND = "send"
TOTALS = ("jobs_succeeded", "jobs_waiting", "jobs_skipped", "sent", "backfilled", "verified", "reconciled",
          "recipients_failed", "lookups")


def stage_policies(job_attempts: int = policy.JOB_MAX_ATTEMPTS) -> dict[str, StagePolicy]:
    """One stage per job attempt, `send`; its outbox rows are its checkpoint, so it is never skipped."""
    return {SEND: StagePolicy(max_attempts=job_attempts, backoff=policy.JOB_BACKOFF, vocabulary=policy.NOTIFICATION)}


@dataclass
class ReviewJobHandler:
    """The drain's handler: what one job's run did before, for one work row.

    The row is a job (`CL-4711:v3`) or one of its recipients whose dead letter an operator
    replays (`CL-4711:v3:d17`): that recipient's failed row goes back to pending, and the
    job's pass sends it. Thread-safe: the drain calls it from several threads at once, and
    one job is delivered by one pass at a time (the per-job lock in `Deliverer`).
    """

    runtime: Reliability
    mail: MailProvider
    row_attempts: int = 1
    hooks: Hooks = field(default_factory=NoHooks)
    run_id: str | None = None
    totals: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __call__(self, attempt: Attempt) -> None:
        key, delivery_id = policy.job_key_of(attempt.entity_ref), policy.delivery_id_of(attempt.entity_ref)
        with self.runtime.engine.begin() as conn:
            job = repository.job_by_key(conn, key)
            attempt.payload_ref = ({"table": "review_jobs", "id": job.id} if delivery_id is None else
                                   {"table": "review_deliveries", "id": delivery_id, "job": key})
            attempt.context = {"job": key, "changelist_id": job.changelist_id, "review_version": job.review_version}
            if job.status not in policy.UNFINISHED:
                self._count(jobs_skipped=1)
                return  # §6.2: succeeded or superseded; nothing to send
            if delivery_id is not None:
                repository.requeue_failed(conn, delivery_id)  # the replayed recipient is pending again
            repository.set_job_status(conn, job.id, policy.IN_PROGRESS)
        busy: list[bool] = []

        def failed(conn: sa.Connection, failure: Failure, final: bool) -> None:
            if not busy:  # the pass holding the job writes its state
                self._failed(conn, job.id, delivery_id, failure, final)

        attempt.on_failure.append(failed)
        attempt.stage(SEND, lambda: self._pass(job, delivery_id, busy), checkpoint=False)
        attempt.on_success.append(lambda conn: self._finalize(conn, job.id))

    def _pass(self, job: repository.Job, delivery_id: int | None, busy: list[bool]) -> dict[str, Any]:
        deliverer = delivery.Deliverer(self.runtime.engine, self.mail, self.runtime, hooks=self.hooks,
                                       row_attempts=self.row_attempts, run_id=self.run_id, replayed_row=delivery_id)
        report = deliverer.deliver(job)
        self._count(sent=report.sent, backfilled=report.backfilled, verified=report.verified,
                    reconciled=report.reconciled, recipients_failed=report.failed, lookups=report.lookups)
        if report.busy:  # another pass holds the job (a replay and a retry due at once): try again shortly
            busy.append(True)
            raise_failure(Failure.of(Code.DB_TRANSIENT, detail=f"{job.key}: another pass is delivering this job"))
        delivery.raise_for_job(report)
        return report.as_dict()

    def _finalize(self, conn: sa.Connection, job_id: int) -> None:
        """§6.5, in the transaction that marks the work row done."""
        job = api.finalize(conn, job_id, self.runtime.now())
        self._count(**{"jobs_succeeded" if job.status == policy.SUCCEEDED else "jobs_waiting": 1})

    def _failed(self, conn: sa.Connection, job_id: int, delivery_id: int | None, failure: Failure,
                final: bool) -> None:
        """In the transaction that makes the row due again, or dead: the job says why it waits; a replayed
        recipient that failed for good is failed again (its dead letter is written beside)."""
        error = sanitize_text(f"{failure.code}: {failure.message}")
        if final and delivery_id is not None:
            repository.fail_delivery(conn, delivery_id, error)
        repository.set_job_status(conn, job_id, policy.RETRYABLE_FAILED, last_error=error)

    def _count(self, **counts: int) -> None:
        with self._lock:
            self.totals.update(counts)

    def metadata(self) -> dict[str, int]:
        with self._lock:
            return {name: self.totals.get(name, 0) for name in TOTALS}


def build_job(knobs: ReviewNotificationSettings) -> dg.JobDefinition:
    """The drain job: one op, in process, retried by Dagster only for the op's own infrastructure failures."""
    policies = stage_policies(knobs.job_attempts)

    @dg.op(name="send_notifications", retry_policy=DRAIN_RETRY_POLICY, out=dg.Out(dict))
    @sanitized_body
    def send_notifications(context: dg.OpExecutionContext, config: DrainConfig, reliability: ReliabilityResource,
                           review_mail: MailProviderResource) -> dg.Output:
        """Drain due review jobs: reconcile, send-and-mark each recipient once per version, finalize (002 §6)."""
        runtime = reliability.runtime()
        with review_mail.provider() as mail:
            handler = ReviewJobHandler(runtime, mail, row_attempts=knobs.row_attempts, run_id=context.run_id)
            drained = run_drain(context, runtime, PIPELINE, policies, handler, config)
        totals = handler.metadata()
        context.log.info(", ".join(f"{v} {k}" for k, v in totals.items() if v) or "no recipient touched")
        return dg.Output({**drained.value, **totals},
                         metadata={**drained.metadata, **{k: dg.MetadataValue.int(v) for k, v in totals.items()}})

    return drain_job(JOB_NAME, PIPELINE, send_notifications,
                     description="Review notifications: drains due review jobs (new, retried, replayed); reconciles, "
                                 "sends and marks each recipient once per review version, finalizes (002 §6).")

