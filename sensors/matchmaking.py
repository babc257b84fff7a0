"""Matchmaking's schedule (ADR-0004 "Scheduler Orchestration"): an hourly tick that requests the
(date, timezone) partitions where the local offer hour has just come. It decides and requests; the
runs do the work."""

# No `from __future__ import annotations`: Dagster reads the context type from live annotations.

from collections.abc import Sequence
from datetime import UTC, date, datetime

import dagster as dg

from assets.matchmaking import policy
from assets.matchmaking.pipeline import key_of
from redrive.run_keys import run_key


def schedule_requests(tick: datetime, timezones: Sequence[str], hour: int, start: date) -> list[dg.RunRequest]:
    """One request per partition due at this tick; its run key names the partition only (no clock), so
    a repeated or overlapping tick starts nothing new."""
    return [
        dg.RunRequest(
            run_key=run_key(policy.PIPELINE, p.entity_ref, attempt=1, purpose="schedule"),
            partition_key=key_of(p),
            tags={"redrive/pipeline": policy.PIPELINE},
        )
        for p in policy.partitions_due(tick, timezones, hour, start=start)
    ]


def matchmaking_schedule(job, timezones: Sequence[str], hour: int, start: date) -> dg.ScheduleDefinition:
    @dg.schedule(name="matchmaking_hourly", cron_schedule="0 * * * *", execution_timezone="UTC", job=job,
                 default_status=dg.DefaultScheduleStatus.RUNNING,
                 description="Every hour on the hour: the timezones where it has just turned the offer hour (9 AM) locally.")
    def _schedule(context: dg.ScheduleEvaluationContext):
        tick = context.scheduled_execution_time or datetime.now(UTC)  # manual evaluation without a tick time
        requests = schedule_requests(tick, timezones, hour, start)
        return requests or dg.SkipReason(
            f"no timezone reached {hour:02d}:00 local in the hour to {tick:%Y-%m-%d %H:%M} UTC")

    return _schedule
