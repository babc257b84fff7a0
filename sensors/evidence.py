"""The evidence pipeline's sensors: new ZIPs in the inbox, the N2 deadline, the §6 metrics.

They decide and request; runs do the work. Attach runs are requested by the core's
`due_work_sensor` (one run per file job with due rows); the scheduler here only forces N2 at the
deadline (004 §5) and records its heartbeat, and the metrics sensor records §6's snapshot as an
asset event instead of starting a run every five minutes. A sensor that meets an error raises it:
Dagster shows a failed tick, never a silent "nothing new".
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

import json
from datetime import UTC, timedelta

import botocore.exceptions
import dagster as dg
from dagster_aws.s3 import S3Resource

from assets.evidence import pipeline, policy, service
from assets.evidence import repository as repo
from assets.evidence.settings import EvidenceOptions, EvidenceSettings
from redrive.clock import SystemClock
from redrive.run_keys import run_key
from resources.reliability import ReliabilityResource

INBOX_SENSOR = "evidence_inbox"
SCHEDULER_SENSOR = "evidence_retry_scheduler"
METRICS_SENSOR = "evidence_metrics"


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
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="004 §2: each new file-job ZIP under the S3 inbox prefix becomes a file-job partition "
                           "and its first run (ingest, then the first attach pass).")
    def _sensor(context: dg.SensorEvaluationContext, s3: S3Resource, reliability: ReliabilityResource):
        """New file-job ZIPs under the inbox prefix become file-job partitions and ingest runs. A ZIP whose file
        job is recorded already is not asked again: a lost cursor (a reset sensor, a new Dagster storage) would
        otherwise start one empty ingest run for every ZIP the inbox ever held."""
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
        ids = {obj["Key"]: policy.file_job_id(inbox_bucket, obj["Key"], str(obj.get("ETag", "")).strip('"'))
               for obj in fresh}
        with reliability.runtime().engine.connect() as conn:
            known = repo.known_file_jobs(conn, list(ids.values()))
        requests, keys = [], []
        for obj in fresh:
            if ids[obj["Key"]] in known:
                continue
            etag = str(obj.get("ETag", "")).strip('"')
            job_id = str(ids[obj["Key"]])
            keys.append(job_id)
            cfg = {"bucket": inbox_bucket, "key": obj["Key"], "etag": etag}
            requests.append(dg.RunRequest(
                run_key=run_key(pipeline.PIPELINE, job_id, attempt=1, purpose="ingest"),
                job_name=pipeline.evidence_file_job.name, partition_key=job_id,
                run_config={"ops": {"ingest_file_job": {"config": cfg}, "send_file_job_notifications": {"config": {}}}},
                tags={"redrive/pipeline": pipeline.PIPELINE, "evidence/source_key": obj["Key"][-200:]},
            ))
        if not requests:
            return dg.SensorResult(skip_reason=f"{len(fresh)} ZIP(s) under s3://{inbox_bucket}/{prefix} ingested "
                                               "already", cursor=cursor)
        return dg.SensorResult(run_requests=requests, cursor=cursor,
                               dynamic_partitions_requests=[pipeline.file_jobs.build_add_request(keys)])

    return _sensor


def retry_scheduler_sensor(settings: EvidenceSettings, *, clock=None) -> dg.SensorDefinition:
    clock = clock or SystemClock()

    @dg.sensor(name=SCHEDULER_SENSOR, minimum_interval_seconds=settings.scheduler_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="004 §5 deadline: forces N2 24 h after N1 (closing retries still open) and makes the "
                           "touched rows due; records its tick as the §6 heartbeat. Retries themselves are due "
                           "times on the work queue (sensor evidence_due_work).")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource):
        runtime = reliability.runtime(clock)
        report = service.scheduler_tick(runtime.engine, now=runtime.now(),
                                        n2_timeout=timedelta(hours=settings.n2_timeout_hours),
                                        n2_marks_permanent=settings.n2_force_marks_permanent,
                                        monotonic=runtime.clock.monotonic)
        return dg.SkipReason(report.describe())

    return _sensor


def metrics_sensor(settings: EvidenceSettings, *, clock=None) -> dg.SensorDefinition:
    clock = clock or SystemClock()

    @dg.sensor(name=METRICS_SENSOR, minimum_interval_seconds=settings.monitor_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="004 §6: snapshots the evidence metrics into `evidence_metrics` and raises §6's alerts; "
                           "reported as a materialization of the evidence_metrics asset, without a run.")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource,
                evidence_options: EvidenceOptions):
        o = evidence_options
        thresholds = policy.Thresholds(o.alert_permanent_rate, o.alert_permanent_min_sample, o.alert_queue_depth,
                                       o.alert_queue_depth_sustain_seconds, o.alert_n2_avg_latency_seconds,
                                       o.alert_heartbeat_seconds)
        report = service.monitor(reliability.runtime(clock), thresholds=thresholds,
                                 window=timedelta(seconds=o.alert_permanent_window_seconds))
        return dg.SensorResult(asset_events=[pipeline.metrics_materialization(report)])

    return _sensor
