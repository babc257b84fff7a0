"""Review notifications as a Dagster job: one dynamic partition per notification job (002 §6).

    prepare_job → send_notifications → finalize_job

`prepare_job` picks the job of the run's partition (a succeeded or superseded job is left alone:
§6.2's no-op), `send_notifications` reconciles and sends its outbox under the core's stage policy
(`redrive.stages.run_stage`: short retryable waits → `RetryRequested`, long ones → a durable timer,
exhausted or permanent → the job's dead letter + alert), `finalize_job` applies §6.5.

Safe to rerun: a row with `notified_at` is never sent again, a row that may have been sent is
looked up at the provider before any resend, and the provider's idempotency token is derived
from the outbox key, so a rerun, a replay or a backfill sends nothing twice.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

from typing import Any

import dagster as dg

from assets.review_notifications import api, delivery, policy, repository
from assets.review_notifications.settings import ReviewNotificationSettings
from redrive import deadletters
from redrive.sanitize import sanitize_text
from redrive.stages import OP_RETRY_POLICY, DeferredRetry, StagePolicy, Unit, run_stage, sanitized_body
from resources.reliability import ReliabilityResource
from resources.review_notifications import MailProviderResource

PIPELINE = policy.PIPELINE
JOB_NAME = "review_notifications_job"
PARTITIONS = dg.DynamicPartitionsDefinition(name=api.PARTITIONS_NAME)


class ReviewNotificationConfig(dg.Config):
    """Set by the core's sensors: a durable retry's attempt, or the dead letter a replay serves."""

    attempt: int | None = None
    stage: str | None = None
    prior_attempts: dict[str, int] = {}
    replay_of: int | None = None
    replay_from: str | None = None


def run_config(entity_ref: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Run config for a job's partition; `entity_ref` is a job key or one of its delivery refs."""
    cfg = {k: v for k, v in extra.items() if k in ReviewNotificationConfig.model_fields and v is not None}
    return {"ops": {op: {"config": cfg} for op in ("prepare_job", "send_notifications", "finalize_job")}}


def build_job(knobs: ReviewNotificationSettings) -> dg.JobDefinition:
    send_policy = StagePolicy(max_attempts=knobs.job_attempts, backoff=policy.JOB_BACKOFF,
                              vocabulary=policy.NOTIFICATION)

    @dg.op(retry_policy=OP_RETRY_POLICY, out=dg.Out(dict, is_required=False))
    @sanitized_body
    def prepare_job(context: dg.OpExecutionContext, config: ReviewNotificationConfig,
                    reliability: ReliabilityResource):
        """Pick the partition's job; requeue the delivery row a replay is for; skip a finished job."""
        runtime = reliability.runtime()
        key = context.partition_key
        if config.attempt is not None:
            runtime.resume(PIPELINE, key, config.attempt)
        with runtime.engine.begin() as conn:
            try:
                job = repository.job_by_key(conn, key)
            except repository.UnknownJob as exc:
                raise dg.Failure(description=str(exc), allow_retries=False) from None
            if config.replay_of is not None:
                letter = deadletters.get(conn, config.replay_of)
                delivery_id = policy.delivery_id_of(letter.entity_ref) if letter else None
                if delivery_id is not None and repository.requeue_failed(conn, delivery_id):
                    context.log.info(f"{letter.entity_ref}: requeued for replay of dead letter {letter.id}")
            if job.status not in policy.UNFINISHED:
                context.log.info(f"{key}: job is {job.status}; nothing to send (§6.2 no-op)")
                return
            repository.set_job_status(conn, job.id, policy.IN_PROGRESS)
        yield dg.Output(job.as_json(), metadata={"job": key, "status": job.status})

    @dg.op(retry_policy=OP_RETRY_POLICY, out=dg.Out(dict, is_required=False))
    @sanitized_body
    def send_notifications(context: dg.OpExecutionContext, config: ReviewNotificationConfig,
                           reliability: ReliabilityResource, review_mail: MailProviderResource, job: dict):
        """Reconcile the outbox against the provider, then send-and-mark every unsent recipient."""
        runtime = reliability.runtime()
        key, job_id = job["job_key"], job["job_id"]
        unit = Unit(pipeline=PIPELINE, entity_ref=key,
                    payload_ref={"table": "review_jobs", "id": job_id},
                    context={"job": key, "changelist_id": job["changelist_id"],
                             "review_version": job["review_version"]},
                    prior_attempts=config.prior_attempts)
        with review_mail.provider() as mail:
            deliverer = delivery.Deliverer(runtime.engine, mail, runtime, row_attempts=knobs.row_attempts,
                                           run_id=context.run_id,
                                           on_retry=lambda what: context.log.warning(f"retrying {what}"))

            def work() -> dict[str, Any]:
                with runtime.engine.begin() as conn:
                    current = repository.job_by_id(conn, job_id)
                    if current.status not in policy.UNFINISHED:
                        return {"skipped": current.status}
                    repository.set_job_status(conn, job_id, policy.IN_PROGRESS)
                try:
                    report = deliverer.deliver(current)
                    delivery.raise_for_job(report)
                except Exception as exc:
                    failure = delivery.classify(exc)
                    with runtime.engine.begin() as conn:
                        repository.set_job_status(conn, job_id, policy.RETRYABLE_FAILED,
                                                  last_error=sanitize_text(f"{failure.code}: {failure.message}"))
                    raise
                return report.as_dict()

            try:
                output = run_stage(context, runtime, unit, "send", send_policy, work)
            except DeferredRetry:
                return
        if output.get("busy") or output.get("skipped"):
            context.log.info(f"{key}: {'another run is delivering it' if output.get('busy') else output}")
            return
        yield dg.Output(output, metadata={k: v for k, v in output.items()
                                          if isinstance(v, int) and not isinstance(v, bool)})

    @dg.op(retry_policy=OP_RETRY_POLICY)
    @sanitized_body
    def finalize_job(context: dg.OpExecutionContext, config: ReviewNotificationConfig,
                     reliability: ReliabilityResource, delivered: dict) -> dict:
        """§6.5: succeeded only when every required recipient has notified_at; closes dead letters it settled."""
        runtime = reliability.runtime()
        key = context.partition_key
        with runtime.engine.begin() as conn:
            job = repository.job_by_key(conn, key)
            job = api.finalize(conn, job.id, runtime.now())
            replayed = deadletters.get(conn, config.replay_of) if config.replay_of is not None else None
            row_id = policy.delivery_id_of(replayed.entity_ref) if replayed else None
            row_sent = row_id is not None and repository.get_delivery(conn, row_id).notified_at is not None
        if replayed is not None and row_sent:  # the replayed recipient is notified now
            runtime.succeeded(PIPELINE, replayed.entity_ref)
        # The send stage completed, so a dead letter of the job (its stage failing for good) is closed even
        # when a recipient's own dead letter still keeps the job from succeeding.
        runtime.succeeded(PIPELINE, key)
        context.log.info(f"{key}: {job.status} {job.result}")
        context.add_output_metadata({"status": job.status, **(job.result or {})})
        return job.as_json()

    @dg.job(name=JOB_NAME, partitions_def=PARTITIONS, tags={"redrive/pipeline": PIPELINE},
            description="Review notifications: one partition per job; reconcile, send-and-mark each "
                        "recipient once per review version, finalize (002 §6).")
    def review_notifications_job() -> None:
        finalize_job(send_notifications(prepare_job()))

    return review_notifications_job
