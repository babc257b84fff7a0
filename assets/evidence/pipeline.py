"""Evidence attach (004 Stage 1.3) as one Dagster job over one dynamic partition per file job.

`evidence_file_job` brings one file job forward, and needs no run config once the job is known:
1. ingest the ZIP (rows, artifacts, attach events and the rows' work items in one transaction) —
   only the inbox sensor's first run does this, later runs find it recorded;
2. drain the file job's due rows through the core (`redrive.drain`, group = the file job): the
   initial attach, every retry whose time has come, replays of dead-lettered rows;
3. send whatever N1/N2 the outbox holds for it.
Requested by the inbox sensor (a new ZIP) and by the core's due-work sensor (one run per file job
with due rows, never while one is active), so a file job costs one run per retry round. A UI launch
or a backfill of file-job partitions does exactly the same. The §6 metrics are a sensor's asset
events (`evidence_metrics`), not runs.

Every run is safe to repeat: ingest skips a file job it has recorded, the drain leases rows (SKIP
LOCKED, fenced), the worker skips attached artifacts and looks up those with a recorded attempt,
and notifications are sent once per token.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

from typing import Any
from uuid import UUID

import dagster as dg
from dagster_aws.s3 import S3Resource

from assets import OWNERS
from assets.evidence import policy, service, worker
from assets.evidence import repository as repo
from assets.evidence.settings import EvidenceOptions
from redrive.backoff import FullJitter
from redrive.drain_ops import DRAIN_RETRY_POLICY, DrainConfig, run_drain
from redrive.failures import Code, Failure, PermanentError
from redrive.stages import OP_RETRY_POLICY, DeferredRetry, EntityRunFields, StagePolicy, Unit, entity_run_config, run_stage, sanitized_body
from redrive.vocabularies import EVIDENCE, EVIDENCE_S3
from resources.evidence import CaseApiResource, MerchantMailResource
from resources.reliability import ReliabilityResource

PIPELINE = service.PIPELINE
GROUP = "evidence"

file_jobs = dg.DynamicPartitionsDefinition(name="evidence_file_jobs")
"""One partition per file job (its id, derived from the ZIP's bucket, key and ETag)."""

# Stage policies for what stops a whole step (S3, the database, the mail provider). Per-artifact
# attach failures never get here: they are data with their own schedule (next_retry_at, the row's
# due time). ATTACH_POLICY counts a row's passes on its work row: one per retry round (3) plus up to
# 3 passes a database error or a bug broke; no vocabulary, so a row's final failure keeps its code.
INGEST_POLICY = StagePolicy(max_attempts=5, backoff=FullJitter(initial=2.0, max_delay=60.0), vocabulary=EVIDENCE_S3)
ATTACH_POLICY = StagePolicy(max_attempts=6, backoff=FullJitter(initial=1.0, max_delay=30.0))
ROW_POLICIES = {"attach": ATTACH_POLICY}
NOTIFY_POLICY = StagePolicy(max_attempts=5, backoff=FullJitter(initial=2.0, max_delay=60.0), vocabulary=EVIDENCE)


class FileJobConfig(EntityRunFields):
    """A file job's run: its source (from the inbox sensor) or the outbox event that started it."""

    bucket: str = ""
    key: str = ""
    etag: str = ""
    event_id: str | None = None


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
        runtime.resume(PIPELINE, str(job_id), config.attempt)
    client = s3.get_client()
    unit = Unit(PIPELINE, str(job_id), payload_ref={"table": "file_job", "id": str(job_id)},
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


@dg.op(retry_policy=DRAIN_RETRY_POLICY)
@sanitized_body
def attach_file_job_rows(context: dg.OpExecutionContext, config: DrainConfig, reliability: ReliabilityResource,
                         case_api: CaseApiResource, evidence_options: EvidenceOptions,
                         evidence_hooks: dg.ResourceParam[worker.WorkerHooks], ingested: dict) -> dg.Output:
    """Attach the evidence of every due row of this file job (004 §4 Option A) through the core's drain:
    the initial pass, each retry whose time has come, replays. A row with retries left falls due again
    at its next retry time; a row that ends with operational failures is dead-lettered."""
    runtime = reliability.runtime()
    with case_api.session() as api:
        handle = worker.row_handler(runtime, api, max_attempts=evidence_options.max_attempts, hooks=evidence_hooks,
                                    run_id=context.run_id)
        return run_drain(context, runtime, PIPELINE, ROW_POLICIES, handle, config, group_key=context.partition_key)


@dg.op(retry_policy=OP_RETRY_POLICY)
@sanitized_body
def send_file_job_notifications(context: dg.OpExecutionContext, config: FileJobConfig,
                                reliability: ReliabilityResource, merchant_mail: MerchantMailResource,
                                drained: dict) -> dict:
    """Send the file job's pending N1/N2 to the merchant: send first, then mark, one message per kind ever."""
    runtime = reliability.runtime()
    job_id = UUID(context.partition_key)
    unit = Unit(PIPELINE, str(job_id), payload_ref={"table": "file_job", "id": str(job_id)},
                context={"file_job_id": str(job_id)}, prior_attempts=config.prior_attempts)
    with merchant_mail.session() as mail:
        sender = worker.NotificationSender(runtime, mail, run_id=context.run_id)
        sent = _stage(context, runtime, unit, "notify", NOTIFY_POLICY, lambda: sender.send_pending(job_id))
    if sent is None:
        return {}
    runtime.succeeded(PIPELINE, str(job_id))  # closes a replayed file-job dead letter, if any
    out = {s.kind: s.message_id for s in sent}
    context.add_output_metadata({"file_job_id": str(job_id), "sent": ",".join(
        f"{s.kind}{' (already sent)' if s.already_sent else ''}" for s in sent) or "-"})
    return out


# Every op of the run is safe to repeat, so a run that died outside its ops (a killed worker, a database restart)
# is re-run up to 3 times (`run_retries` of the instance says 1): before ingest, the whole ZIP rides on this run,
# and two crashes in a row would dead-letter every row of it (what the chaos run's 70-row file job showed).
RUN_RETRIES = 3


@dg.job(partitions_def=file_jobs, executor_def=dg.in_process_executor,
        tags={"redrive/pipeline": PIPELINE, "dagster/max_retries": str(RUN_RETRIES)})
def evidence_file_job() -> None:
    """A file job: ingest its ZIP (once), attach the evidence of its due rows, send its pending N1/N2."""
    send_file_job_notifications(attach_file_job_rows(ingest_file_job()))


evidence_metrics = dg.AssetSpec(
    "evidence_metrics", group_name=GROUP, kinds={"postgres"}, owners=OWNERS,
    description="004 §6 evidence attach metrics (first-attempt and retry success rates, retry queue depth, "
                "N1→N2 latency, permanent failures by code, scheduler health), kept in `evidence_metrics`. "
                "Recorded by the `evidence_metrics` sensor every few minutes, without a run.")


def metrics_materialization(report: service.MonitorReport) -> dg.AssetMaterialization:
    """A monitor snapshot as the metrics asset's materialization (what the asset page charts)."""
    metadata: dict[str, Any] = {}
    for key, value in report.metrics.items():
        if isinstance(value, dict):
            metadata[key] = dg.MetadataValue.json(value)
        elif value is None:
            metadata[key] = dg.MetadataValue.text("-")
        else:
            metadata[key] = value
    metadata["alerts_raised"] = ",".join(a.kind for a in report.alerts) or "-"
    return dg.AssetMaterialization(asset_key=evidence_metrics.key, metadata=metadata)


def file_job_run_config(file_job: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Run config of a replay or a durable retry of a file job (ingest or notifications)."""
    return entity_run_config(FileJobConfig, ["ingest_file_job", "send_file_job_notifications"], **extra)
