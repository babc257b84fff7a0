"""§8.5 on the criticizer: triage, the remediation gate, replay from the failed stage, closing, escalation."""

from __future__ import annotations

import json

import sqlalchemy as sa
from click.testing import CliRunner

from assets.criticizer import api
from orchestration.cli import app
from redrive.schema import dead_letters
from tests.criticizer.conftest import ALERTS_PATH, RESULTS_PATH, slack_posts, webhook_posts
from tests.dagster_helpers import launch, tick


def cli(db_url: str, *args: str):
    return CliRunner().invoke(app, list(args), env={"DATABASE_URL": db_url}, catch_exceptions=False)


def exhaust_llm(run, submit, sandbox, db_url: str) -> int:
    request_id = submit("replay-me")
    sandbox.script("llm", *[{"status": 503}] * 5)
    assert not run(request_id).success
    listed = json.loads(cli(db_url, "dlq", "list", "--pipeline", "criticizer", "--json").output)
    assert [(d["stage"], d["error_class"], d["attempts"], d["status"]) for d in listed] == [
        ("llm", "NETWORK_TRANSIENT", 5, "open")]
    return listed[0]["id"]


def test_replay_after_llm_exhaustion_runs_llm_and_notify_only(cdefs, run, submit, engine, sandbox, db_url,
                                                               instance) -> None:
    """The fetch output survives llm's exhaustion; the replay reuses it: the artifact is fetched once in all."""
    letter_id = exhaust_llm(run, submit, sandbox, db_url)
    shown = cli(db_url, "dlq", "show", str(letter_id))  # triage: class, stage, attempts, context
    assert "error_class: NETWORK_TRANSIENT" in shown.output and "stage: llm" in shown.output
    triage = json.loads(cli(db_url, "dlq", "show", str(letter_id), "--json").output)
    assert triage["stage_attempts"] == {"fetch": 1, "llm": 5} and triage["sanitized_context"]["failing_since"]

    out = cli(db_url, "dlq", "replay", str(letter_id), "--note", "INC-7: LLM provider recovered", "--confirm-safe")
    assert out.exit_code == 0 and "from stage llm" in out.output
    assert tick(cdefs, instance, "redrive_dead_letter_replays") == []  # no run per letter: the row is due again
    [request] = tick(cdefs, instance, "criticizer_due_work")
    assert request.run_key == "criticizer:drain:round-2"  # round 1 was the run that dead-lettered it
    replay = launch(cdefs, instance, request)
    assert replay.success and replay.output_for_node("criticizer_drain")["done"] == 1

    assert sandbox.count("store.fetch") == 1  # fetched once in all: fetch's checkpoint served the replay
    assert [r["step"] for r in sandbox.requests("llm")] == ["status:503"] * 5 + ["ok"]
    assert len(webhook_posts(sandbox, "replay-me")) == 1 and len(slack_posts(sandbox, RESULTS_PATH)) == 1

    with engine.connect() as conn:
        letter = conn.execute(sa.select(dead_letters)).one()
    assert letter.status == "resolved" and letter.resolved_at is not None
    assert [n["kind"] for n in letter.notes] == ["dead_lettered", "replay_requested", "replay_succeeded"]
    assert letter.remediation_evidence == "INC-7: LLM provider recovered"
    found = api.status(engine, "replay-me")
    assert found.status == "done" and found.stage_attempts == {"fetch": 1, "llm": 1, "notify": 1}
    assert tick(cdefs, instance, "redrive_dead_letter_replays") == []


def test_replay_without_remediation_evidence_is_refused(cdefs, run, submit, sandbox, db_url, instance) -> None:
    """No --note, or no --confirm-safe: `redrive dlq replay` refuses in one clear line and nothing runs."""
    letter_id = exhaust_llm(run, submit, sandbox, db_url)
    out = cli(db_url, "dlq", "replay", str(letter_id), "--confirm-safe")
    assert out.exit_code == 2
    assert out.output.strip() == ("error: replay refused: record the remediation evidence first "
                                  "(--note 'ticket/incident and what was fixed')")
    blank = cli(db_url, "dlq", "replay", str(letter_id), "--note", "   ", "--confirm-safe")
    assert blank.exit_code == 2 and "remediation evidence" in blank.output
    unconfirmed = cli(db_url, "dlq", "replay", str(letter_id), "--note", "INC-8: recovered")
    assert unconfirmed.exit_code == 2 and "--confirm-safe" in unconfirmed.output
    assert tick(cdefs, instance, "criticizer_due_work") == []
    shown = json.loads(cli(db_url, "dlq", "show", str(letter_id), "--json").output)
    assert shown["status"] == "open" and shown["replay_count"] == 0 and shown["remediation_evidence"] is None


def test_same_non_retryable_class_after_replay_redeadletters_and_escalates(cdefs, run, submit, engine, sandbox,
                                                                            db_url, instance) -> None:
    """A webhook 401 replayed without a real fix: one dead letter, escalated, and Slack hears of the escalation."""
    request_id = submit("escalate")
    sandbox.script("slack", {"status": 401})
    assert not run(request_id).success
    [letter] = json.loads(cli(db_url, "dlq", "list", "--json").output)
    assert (letter["stage"], letter["error_class"]) == ("notify", "AUTH_DENIED")

    cli(db_url, "dlq", "replay", str(letter["id"]), "--note", "INC-9: rotated the webhook token", "--confirm-safe")
    sandbox.script("slack", {"status": 401})  # the token was not the problem
    [request] = tick(cdefs, instance, "criticizer_due_work")
    assert launch(cdefs, instance, request).output_for_node("criticizer_drain")["dead_lettered"] == 1

    shown = json.loads(cli(db_url, "dlq", "show", str(letter["id"]), "--json").output)
    assert shown["status"] == "escalated" and shown["escalated_at"] and shown["occurrences"] == 2
    assert [n["kind"] for n in shown["notes"]] == ["dead_lettered", "replay_requested", "replay_failed_escalated"]
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar() == 1
    alerts = slack_posts(sandbox, ALERTS_PATH)
    assert len(alerts) == 2 and "escalated for engineering review" in alerts[1]["payload"]["text"]
    assert sandbox.count("store.fetch") == 1 and sandbox.count("llm.call") == 1  # fetch and llm were reused
    assert api.status(engine, request_id).status == "dead_lettered"


def test_full_restart_refetches_and_recritiques(cdefs, run, submit, engine, sandbox, db_url, instance) -> None:
    """--from-start clears the checkpoints: fetch and llm run again, and the critique is delivered once."""
    request_id = submit("restart")
    sandbox.script("slack", {"status": 404})  # the destination channel was deleted
    assert not run(request_id).success
    [letter] = json.loads(cli(db_url, "dlq", "list", "--json").output)
    out = cli(db_url, "dlq", "replay", str(letter["id"]), "--note", "INC-10: channel recreated", "--confirm-safe",
              "--from-start")
    assert out.exit_code == 0 and "from all stages" in out.output
    [request] = tick(cdefs, instance, "criticizer_due_work")
    assert launch(cdefs, instance, request).output_for_node("criticizer_drain")["done"] == 1
    assert sandbox.count("store.fetch") == 2 and sandbox.count("llm.call") == 2
    assert len(webhook_posts(sandbox, "restart")) == 1
    assert api.status(engine, request_id).status == "done"
