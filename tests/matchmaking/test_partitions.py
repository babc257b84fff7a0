"""Partitions as backfills use them: any dates × timezones, each run confined to its own (date, timezone)."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa

from tests.matchmaking.conftest import jobs, run


def test_a_backfill_of_dates_by_timezones_gives_each_partition_its_own_jobs(mm_defs, instance, engine,
                                                                           population) -> None:
    """Two dates × two timezones, one run each as a UI backfill launches them: jobs and offers stay in their
    partition, offers are dated by it, and the days' scores differ (the variety term is seeded by the date)."""
    ny = population(12, tz="America/New_York", tag="ny", regions=1)
    berlin = population(9, tz="Europe/Berlin", tag="be", regions=1)
    for day in ("2026-03-28", "2026-03-29"):  # Berlin moves its clocks on the 29th
        for tz in ("America/New_York", "Europe/Berlin"):
            assert run(mm_defs, instance, f"{day}|{tz}").success
    with engine.connect() as conn:
        counts = dict(conn.execute(sa.text(
            "SELECT date::text || '|' || timezone, count(*) FROM matchmaking_jobs GROUP BY 1")).all())
        windows = set(conn.execute(sa.text(
            "SELECT DISTINCT date::text, timezone, offered_at FROM matchmaking_offers")))
        per_day = {d: set(r) for d, r in conn.execute(sa.text(
            "SELECT date::text, array_agg(user_id::text || '>' || candidate_id::text || '=' || compatibility_score) "
            "FROM matchmaking_offers "
            "GROUP BY date")).all()}
    assert counts == {"2026-03-28|America/New_York": 12, "2026-03-29|America/New_York": 12,
                      "2026-03-28|Europe/Berlin": 9, "2026-03-29|Europe/Berlin": 9}
    assert windows == {
        ("2026-03-28", "America/New_York", datetime(2026, 3, 28, 13, tzinfo=UTC)),
        ("2026-03-29", "America/New_York", datetime(2026, 3, 29, 13, tzinfo=UTC)),
        ("2026-03-28", "Europe/Berlin", datetime(2026, 3, 28, 8, tzinfo=UTC)),
        ("2026-03-29", "Europe/Berlin", datetime(2026, 3, 29, 7, tzinfo=UTC)),
    }
    assert per_day["2026-03-28"] != per_day["2026-03-29"]  # the variety term is seeded by the date
    assert {r["id"] for r in ny}.isdisjoint({r["id"] for r in berlin})


def test_an_empty_timezone_partition_succeeds_with_nothing_to_do(mm_defs, instance, engine) -> None:
    """No users in the timezone: the run succeeds, writes nothing, and the checks pass (nothing to complete)."""
    result = run(mm_defs, instance, "2026-06-15|Asia/Kolkata")
    assert result.success
    meta = result.asset_materializations_for_node("daily_match_offers")[0].metadata
    assert meta["eligible_users"].value == 0 and meta["jobs_completed"].value == 0
    assert all(e.passed for e in result.get_asset_check_evaluations())
    assert jobs(engine) == {}
