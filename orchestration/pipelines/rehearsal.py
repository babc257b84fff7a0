"""What the rehearsal pipeline adds to the code location."""

from __future__ import annotations

from assets.rehearsal import pipeline
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from sensors.core import ReplayTarget


def pipeline_defs(settings: Settings) -> PipelineDefs:
    return PipelineDefs(
        name=pipeline.PIPELINE,
        jobs=[pipeline.rehearsal_job],
        replay_targets={pipeline.PIPELINE: ReplayTarget(job=pipeline.rehearsal_job, run_config=pipeline.run_config)},
    )
