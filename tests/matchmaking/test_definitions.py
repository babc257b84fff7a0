"""Matchmaking in the code location: what it registers, and configuration errors that stop it early and clearly."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from assets.matchmaking.settings import MatchmakingSettings


def test_code_location_registers_asset_job_schedule_and_replay(defs) -> None:
    """The real registry builds the asset, its checks, the job, the hourly schedule and the replay/retry sensors."""
    job = defs.resolve_job_def("matchmaking_job")
    assert job.partitions_def is not None
    assert defs.resolve_schedule_def("matchmaking_hourly").job_name == "matchmaking_job"
    assert defs.resolve_sensor_def("matchmaking_deferred_retries").job_name == "matchmaking_job"
    assert "matchmaking_job" in {j.name for j in defs.resolve_sensor_def("redrive_dead_letter_replays").jobs}
    checks = {k.name for k in defs.resolve_asset_graph().asset_check_keys}
    assert {"zero_duplicate_offers", "completion_rate_at_least_99_9_percent"} <= checks


def test_partitions_are_every_date_times_every_configured_timezone(mm_defs) -> None:
    """Backfills pick from date × timezone; a date's partition exists up to two days ahead (UTC+14 zones' 9 AM)."""
    partitions = mm_defs.resolve_job_def("matchmaking_job").partitions_def
    keys = set(partitions.get_partition_keys())
    for tz in ("America/New_York", "Europe/Berlin", "Asia/Kolkata"):
        assert f"2026-01-01|{tz}" in keys and f"2026-03-08|{tz}" in keys
    assert not any(k.startswith("2025-12-31") for k in keys)


@pytest.mark.parametrize(("env", "message"), [
    ({"MATCHMAKING_TIMEZONES": "America/New_York,Mars/Olympus_Mons"}, "'Mars/Olympus_Mons' is not an IANA timezone"),
    ({"MATCHMAKING_TIMEZONES": "UTC,UTC"}, "twice"),
    ({"MATCHMAKING_DAILY_OFFER_COUNT": "0"}, "MATCHMAKING_DAILY_OFFER_COUNT"),
    ({"DAILY_OFFER_COUNT": "500"}, "DAILY_OFFER_COUNT"),
    ({"MATCHMAKING_OFFER_HOUR": "24"}, "offer_hour"),
])
def test_bad_settings_fail_when_definitions_are_built(monkeypatch, env: dict[str, str], message: str) -> None:
    """A misconfigured MATCHMAKING_* variable is a one-line validation error naming it, not a broken run later."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError, match=message):
        MatchmakingSettings()


def test_adr_name_daily_offer_count_is_honoured(monkeypatch) -> None:
    """DAILY_OFFER_COUNT (the ADR's name) and MATCHMAKING_DAILY_OFFER_COUNT both set the offer count."""
    monkeypatch.setenv("DAILY_OFFER_COUNT", "5")
    assert MatchmakingSettings().daily_offer_count == 5
    monkeypatch.setenv("MATCHMAKING_DAILY_OFFER_COUNT", "7")
    assert MatchmakingSettings().daily_offer_count == 7
