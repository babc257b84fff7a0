"""What the conversion pipeline adds to the code location."""

from __future__ import annotations

from assets.conversion import pipeline, repository
from assets.conversion.settings import PIPELINE, ConversionSettings
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from resources.conversion import ConversionResource
from sensors.conversion import conversion_worker_sensor
from sensors.core import ReplayTarget


def pipeline_defs(settings: Settings) -> PipelineDefs:
    knobs = ConversionSettings()  # 003 §7 knobs, read now (when definitions are built)
    return PipelineDefs(
        name=PIPELINE,
        jobs=[pipeline.conversion_worker_job, pipeline.conversion_breaker_probe_job, pipeline.conversion_replay_job],
        sensors=[conversion_worker_sensor()],
        resources={"conversion": ConversionResource.from_settings(knobs, knobs.gateway_base_url(settings))},
        failed_for_good={PIPELINE: repository.failed_for_good},
        replay_targets={PIPELINE: ReplayTarget(job=pipeline.conversion_replay_job,
                                               run_config=pipeline.replay_run_config,
                                               batch_run_config=pipeline.batch_replay_run_config)},
    )
