"""Bulk redrive by filter at a bounded rate, and the operator command's table and JSON."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from redrive import deadletters
from redrive.bulk import bulk_replay, pacing
from redrive.clock import FrozenClock
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from orchestration.cli import app

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def seed(engine: sa.Engine, n: int, code: Code = Code.UPSTREAM_UNAVAILABLE, pipeline: str = "evidence",
         start: datetime = T0) -> None:
    with engine.begin() as conn:
        for i in range(n):
            deadletters.record(conn, FinalFailure(pipeline=pipeline, stage="attach", entity_ref=f"{pipeline}-{code}-{i}",
                                                  failure=Failure.of(code), attempts=3,
                                                  at=start + timedelta(minutes=i)))


def test_pacing_is_evenly_spaced() -> None:
    """rate 4/s → offsets 0, 0.25, 0.5…; a zero rate is refused."""
    assert pacing(4, 4.0) == [0.0, 0.25, 0.5, 0.75]
    with pytest.raises(ValueError):
        pacing(3, 0)


def test_bulk_replay_filters_and_paces(engine) -> None:
    """Only the filtered letters are replayed, at the given rate (measured on an injected clock)."""
    seed(engine, 6)
    seed(engine, 3, code=Code.AUTH_DENIED)
    seed(engine, 2, pipeline="matching")
    clock = FrozenClock(T0)
    report = bulk_replay(engine, deadletters.Filter(pipeline="evidence", error_class="UPSTREAM_UNAVAILABLE"),
                         evidence="INC-7: upstream recovered", confirm_safe=True, rate=2.0, clock=clock,
                         sleep=clock.sleep)
    assert report.requested == 6 and report.refused == 0
    assert clock.sleeps == [0.5] * 5  # 6 replays at 2/s span 2.5 s
    with engine.connect() as conn:
        statuses = dict(conn.execute(sa.text(
            "SELECT error_class || ':' || pipeline, string_agg(DISTINCT status, ',') FROM dead_letters GROUP BY 1")).all())
    assert statuses == {"UPSTREAM_UNAVAILABLE:evidence": "replaying", "AUTH_DENIED:evidence": "open",
                        "UPSTREAM_UNAVAILABLE:matching": "open"}


def test_bulk_replay_by_time_range(engine) -> None:
    """since/until select by last failure time."""
    seed(engine, 10)
    clock = FrozenClock(T0)
    report = bulk_replay(engine, deadletters.Filter(pipeline="evidence", since=T0 + timedelta(minutes=3),
                                                    until=T0 + timedelta(minutes=6)),
                         evidence="INC-8", confirm_safe=True, rate=100, clock=clock, sleep=clock.sleep)
    assert report.requested == 3


def test_bulk_replay_without_confirmation_refuses_each(engine) -> None:
    """The §8.5 gate holds in bulk too."""
    seed(engine, 2)
    clock = FrozenClock(T0)
    report = bulk_replay(engine, deadletters.Filter(pipeline="evidence"), evidence="INC-9", confirm_safe=False,
                         rate=10, clock=clock, sleep=clock.sleep)
    assert report.requested == 0 and report.refused == 2


def test_cli_list_show_resolve(engine, db_url) -> None:
    """`dlq list` prints a table, `--json` parses, `show` has triage fields, `resolve` needs a note."""
    seed(engine, 2)
    run = lambda *a: CliRunner().invoke(app, list(a), env={"DATABASE_URL": db_url})  # noqa: E731
    table = run("dlq", "list").output.splitlines()
    assert table[0].split()[:5] == ["id", "pipeline", "stage", "entity", "error_class"]
    assert len(table) == 4
    rows = json.loads(run("dlq", "list", "--json").output)
    assert {r["error_class"] for r in rows} == {"UPSTREAM_UNAVAILABLE"}
    shown = run("dlq", "show", str(rows[0]["id"])).output
    for field in ("error_class", "stage", "attempts", "first_failure_at", "last_failure_at", "last_stack"):
        assert field in shown
    refused = run("dlq", "resolve", str(rows[0]["id"]))
    assert refused.exit_code == 2 and "note" in refused.output
    done = run("dlq", "resolve", str(rows[0]["id"]), "--note", "redone by hand")
    assert done.exit_code == 0
    assert len(json.loads(run("dlq", "list", "--json").output)) == 1
    missing = run("dlq", "show", "999999")
    assert missing.exit_code == 2 and "does not exist" in missing.output
