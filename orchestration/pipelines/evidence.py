"""What the evidence pipeline adds to the code location."""

from __future__ import annotations

import dagster as dg

from assets.evidence import pipeline, policy, repository
from assets.evidence.settings import EvidenceOptions, EvidenceSettings
from assets.evidence.worker import WorkerHooks
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from resources.evidence import CaseApiResource, MerchantMailResource
from resources.factory import secret
from sensors.core import ReplayTarget
from sensors.evidence import inbox_sensor, outbox_publisher_sensor, retry_scheduler_sensor


def pipeline_defs(settings: Settings) -> PipelineDefs:
    evidence = EvidenceSettings()
    return PipelineDefs(
        name=pipeline.PIPELINE,
        assets=[pipeline.evidence_metrics],
        jobs=[pipeline.evidence_file_job, pipeline.evidence_attach_job, pipeline.evidence_metrics_job],
        schedules=[dg.ScheduleDefinition(name="evidence_metrics_schedule", job=pipeline.evidence_metrics_job,
                                         cron_schedule=evidence.monitor_cron,
                                         default_status=dg.DefaultScheduleStatus.RUNNING)],
        sensors=[inbox_sensor(evidence, settings.redrive_bucket), outbox_publisher_sensor(evidence),
                 retry_scheduler_sensor(evidence)],
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
        replay_targets={
            pipeline.PIPELINE: ReplayTarget(job=pipeline.evidence_attach_job, run_config=pipeline.attach_run_config,
                                            partition_key=policy.partition_of),
            pipeline.FILE_JOBS: ReplayTarget(job=pipeline.evidence_file_job, run_config=pipeline.file_job_run_config,
                                             partition_key=policy.partition_of),
        },
    )
