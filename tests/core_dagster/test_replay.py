"""§8.5 replay through the operator command and the replay sensor, on the two-stage rehearsal pipeline."""

from __future__ import annotations

import json

import sqlalchemy as sa
from click.testing import CliRunner

from assets.rehearsal import pipeline as rehearsal
from orchestration.cli import app
from redrive.schema import dead_letters
from tests.dagster_helpers import launch, tick


def cli(db_url: str, *args: str):
    return CliRunner().invoke(app, list(args), env={"DATABASE_URL": db_url}, catch_exceptions=False)


def fail_ask_with_401(defs, instance, sandbox, request_id: str) -> int:
    sandbox.script("llm", {"status": 401})
    result = defs.resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config(request_id, {}), instance=instance, raise_on_error=False)
    assert not result.success
    listed = json.loads(cli(defs.resources["database"].database_url, "dlq", "list", "--json").output)
    assert [(d["stage"], d["error_class"], d["status"]) for d in listed] == [("ask", "AUTH_DENIED", "open")]
    return listed[0]["id"]


def test_replay_after_fix_runs_from_failed_stage_and_closes(defs, instance, engine, sandbox, db_url,
                                                            rehearsal_request) -> None:
    """The ask stage dead-letters; after the fix, a replay runs ask only and the artifact was fetched once."""
    letter_id = fail_ask_with_401(defs, instance, sandbox, rehearsal_request)
    assert sandbox.count("store.fetch") == 1

    sandbox.set_default("llm", content='{"verdict": "fair"}')  # the cause is fixed upstream
    out = cli(db_url, "dlq", "replay", str(letter_id), "--note", "INC-42: API key rotated", "--confirm-safe")
    assert out.exit_code == 0, out.output
    requests = tick(defs, instance, "redrive_dead_letter_replays")
    assert [r.run_key for r in requests] == ["rehearsal:run:req-1:replay-1"]
    assert tick(defs, instance, "redrive_dead_letter_replays")[0].run_key == requests[0].run_key  # same key again

    result = launch(defs, instance, requests[0])
    assert result.success
    assert sandbox.count("store.fetch") == 1  # fetch reused its checkpoint: fetched once in all
    assert [r["step"] for r in sandbox.requests("llm")] == ["status:401", "ok"]
    with engine.connect() as conn:
        letter = conn.execute(sa.select(dead_letters)).one()
        verdict = conn.execute(sa.text("SELECT result FROM rehearsal_requests")).scalar()
    assert letter.status == "resolved" and letter.resolved_at is not None
    assert [n["kind"] for n in letter.notes] == ["dead_lettered", "replay_requested", "replay_succeeded"]
    assert verdict == {"verdict": "fair"}
    assert tick(defs, instance, "redrive_dead_letter_replays") == []


def test_replay_with_cause_remaining_redeadletters_and_escalates(defs, instance, engine, sandbox, db_url,
                                                                 rehearsal_request) -> None:
    """Same non-retryable class after replay: the letter is escalated and Slack hears about it once more."""
    letter_id = fail_ask_with_401(defs, instance, sandbox, rehearsal_request)
    assert sandbox.count("slack.message") == 1
    cli(db_url, "dlq", "replay", str(letter_id), "--note", "INC-43: tried a new key", "--confirm-safe")
    sandbox.script("llm", {"status": 401})
    [request] = tick(defs, instance, "redrive_dead_letter_replays")
    assert not launch(defs, instance, request).success

    shown = json.loads(cli(db_url, "dlq", "show", str(letter_id), "--json").output)
    assert shown["status"] == "escalated" and shown["escalated_at"]
    assert shown["replay_count"] == 1 and shown["occurrences"] == 2
    assert [n["kind"] for n in shown["notes"]][-1] == "replay_failed_escalated"
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar() == 1
    slack = sandbox.effects("slack.message")
    assert len(slack) == 2 and "escalated" in slack[1]["payload"]["text"]
    assert sandbox.count("store.fetch") == 1


def test_replay_without_remediation_evidence_is_refused(defs, instance, sandbox, db_url, rehearsal_request) -> None:
    """No --note, or no --confirm-safe: a clear one-line refusal and nothing is replayed."""
    letter_id = fail_ask_with_401(defs, instance, sandbox, rehearsal_request)
    out = cli(db_url, "dlq", "replay", str(letter_id), "--confirm-safe")
    assert out.exit_code == 2
    assert "remediation evidence" in out.output and "Traceback" not in out.output
    out = cli(db_url, "dlq", "replay", str(letter_id), "--note", "INC-44")
    assert out.exit_code == 2 and "confirm" in out.output
    assert tick(defs, instance, "redrive_dead_letter_replays") == []


def test_full_restart_refetches(defs, instance, sandbox, db_url, rehearsal_request) -> None:
    """--from-start clears the stage checkpoints, so fetch runs again."""
    letter_id = fail_ask_with_401(defs, instance, sandbox, rehearsal_request)
    sandbox.set_default("llm", content='{"verdict": "ok"}')
    cli(db_url, "dlq", "replay", str(letter_id), "--note", "INC-45: source corrected", "--confirm-safe",
        "--from-start")
    [request] = tick(defs, instance, "redrive_dead_letter_replays")
    assert launch(defs, instance, request).success
    assert sandbox.count("store.fetch") == 2
