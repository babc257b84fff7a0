"""What review notifications add to the code location."""

from __future__ import annotations

from assets.review_notifications import pipeline, policy, repository
from assets.review_notifications.settings import ReviewNotificationSettings
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from resources.factory import secret
from resources.review_notifications import MailProviderResource
from sensors.core import ReplayTarget
from sensors.review_notifications import pending_jobs_sensor


def pipeline_defs(settings: Settings) -> PipelineDefs:
    knobs = ReviewNotificationSettings()
    job = pipeline.build_job(knobs)
    return PipelineDefs(
        name=policy.PIPELINE,
        jobs=[job],
        sensors=[pending_jobs_sensor(job, batch=knobs.sensor_batch,
                                     minimum_interval_seconds=knobs.sensor_interval_seconds)],
        resources={
            "review_mail": MailProviderResource(
                base_url=settings.mail_url or "http://127.0.0.1:9/mail/v1",
                api_token=secret("REVIEW_NOTIFICATIONS_MAIL_API_TOKEN", knobs.mail_api_token),
                timeout_seconds=settings.http_timeout_seconds,
            ),
        },
        # Durable retries and dead-letter replays of a job or of one of its delivery rows run the
        # job's partition; the run config says which attempt or dead letter it serves.
        failed_for_good={policy.PIPELINE: repository.failed_for_good},
        replay_targets={policy.PIPELINE: ReplayTarget(job=job, run_config=pipeline.run_config,
                                                      partition_key=policy.job_key_of)},
    )
