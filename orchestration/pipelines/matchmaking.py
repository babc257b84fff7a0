"""What the matchmaking pipeline adds to the code location: asset, job, hourly schedule, replay target."""

from __future__ import annotations

from assets.matchmaking import pipeline
from assets.matchmaking.settings import MatchmakingSettings
from orchestration.registry import PipelineDefs
from redrive.settings import Settings
from sensors.core import ReplayTarget
from sensors.matchmaking import matchmaking_schedule


def pipeline_defs(settings: Settings, matchmaking: MatchmakingSettings | None = None) -> PipelineDefs:
    mm = matchmaking or MatchmakingSettings()  # MATCHMAKING_* read now, when definitions are built
    built = pipeline.build(mm)
    return PipelineDefs(
        name=pipeline.PIPELINE,
        assets=[built.asset],
        jobs=[built.job],
        schedules=[matchmaking_schedule(built.job, mm.timezones, mm.offer_hour, mm.start_date)],
        # dead letters are per user ({date}:{tz}:{user}) or, for a failed load, per partition ({date}:{tz})
        replay_targets={pipeline.PIPELINE: ReplayTarget(job=built.job, run_config=pipeline.replay_run_config,
                                                        partition_key=pipeline.replay_partition_key,
                                                        batch_run_config=pipeline.batch_replay_run_config)},
    )
