"""What the matching pipeline adds to the code location."""

from __future__ import annotations

from assets.matching import pipeline, repository
from assets.matching.pipeline import matching_resource
from assets.matching.policy import PIPELINE
from assets.matching.settings import MatchingSettings
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from sensors.core import ReplayTarget
from sensors.matching import matching_queue_sensor, matching_stuck_sensor


def pipeline_defs(settings: Settings) -> PipelineDefs:
    matching = MatchingSettings()
    return PipelineDefs(
        name=PIPELINE,
        jobs=[pipeline.matching_drain_job, pipeline.matching_setup_job, pipeline.matching_requeue_job],
        sensors=[
            matching_queue_sensor(pipeline.matching_drain_job, minimum_interval_seconds=matching.sensor_interval_seconds,
                                  max_concurrent=matching.max_concurrent_drains),
            matching_stuck_sensor(minimum_interval_seconds=matching.stuck_sensor_interval_seconds),
        ],
        resources={"matching": matching_resource(settings, matching)},
        failed_for_good={PIPELINE: repository.failed_for_good},
        replay_targets={PIPELINE: ReplayTarget(job=pipeline.matching_requeue_job,
                                               run_config=pipeline.requeue_run_config,
                                               batch_run_config=pipeline.batch_requeue_run_config)},
    )
