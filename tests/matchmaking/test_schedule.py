"""The hourly schedule (ADR-0004 "Scheduler Orchestration"), evaluated tick by tick with injected time."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, date, datetime, timedelta

import dagster as dg
import pytest

from assets.matchmaking import policy

DAYS = {
    "America/New_York": [date(2026, 3, 8), date(2026, 11, 1)],  # 2026's US DST changes
    "Europe/Berlin": [date(2026, 3, 29), date(2026, 10, 25)],  # 2026's EU DST changes
    "Asia/Kolkata": [date(2026, 6, 15)],  # UTC+5:30, no DST
}


INSTANCE = dg.DagsterInstance.ephemeral()


@pytest.fixture(scope="module")
def schedule_defs() -> dg.Definitions:
    """The pipeline's definitions for three timezones; schedules need no database."""
    from orchestration.pipelines.matchmaking import pipeline_defs
    from assets.matchmaking.settings import MatchmakingSettings
    from redrive.settings import Settings
    from resources.factory import build_resources

    built = pipeline_defs(Settings(), MatchmakingSettings(timezones=",".join(DAYS)))
    return dg.Definitions(assets=built.assets, jobs=built.jobs, schedules=built.schedules,
                          resources=build_resources(Settings()))


def evaluate(defs: dg.Definitions, at: datetime, *, resolve: bool = False) -> list[dg.RunRequest]:
    """The schedule function at one tick; `resolve` goes through Dagster's full tick evaluation (partition
    keys checked against the job's partitions, tags added), which is slower."""
    schedule = defs.resolve_schedule_def("matchmaking_hourly")
    context = dg.build_schedule_context(instance=INSTANCE, scheduled_execution_time=at,
                                       repository_def=defs.get_repository_def())
    if resolve:
        return list(schedule.evaluate_tick(context).run_requests or [])
    result = schedule(context)
    return [] if isinstance(result, dg.SkipReason) else list(result)


def hours(first: date, last: date):
    at = datetime(first.year, first.month, first.day, tzinfo=UTC)
    while at < datetime(last.year, last.month, last.day, tzinfo=UTC):
        yield at
        at += timedelta(hours=1)


@pytest.mark.parametrize(("tz", "day"), [(tz, d) for tz, days in DAYS.items() for d in days])
def test_each_local_date_gets_exactly_one_run_per_timezone_across_dst(schedule_defs, tz: str, day: date) -> None:
    """Every hourly tick from two days before to two days after: the local date is requested once, at its 9 AM."""
    seen: Counter[tuple[str, str]] = Counter()
    when: dict[tuple[str, str], datetime] = {}
    for at in hours(day - timedelta(days=2), day + timedelta(days=3)):
        for request in evaluate(schedule_defs, at):
            d, zone = str(request.partition_key).split("|")
            seen[(zone, d)] += 1
            when[(zone, d)] = at
    for offset in (-1, 0, 1):
        local = (day + timedelta(days=offset)).isoformat()
        assert seen[(tz, local)] == 1, (tz, local, seen)
    at = when[(tz, day.isoformat())]
    assert policy.offer_instant(day, tz, 9) <= at < policy.offer_instant(day, tz, 9) + timedelta(hours=1)
    assert max(seen.values()) == 1


def test_ticks_fire_at_local_nine_on_the_transition_days(schedule_defs) -> None:
    """New York's 9 AM is 13:00 UTC on the spring-forward day and 14:00 UTC on the fall-back day; Berlin's moves
    from 08:00 to 07:00 and back; Kolkata's 9:00 (03:30 UTC) is picked by the 04:00 tick."""
    def tick_of(tz: str, day: date) -> str:
        for at in hours(day - timedelta(days=1), day + timedelta(days=1)):
            if any(r.partition_key == f"{day.isoformat()}|{tz}" for r in evaluate(schedule_defs, at)):
                return at.strftime("%m-%d %H:%M")
        raise AssertionError("never requested")

    assert tick_of("America/New_York", date(2026, 3, 7)) == "03-07 14:00"
    assert tick_of("America/New_York", date(2026, 3, 8)) == "03-08 13:00"
    assert tick_of("America/New_York", date(2026, 11, 1)) == "11-01 14:00"
    assert tick_of("Europe/Berlin", date(2026, 3, 29)) == "03-29 07:00"
    assert tick_of("Europe/Berlin", date(2026, 10, 25)) == "10-25 08:00"
    assert tick_of("Asia/Kolkata", date(2026, 6, 15)) == "06-15 04:00"


def test_a_repeated_tick_requests_the_same_run_keys_with_no_clock_in_them(schedule_defs) -> None:
    """Evaluating one tick twice yields the same keys (Dagster launches a run key once); keys name the partition."""
    at = datetime(2026, 3, 8, 13, tzinfo=UTC)
    first, second = evaluate(schedule_defs, at, resolve=True), evaluate(schedule_defs, at, resolve=True)
    assert [r.run_key for r in first] == [r.run_key for r in second] == [
        "matchmaking:schedule:2026-03-08:America/New_York:attempt-1"]
    assert first[0].tags["dagster/partition/date"] == "2026-03-08"  # Dagster resolved the partition key
    assert first[0].tags["dagster/partition/timezone"] == "America/New_York"
    assert evaluate(schedule_defs, datetime(2026, 3, 8, 12, tzinfo=UTC)) == []


def test_a_week_of_ticks_is_one_run_per_timezone_per_day(schedule_defs) -> None:
    """168 hourly ticks over a week that contains the US spring-forward: 7 runs per timezone, none twice."""
    counts: Counter[str] = Counter()
    keys: Counter[str] = Counter()
    for at in hours(date(2026, 3, 5), date(2026, 3, 12)):
        for request in evaluate(schedule_defs, at):
            counts[str(request.partition_key).split("|")[1]] += 1
            keys[request.run_key] += 1
    assert max(keys.values()) == 1
    assert counts == dict.fromkeys(DAYS, 7)
