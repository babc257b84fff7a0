"""`work.record_dead`: a part of an entity that died inside another entity's work becomes replayable."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from redrive import work
from redrive.schema import work_items

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def status_of(engine: sa.Engine, ref: str) -> tuple[str, dict]:
    with engine.connect() as conn:
        row = conn.execute(sa.select(work_items).where(work_items.c.entity_ref == ref)).one()
    return row.status, dict(row.payload)


def test_dead_part_becomes_due_on_replay_and_an_open_row_is_not_touched(engine) -> None:
    """A recorded dead part is not claimable; its replay makes it due; an open (leased) row is never buried."""
    with engine.begin() as conn:
        assert work.record_dead(conn, "p", "job-1:d7", stage="send", attempts={"send": 1}, error="INVALID", now=NOW)
        assert work.claim(conn, "p", owner="a", limit=10, lease_seconds=60, now=NOW + timedelta(hours=1)) == []
        assert work.replay(conn, "p", "job-1:d7", dead_letter_id=3, from_start=False, now=NOW)
    assert status_of(engine, "job-1:d7") == ("due", {"replay_of": 3, "replay_from": "failed_stage"})

    with engine.begin() as conn:
        [held] = work.claim(conn, "p", owner="a", limit=10, lease_seconds=60, now=NOW)
        assert not work.record_dead(conn, "p", "job-1:d7", stage="send", attempts={}, error="again", now=NOW)
    assert status_of(engine, "job-1:d7")[0] == "leased"
    with engine.begin() as conn:
        assert work.complete(conn, held, now=NOW)
        assert work.record_dead(conn, "p", "job-1:d7", stage="send", attempts={"send": 2}, error="again", now=NOW)
    assert status_of(engine, "job-1:d7") == ("dead", {})


def test_state_shows_an_operator_when_a_retried_entity_falls_due(engine) -> None:
    """`state` reads back what a reschedule wrote: due time, stage, attempts, error; None for no row."""
    with engine.begin() as conn:
        assert work.state(conn, "p", "job-2") is None
        work.enqueue(conn, "p", "job-2", now=NOW)
        [held] = work.claim(conn, "p", owner="run:1", limit=1, lease_seconds=60, now=NOW)
        assert work.state(conn, "p", "job-2").lease_owner == "run:1"
        work.reschedule(conn, held, due_at=NOW + timedelta(seconds=30), stage="send", attempts={"send": 1},
                        error="PROVIDER_UNAVAILABLE", now=NOW)
        got = work.state(conn, "p", "job-2")
    assert (got.status, got.due_at, got.stage, dict(got.attempts), got.last_error, got.lease_owner) == (
        "due", NOW + timedelta(seconds=30), "send", {"send": 1}, "PROVIDER_UNAVAILABLE", None)
