"""The evidence pipeline's sensors: new ZIPs in the inbox, the outbox publisher, the retry scheduler.

They decide and request; runs do the work. The publisher and the scheduler write to the outbox
because that is what they are (004 §3: the scheduler's output is outbox rows; the publisher's is
"published"), each in one short transaction. A sensor that meets an error raises it: Dagster
shows a failed tick, never a silent "nothing new".
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

import json
from datetime import UTC, timedelta

import botocore.exceptions
import dagster as dg
from dagster_aws.s3 import S3Resource

from assets.evidence import contracts, pipeline, policy, service
from assets.evidence.repository import OutboxEvent
from assets.evidence.settings import EvidenceSettings
from redrive.clock import SystemClock
from redrive.run_keys import run_key
from resources.reliability import ReliabilityResource

INBOX_SENSOR = "evidence_inbox"
PUBLISHER_SENSOR = "evidence_outbox_publisher"
SCHEDULER_SENSOR = "evidence_retry_scheduler"
FILE_JOBS = service.FILE_JOBS


def _cursor(raw: str | None) -> tuple[str, set[str]]:
    if not raw:
        return "", set()
    data = json.loads(raw)
    return str(data.get("after", "")), set(data.get("keys", []))


def new_zips(objects: list[dict], cursor: str | None) -> tuple[list[dict], str | None]:
    """Pure: the ZIPs modified after the cursor (LastModified, then the keys seen at that instant),
    oldest first, and the cursor after them. S3 lists keys in name order, not time order, so the
    cursor is a time, not a key; the run key dedupes anything seen twice."""
    after, seen = _cursor(cursor)
    fresh = []
    for obj in objects:
        if not obj["Key"].lower().endswith(".zip"):
            continue
        stamp = obj["LastModified"].astimezone(UTC).isoformat()
        if stamp > after or (stamp == after and obj["Key"] not in seen):
            fresh.append({**obj, "_stamp": stamp})
    if not fresh:
        return [], cursor
    fresh.sort(key=lambda o: (o["_stamp"], o["Key"]))
    last = fresh[-1]["_stamp"]
    keys = sorted({o["Key"] for o in fresh if o["_stamp"] == last} | (seen if last == after else set()))
    return fresh, json.dumps({"after": last, "keys": keys})


def inbox_sensor(settings: EvidenceSettings, bucket: str, *, minimum_interval_seconds: int = 30) -> dg.SensorDefinition:
    prefix = settings.inbox_prefix
    inbox_bucket = settings.bucket or bucket

    @dg.sensor(name=INBOX_SENSOR, job=pipeline.evidence_file_job, minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING)
    def _sensor(context: dg.SensorEvaluationContext, s3: S3Resource):
        """New file-job ZIPs under the inbox prefix become file-job partitions and ingest runs."""
        client = s3.get_client()
        objects: list[dict] = []
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=inbox_bucket, Prefix=prefix):
                objects.extend(page.get("Contents", []))
        except botocore.exceptions.ClientError as exc:
            if (exc.response.get("Error") or {}).get("Code") != "NoSuchBucket":
                raise
            return dg.SkipReason(f"bucket {inbox_bucket} does not exist (yet): no inbox to watch")
        fresh, cursor = new_zips(objects, context.cursor)
        if not fresh:
            return dg.SkipReason(f"no new ZIP under s3://{inbox_bucket}/{prefix}")
        requests, keys = [], []
        for obj in fresh:
            etag = str(obj.get("ETag", "")).strip('"')
            job_id = str(policy.file_job_id(inbox_bucket, obj["Key"], etag))
            keys.append(job_id)
            cfg = {"bucket": inbox_bucket, "key": obj["Key"], "etag": etag}
            requests.append(dg.RunRequest(
                run_key=run_key(FILE_JOBS, job_id, attempt=1, purpose="ingest"),
                job_name=pipeline.evidence_file_job.name, partition_key=job_id,
                run_config={"ops": {"ingest_file_job": {"config": cfg}, "send_file_job_notifications": {"config": {}}}},
                tags={"redrive/pipeline": FILE_JOBS, "evidence/source_key": obj["Key"][-200:]},
            ))
        return dg.SensorResult(run_requests=requests, cursor=cursor,
                               dynamic_partitions_requests=[pipeline.file_jobs.build_add_request(keys)])

    return _sensor


def event_run_request(event: OutboxEvent) -> dg.RunRequest:
    """An outbox event as a run of its file job's partition; the run key is the event id and its
    publication number, so a repeated tick starts nothing twice and a republication starts a new run."""
    key = run_key(service.PIPELINE, f"outbox-{event.event_id}", attempt=event.attempts)
    tags = {"redrive/pipeline": service.PIPELINE, "evidence/event_id": str(event.event_id),
            "evidence/event_type": event.event_type}
    if event.event_type in (contracts.ATTACH_REQUESTED, contracts.ATTACH_RETRY):
        return dg.RunRequest(run_key=key, job_name=pipeline.evidence_attach_job.name,
                             partition_key=str(event.file_job_id), tags=tags,
                             run_config={"ops": {"attach_row_evidence": {"config": {"event_id": str(event.event_id)}}}})
    cfg = {"event_id": str(event.event_id)}
    return dg.RunRequest(run_key=key, job_name=pipeline.evidence_file_job.name, partition_key=str(event.file_job_id),
                         tags=tags, run_config={"ops": {"ingest_file_job": {"config": cfg},
                                                        "send_file_job_notifications": {"config": cfg}}})


def outbox_publisher_sensor(settings: EvidenceSettings, *, clock=None) -> dg.SensorDefinition:
    clock = clock or SystemClock()

    @dg.sensor(name=PUBLISHER_SENSOR, jobs=[pipeline.evidence_attach_job, pipeline.evidence_file_job],
               minimum_interval_seconds=settings.publisher_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING)
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource):
        """Publishes PENDING outbox events as runs of their file job's partition (run key: the event id)."""
        runtime = reliability.runtime(clock)
        claim = service.publish(runtime.engine, now=runtime.now(), limit=settings.publisher_batch,
                                republish_after=timedelta(seconds=settings.republish_after_seconds),
                                max_attempts=settings.max_publish_attempts)
        if claim.failed:
            context.log.warning(f"{len(claim.failed)} outbox events were never consumed and are FAILED "
                                "(the monitor alerts on each)")
        if not claim.published:
            return dg.SkipReason("no outbox event to publish")
        partitions = sorted({str(e.file_job_id) for e in claim.published})
        return dg.SensorResult(run_requests=[event_run_request(e) for e in claim.published],
                               dynamic_partitions_requests=[pipeline.file_jobs.build_add_request(partitions)])

    return _sensor


def retry_scheduler_sensor(settings: EvidenceSettings, *, clock=None) -> dg.SensorDefinition:
    clock = clock or SystemClock()

    @dg.sensor(name=SCHEDULER_SENSOR, minimum_interval_seconds=settings.scheduler_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING)
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource):
        """004 §3: requeues failed rows whose retryable artifacts are due as EVIDENCE_ATTACH_RETRY outbox
        events (≤ batch rows per tick, SKIP LOCKED), and forces N2 at the deadline."""
        runtime = reliability.runtime(clock)
        report = service.schedule_retries(
            runtime.engine, now=runtime.now(), batch_rows=settings.scheduler_batch_rows,
            scan_artifacts=settings.scheduler_scan_artifacts,
            n2_timeout=timedelta(hours=settings.n2_timeout_hours),
            n2_marks_permanent=settings.n2_force_marks_permanent, monotonic=runtime.clock.monotonic)
        return dg.SkipReason(report.describe() + "; the outbox publisher starts their runs")

    return _sensor
