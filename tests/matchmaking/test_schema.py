"""The matchmaking tables: the migration matches the models, and the database itself refuses duplicates."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from assets.matchmaking import repository
from redrive.db import VERSION_TABLE
from orchestration.registry import all_metadata

MINE = {"matchmaking_users", "matchmaking_jobs", "matchmaking_offers"}


def _about_mine(diff: object) -> bool:
    text = repr(diff)
    return any(t in text for t in MINE)


def test_migration_0101_matches_models(engine: sa.Engine) -> None:
    """Alembic sees no difference between migration 0101 and the matchmaking models (other pipelines' drift ignored)."""
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "version_table": VERSION_TABLE})
        diff = compare_metadata(ctx, all_metadata())
    assert [d for d in diff if _about_mine(d)] == []


def _job(conn: sa.Connection, user: str, day: str = "2026-03-08") -> None:
    conn.execute(sa.text("INSERT INTO matchmaking_jobs (date, timezone, user_id, status) "
                         "VALUES (:d, 'America/New_York', :u, 'completed')"), {"d": day, "u": user})


def _offer(conn: sa.Connection, oid: str, user: str, cand: str, rank: int) -> None:
    conn.execute(sa.text(
        "INSERT INTO matchmaking_offers (id, date, timezone, user_id, candidate_id, rank, compatibility_score, "
        "algorithm_version, offered_at, expires_at) VALUES (:i, '2026-03-08', 'America/New_York', :u, :c, :r, 0.5, "
        "'v', '2026-03-08 13:00Z', '2026-03-09 13:00Z')"), {"i": oid, "u": user, "c": cand, "r": rank})


def test_database_refuses_a_second_offer_set_and_a_second_job(engine: sa.Engine) -> None:
    """Same offer id, same (date, user, rank), a second job for (date, user), an offer without its job: all refused."""
    a, b, c = ("00000000-0000-0000-0000-00000000000a", "00000000-0000-0000-0000-00000000000b",
               "00000000-0000-0000-0000-00000000000c")
    with engine.begin() as conn:
        for u in (a, b, c):
            conn.execute(sa.insert(repository.matchmaking_users).values(id=u, timezone="America/New_York"))
        _job(conn, a)
        _offer(conn, "10000000-0000-0000-0000-000000000001", a, b, 1)
    attempts = [
        lambda conn: _offer(conn, "10000000-0000-0000-0000-000000000001", a, c, 2),  # same id
        lambda conn: _offer(conn, "10000000-0000-0000-0000-000000000002", a, c, 1),  # same rank: a second set
        lambda conn: _job(conn, a),  # a second job for the day
        lambda conn: _offer(conn, "10000000-0000-0000-0000-000000000003", b, a, 1),  # b has no job
        lambda conn: _offer(conn, "10000000-0000-0000-0000-000000000004", a, a, 2),  # to themself
    ]
    for attempt in attempts:
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            attempt(conn)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM matchmaking_offers")).scalar() == 1
