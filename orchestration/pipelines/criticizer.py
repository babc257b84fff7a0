"""What the criticizer adds to the code location: its drain job, the sensor that starts it, its HTTP resource."""

from __future__ import annotations

from assets.criticizer import pipeline
from assets.criticizer.settings import CriticizerSettings
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from resources.criticizer import CriticizerHttpResource
from resources.factory import secret_setting
from sensors.core import due_work_sensor


def pipeline_defs(settings: Settings) -> PipelineDefs:
    own = CriticizerSettings()
    return PipelineDefs(
        name=pipeline.PIPELINE,
        jobs=[pipeline.criticizer_job],
        # new requests, retries falling due and dead-letter replays are all due rows: one sensor, one run per round
        sensors=[due_work_sensor(pipeline.PIPELINE, pipeline.criticizer_job,
                                 minimum_interval_seconds=own.sensor_interval_seconds,
                                 max_runs=settings.drain_runs(pipeline.PIPELINE))],
        resources={
            "criticizer_http": CriticizerHttpResource(
                timeout_seconds=settings.http_timeout_seconds,
                artifact_url_prefixes=list(own.allowed_prefixes(settings)),
                max_artifact_bytes=own.max_artifact_bytes,
                results_slack_webhook_url=secret_setting("CRITICIZER_RESULTS_SLACK_WEBHOOK_URL",
                                                         own.results_slack_webhook_url),
            )
        },
        drained=[pipeline.PIPELINE],
    )
