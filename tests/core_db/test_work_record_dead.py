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
