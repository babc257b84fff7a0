"""What the matching pipeline adds to the code location."""

from __future__ import annotations

from assets.matching import pipeline, repository
from assets.matching.policy import PIPELINE
from assets.matching.settings import MatchingSettings
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from resources.matching import MatchingResource
from sensors.core import ReplayTarget
from sensors.matching import matching_queue_sensor, matching_stuck_sensor


def matching_resource(settings: Settings, matching: MatchingSettings) -> MatchingResource:
    return MatchingResource(
        endpoint_url=settings.aws_endpoint_url,
        region_name=settings.aws_region,
        queue_name=matching.queue_name,
        dlq_name=matching.dlq_name,
        visibility_timeout_seconds=matching.visibility_timeout_seconds,
        max_receive_count=matching.max_receive_count,
        batch_size=matching.batch_size,
        receivers=matching.receivers,
        max_batches_per_run=matching.max_batches_per_run,
        receive_wait_seconds=matching.receive_wait_seconds,
        max_concurrent_drains=matching.max_concurrent_drains,
        visibility_scale=matching.visibility_scale,
        llm_max_attempts=matching.llm_max_attempts,
        candidate_limit=matching.candidate_limit,
        stuck_after_seconds=matching.stuck_after_seconds,
        admin_document_url=matching.admin_document_url,
    )


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
                                               run_config=pipeline.requeue_run_config)},
    )
