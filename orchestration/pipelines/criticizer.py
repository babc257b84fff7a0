"""What the criticizer adds to the code location: its job, its sensor, its HTTP resource, its replay target."""

from __future__ import annotations

from assets.criticizer import pipeline
from assets.criticizer.settings import CriticizerSettings
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from resources.criticizer import CriticizerHttpResource
from resources.factory import secret_setting
from sensors.core import ReplayTarget
from sensors.criticizer import new_requests_sensor


def pipeline_defs(settings: Settings) -> PipelineDefs:
    own = CriticizerSettings()
    return PipelineDefs(
        name=pipeline.PIPELINE,
        jobs=[pipeline.criticizer_job],
        sensors=[new_requests_sensor(pipeline.criticizer_job, pipeline.requests_partitions, pipeline.run_config,
                                     limit=own.sensor_batch, minimum_interval_seconds=own.sensor_interval_seconds)],
        resources={
            "criticizer_http": CriticizerHttpResource(
                timeout_seconds=settings.http_timeout_seconds,
                artifact_url_prefixes=list(own.allowed_prefixes(settings)),
                max_artifact_bytes=own.max_artifact_bytes,
                results_slack_webhook_url=secret_setting("CRITICIZER_RESULTS_SLACK_WEBHOOK_URL",
                                                         own.results_slack_webhook_url),
            )
        },
        replay_targets={
            # replays and durable retries run on the request's own partition
            pipeline.PIPELINE: ReplayTarget(job=pipeline.criticizer_job, run_config=pipeline.run_config,
                                            partition_key=lambda request_id: request_id)
        },
    )
