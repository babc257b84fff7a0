"""Issue 27: what the `redrive` command tells an operator is true (who runs a replay, which breakers exist)."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from click.testing import CliRunner

from orchestration.cli import app, replay_starter
from redrive import breaker, deadletters, work
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def cli(db_url: str, *args: str):
    result = CliRunner().invoke(app, list(args), env={"DATABASE_URL": db_url}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def letter(engine: sa.Engine, pipeline: str, entity: str) -> int:
    with engine.begin() as conn:
        return deadletters.record(conn, FinalFailure(pipeline=pipeline, stage="attach", entity_ref=entity,
                                                     failure=Failure.of(Code.UPSTREAM_UNAVAILABLE), attempts=3,
                                                     at=T0)).dead_letter.id


def test_replay_starter_names_the_sensor_that_runs_it() -> None:
    """Pure: a work row's replay is a drain run of its pipeline's due-work sensor; anything else the replay sensor's."""
    assert "criticizer_due_work sensor's next drain run" in replay_starter("criticizer", drained=True)
    assert replay_starter("matchmaking", drained=False) == "the redrive_dead_letter_replays sensor starts the run"


def test_dlq_replay_names_the_due_work_sensor_for_a_drained_entity_and_the_replay_sensor_otherwise(
        engine, db_url) -> None:
    """One evidence pipeline, two kinds of entity: a row (a work row) and a file job (a run of its partition)."""
    with engine.begin() as conn:
        work.enqueue(conn, "evidence", "job-1/row-1", now=T0)
    row, file_job = letter(engine, "evidence", "job-1/row-1"), letter(engine, "evidence", "job-1")
    said = cli(db_url, "dlq", "replay", str(row), "--note", "INC-1: fixed", "--confirm-safe")
    assert "evidence_due_work sensor's next drain run replays it" in said and "redrive_dead_letter_replays" not in said
    said = cli(db_url, "dlq", "replay", str(file_job), "--note", "INC-1: fixed", "--confirm-safe")
    assert "the redrive_dead_letter_replays sensor starts the run" in said


def test_redrive_breaker_lists_a_breaker_that_guarded_calls_but_never_opened(engine, db_url) -> None:
    """Calls recorded, breaker still closed: `redrive breaker` shows it with its window, not "no breaker yet"."""
    assert cli(db_url, "breaker") == "no breaker has recorded a call yet\n"
    with engine.begin() as conn:
        for ok in (True, True, False):
            breaker.record_call(conn, "pdf-gateway", ok, 12.0, T0, breaker.BreakerPolicy())
    assert cli(db_url, "breaker").startswith("pdf-gateway: closed; 1 of the last 3 calls failed")
