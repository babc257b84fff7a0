"""What the evidence pipeline adds to the code location: one job per file job, its sensors, resources."""

from __future__ import annotations

import dagster as dg

from assets.evidence import pipeline, policy, repository
from assets.evidence.settings import EvidenceOptions, EvidenceSettings
from assets.evidence.worker import WorkerHooks
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from resources.evidence import CaseApiResource, MerchantMailResource
from resources.factory import secret
from sensors.core import ReplayTarget, due_work_sensor
from sensors.evidence import inbox_sensor, metrics_sensor, retry_scheduler_sensor


def pipeline_defs(settings: Settings) -> PipelineDefs:
    evidence = EvidenceSettings()
    return PipelineDefs(
        name=pipeline.PIPELINE,
        assets=[pipeline.evidence_metrics],
        jobs=[pipeline.evidence_file_job],
        sensors=[inbox_sensor(evidence, settings.redrive_bucket),
                 # rows are the core's work items grouped by file job: one run per file job and retry round
                 due_work_sensor(pipeline.PIPELINE, pipeline.evidence_file_job, by_partition=True),
                 retry_scheduler_sensor(evidence), metrics_sensor(evidence)],
        resources={
            "case_api": CaseApiResource(base_url=settings.case_url or "http://127.0.0.1:9/case/v1",
                                        token=secret("CASE_API_TOKEN", settings.case_api_token),
                                        timeout_seconds=settings.http_timeout_seconds),
            "merchant_mail": MerchantMailResource(base_url=settings.mail_url or "http://127.0.0.1:9/mail/v1",
                                                  token=secret("MAIL_API_TOKEN", "sandbox-token"),
                                                  timeout_seconds=settings.http_timeout_seconds),
            "evidence_options": EvidenceOptions.from_settings(evidence, settings.redrive_bucket),
            "evidence_hooks": dg.ResourceDefinition.hardcoded_resource(WorkerHooks(), "no-op test seam of the worker"),
        },
        failed_for_good={pipeline.PIPELINE: repository.failed_for_good},
        # One pipeline name, two kinds of entity: rows (`{job}/{row}`) are drained, so their replays and retries
        # are work rows falling due; file jobs (`{job}`: ingest, notifications) have no work row and replay as a
        # run of their partition (the replay sensor takes only letters without a work row).
        replay_targets={
            pipeline.PIPELINE: ReplayTarget(job=pipeline.evidence_file_job, run_config=pipeline.file_job_run_config,
                                             partition_key=policy.partition_of),
        },
        drained=[pipeline.PIPELINE],
    )
