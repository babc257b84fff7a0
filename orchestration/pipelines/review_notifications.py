"""What review notifications add to the code location: the drain job, its due-work sensor, the mail provider."""

from __future__ import annotations

from assets.review_notifications import pipeline, policy, repository
from assets.review_notifications.settings import ReviewNotificationSettings
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from resources.factory import secret
from resources.review_notifications import MailProviderResource
from sensors.core import due_work_sensor


def pipeline_defs(settings: Settings) -> PipelineDefs:
    knobs = ReviewNotificationSettings()
    job = pipeline.build_job(knobs)
    return PipelineDefs(
        name=policy.PIPELINE,
        jobs=[job],
        sensors=[due_work_sensor(policy.PIPELINE, job, minimum_interval_seconds=knobs.sensor_interval_seconds,
                                 max_runs=settings.drain_runs(policy.PIPELINE))],
        resources={
            "review_mail": MailProviderResource(
                base_url=settings.mail_url or "http://127.0.0.1:9/mail/v1",
                api_token=secret("REVIEW_NOTIFICATIONS_MAIL_API_TOKEN", knobs.mail_api_token),
                timeout_seconds=settings.http_timeout_seconds,
            ),
        },
        # Retries and dead-letter replays (of a job or of one recipient) are rows of the work queue
        # falling due: the drain runs work them, no per-entity run or replay target.
        drained=[policy.PIPELINE],
        failed_for_good={policy.PIPELINE: repository.failed_for_good},
    )
