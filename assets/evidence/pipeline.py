"""Evidence attach (004 Stage 1.3) as Dagster jobs over one dynamic partition per file job.

- `evidence_file_job`: ingest the file job's ZIP (rows, artifacts, attach events in one
  transaction), then send whatever N1/N2 the outbox holds for it. Requested by the inbox sensor
  (new ZIP) and by the outbox publisher (an N1/N2 event).
- `evidence_attach_job`: one outbox attach event → one row's evidence attached (Option A). Requested
  by the outbox publisher, for the initial attach and for each retry the scheduler sensor requeues.
- `evidence_metrics`: §6's metrics and alerts, on a schedule.

Every run is safe to repeat: ingest skips a file job it has recorded, the worker skips attached
artifacts and looks up those with a recorded attempt, and notifications are sent once per token.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

from datetime import timedelta
from typing import Any
from uuid import UUID

import dagster as dg
from dagster_aws.s3 import S3Resource

from assets.evidence import policy, service, worker
from assets.evidence import repository as repo
from assets.evidence.settings import EvidenceOptions
from redrive.backoff import FullJitter
from redrive.failures import Code, Failure, PermanentError
from redrive.stages import OP_RETRY_POLICY, DeferredRetry, EntityRunFields, StagePolicy, Unit, entity_run_config, run_stage, sanitized_body
from redrive.vocabularies import EVIDENCE, EVIDENCE_S3
from resources.evidence import CaseApiResource, MerchantMailResource
from resources.reliability import ReliabilityResource

PIPELINE = service.PIPELINE
FILE_JOBS = service.FILE_JOBS
GROUP = "evidence"

file_jobs = dg.DynamicPartitionsDefinition(name="evidence_file_jobs")
"""One partition per file job (its id, derived from the ZIP's bucket, key and ETag)."""

# Stage policies for what stops a whole step (S3, the database, the mail provider). Per-artifact
# attach failures never get here: they are data with their own durable schedule (next_retry_at).
INGEST_POLICY = StagePolicy(max_attempts=5, backoff=FullJitter(initial=2.0, max_delay=60.0), vocabulary=EVIDENCE_S3)
ATTACH_POLICY = StagePolicy(max_attempts=3, backoff=FullJitter(initial=1.0, max_delay=30.0), vocabulary=EVIDENCE)
NOTIFY_POLICY = StagePolicy(max_attempts=5, backoff=FullJitter(initial=2.0, max_delay=60.0), vocabulary=EVIDENCE)


class FileJobConfig(EntityRunFields):
    """A file job's run: its source (from the inbox sensor) or the outbox event that started it."""

    bucket: str = ""
    key: str = ""
    etag: str = ""
    event_id: str | None = None


class AttachConfig(EntityRunFields):
    """One row's run: the outbox event (publisher), or the row itself (a replay or a durable retry)."""

    event_id: str | None = None
    row_id: str | None = None


def _stage(context: dg.OpExecutionContext, runtime: Any, unit: Unit, stage: str, policy_: StagePolicy,
           work: Any) -> Any:
    try:
        return run_stage(context, runtime, unit, stage, policy_, work)
    except DeferredRetry:
        return None


@dg.op(retry_policy=OP_RETRY_POLICY, out=dg.Out(dict, is_required=False))
@sanitized_body
def ingest_file_job(context: dg.OpExecutionContext, config: FileJobConfig, reliability: ReliabilityResource,
                    s3: S3Resource, evidence_options: EvidenceOptions):
    """Validate the file job's ZIP (a manifest.csv row per dispute case naming its evidence files), extract
    the files to S3, and record rows, artifacts and their attach events in one transaction."""
    runtime = reliability.runtime()
    job_id = UUID(context.partition_key)
    if config.attempt is not None:
        runtime.resume(FILE_JOBS, str(job_id), config.attempt)
    client = s3.get_client()
    unit = Unit(FILE_JOBS, str(job_id), payload_ref={"table": "file_job", "id": str(job_id)},
                context={"file_job_id": str(job_id), "source_key": config.key},
                prior_attempts=config.prior_attempts)

    def work() -> worker.IngestResult:
        with runtime.engine.begin() as conn:
            job = repo.get_file_job(conn, job_id)
        if job is None:
            if not (config.bucket and config.key and config.etag):
                raise PermanentError(Failure.of(Code.INVARIANT_VIOLATION,
                                                message=f"file job {job_id} is unknown and the run names no source"))
            if policy.file_job_id(config.bucket, config.key, config.etag) != job_id:
                raise PermanentError(Failure.of(Code.INVARIANT_VIOLATION,
                                                message=f"partition {job_id} does not match the source it names"))
            head = client.head_object(Bucket=config.bucket, Key=config.key)
            notify_to = (head.get("Metadata") or {}).get("notify-to", "").strip()
            with runtime.engine.begin() as conn:
                job = repo.upsert_file_job(conn, job_id, bucket=config.bucket, key=config.key, etag=config.etag,
                                           notify_to=notify_to if "@" in notify_to else evidence_options.default_notify_to,
                                           now=runtime.now())
        return worker.ingest(runtime, client, evidence_options, job)

    result = _stage(context, runtime, unit, "ingest", INGEST_POLICY, work)
    if result is None:
        return
    context.log.info(f"file job {job_id}: {result.status} {result.counts} errors={result.errors}")
    yield dg.Output(
        {"status": result.status},
        metadata={"file_job_id": str(job_id), "status": result.status, **result.counts,
                  "errors_by_code": dg.MetadataValue.json(result.errors),
                  "notifications_requested": ",".join(result.notifications) or "-"},
    )


@dg.op(retry_policy=OP_RETRY_POLICY)
@sanitized_body
def send_file_job_notifications(context: dg.OpExecutionContext, config: FileJobConfig,
                                reliability: ReliabilityResource, merchant_mail: MerchantMailResource,
                                ingested: dict) -> dict:
    """Send the file job's pending N1/N2 to the merchant: send first, then mark, one message per kind ever."""
    runtime = reliability.runtime()
    job_id = UUID(context.partition_key)
    unit = Unit(FILE_JOBS, str(job_id), payload_ref={"table": "file_job", "id": str(job_id)},
                context={"file_job_id": str(job_id)}, prior_attempts=config.prior_attempts)
    with merchant_mail.session() as mail:
        sender = worker.NotificationSender(runtime, mail, run_id=context.run_id)
        sent = _stage(context, runtime, unit, "notify", NOTIFY_POLICY, lambda: sender.send_pending(job_id))
    if sent is None:
        return {}
    runtime.succeeded(FILE_JOBS, str(job_id))  # closes a replayed file-job dead letter, if any
    out = {s.kind: s.message_id for s in sent}
    context.add_output_metadata({"file_job_id": str(job_id), "sent": ",".join(
        f"{s.kind}{' (already sent)' if s.already_sent else ''}" for s in sent) or "-"})
    return out


@dg.job(partitions_def=file_jobs, tags={"redrive/pipeline": FILE_JOBS})
def evidence_file_job() -> None:
    """A file job: ingest its ZIP (once), then send its pending N1/N2 notifications."""
    send_file_job_notifications(ingest_file_job())


@dg.op(retry_policy=OP_RETRY_POLICY)
@sanitized_body
def attach_row_evidence(context: dg.OpExecutionContext, config: AttachConfig, reliability: ReliabilityResource,
                        case_api: CaseApiResource, evidence_options: EvidenceOptions,
                        evidence_hooks: dg.ResourceParam[worker.WorkerHooks]) -> dict:
    """Attach one row's evidence through the case API (004 §4 Option A): skip what is attached, look up what
    has a recorded attempt, attach the rest, and write each outcome with its retry schedule."""
    runtime = reliability.runtime()
    job_id = UUID(context.partition_key)
    if config.event_id is not None:
        with runtime.engine.connect() as conn:
            event = repo.get_event(conn, UUID(config.event_id))
        if event is None or event.file_job_row_id is None:
            raise dg.Failure(description=f"outbox event {config.event_id} is not an attach event", allow_retries=False)
        row_id = event.file_job_row_id
    elif config.row_id is not None:
        row_id = UUID(config.row_id)
    else:
        raise dg.Failure(description="attach_row_evidence needs an event_id or a row_id", allow_retries=False)
    entity = policy.row_entity(job_id, row_id)
    if config.attempt is not None:
        runtime.resume(PIPELINE, entity, config.attempt)
    unit = Unit(PIPELINE, entity, payload_ref={"table": "file_job_row", "id": str(row_id)},
                context={"file_job_id": str(job_id), "row_id": str(row_id), "event_id": config.event_id or "-"},
                prior_attempts=config.prior_attempts)
    with case_api.session() as api:
        attach = worker.AttachWorker(runtime, api, max_attempts=evidence_options.max_attempts,
                                     hooks=evidence_hooks, run_id=context.run_id)
        if config.event_id is not None:
            def work() -> worker.RowResult:
                return attach.process_event(UUID(config.event_id))
        else:
            mode: policy.Mode = "replay" if config.replay_of is not None else "retry"

            def work() -> worker.RowResult:
                return attach.process_row(job_id, row_id, mode=mode)
        result = _stage(context, runtime, unit, "attach", ATTACH_POLICY, work)
    if result is None:
        return {}
    meta = result.metadata()
    context.log.info(f"row {row_id}: {meta}")
    context.add_output_metadata(meta)
    return meta


@dg.job(partitions_def=file_jobs, tags={"redrive/pipeline": PIPELINE})
def evidence_attach_job() -> None:
    """One row of a file job: attach its evidence, initial attempt or retry (one outbox event per run)."""
    attach_row_evidence()


@dg.asset(group_name=GROUP, kinds={"postgres"}, tags={"redrive/pipeline": PIPELINE}, retry_policy=OP_RETRY_POLICY)
@sanitized_body
def evidence_metrics(context: dg.AssetExecutionContext, reliability: ReliabilityResource,
                     evidence_options: EvidenceOptions) -> dg.MaterializeResult:
    """004 §6 evidence attach metrics (first-attempt and retry success rates, retry queue depth, N1→N2 latency,
    permanent failures by code, scheduler health), kept in `evidence_metrics`; raises §6's alerts."""
    o = evidence_options
    thresholds = policy.Thresholds(o.alert_permanent_rate, o.alert_permanent_min_sample, o.alert_queue_depth,
                                   o.alert_queue_depth_sustain_seconds, o.alert_n2_avg_latency_seconds,
                                   o.alert_heartbeat_seconds)
    report = service.monitor(reliability.runtime(), thresholds=thresholds,
                             window=timedelta(seconds=o.alert_permanent_window_seconds))
    metadata: dict[str, Any] = {}
    for key, value in report.metrics.items():
        if isinstance(value, dict):
            metadata[key] = dg.MetadataValue.json(value)
        elif value is None:
            metadata[key] = dg.MetadataValue.text("-")
        else:
            metadata[key] = value
    metadata["alerts_raised"] = ",".join(a.kind for a in report.alerts) or "-"
    return dg.MaterializeResult(metadata=metadata)


evidence_metrics_job = dg.define_asset_job("evidence_metrics_job", selection=[evidence_metrics],
                                           tags={"redrive/pipeline": PIPELINE},
                                           description="004 §6: snapshot the evidence metrics and raise alerts.")


def attach_run_config(row_entity: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Run config of a replay or a durable retry of one row (sensors.core.ReplayTarget)."""
    _, row = policy.split_row_entity(row_entity)
    return entity_run_config(AttachConfig, ["attach_row_evidence"], **{**extra, "row_id": str(row)})


def file_job_run_config(file_job: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Run config of a replay or a durable retry of a file job."""
    return entity_run_config(FileJobConfig, ["ingest_file_job", "send_file_job_notifications"], **extra)
