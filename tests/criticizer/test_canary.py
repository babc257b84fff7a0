"""Canary secrets in a request's headers, its prompt and an upstream error body reach no dead letter, Slack or log."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._serdes import serialize_value

from orchestration.definitions import build_definitions
from redrive import deadletters
from redrive.schema import alerts, dead_letters, stage_checkpoints

WEBHOOK_TOKEN = "whk-canary-0b9a8c7d6e5f"  # no known secret shape: only never copying it keeps it out
API_KEY_HEADER = "canary-apikey-31337"
LLM_KEY = "sk-canary-llmkey-9f8e7d6c5b4a3928"
PROMPT = "PROMPT-7781 merger code name BLUEFIN"
PII = "jane.doe.canary@example.com"
CANARIES = (WEBHOOK_TOKEN, API_KEY_HEADER, LLM_KEY, PROMPT, "BLUEFIN", PII)


def everything_recorded(instance: dg.DagsterInstance, engine: sa.Engine, sandbox, caplog) -> str:
    """All an operator, a log reader, Slack or a replay could see: rows, messages, logs, Dagster's runs and events."""
    with engine.connect() as conn:
        letters = [dict(r._mapping) for r in conn.execute(sa.select(dead_letters))]
        alert_rows = [dict(r._mapping) for r in conn.execute(sa.select(alerts))]
        checkpoints = [dict(r._mapping) for r in conn.execute(sa.select(stage_checkpoints))]
    assert letters, "the scenario must dead-letter something, or the test proves nothing"
    runs = instance.get_runs()
    parts = [
        json.dumps(letters, default=str), json.dumps(alert_rows, default=str), json.dumps(checkpoints, default=str),
        json.dumps(sandbox.effects()), json.dumps(sandbox.requests()), caplog.text,
        *[json.dumps(run.run_config, default=str) + json.dumps(run.tags) for run in runs],
        *[serialize_value(entry) for run in runs for entry in instance.all_logs(run.run_id)],
    ]
    return "\n".join(parts)


def assert_no_canary(seen: str) -> None:
    leaked = [c for c in CANARIES if c in seen]
    assert leaked == []


@pytest.fixture
def canary_defs(crit_settings) -> dg.Definitions:
    return build_definitions(crit_settings.model_copy(update={"llm_api_key": LLM_KEY}))


def _submit_canary_request(submit) -> str:
    return submit("canary", rubric=f"{PROMPT}. Escalate to {PII} if the diff leaks it.",
                  headers={"Authorization": f"Bearer {WEBHOOK_TOKEN}", "X-Api-Key": API_KEY_HEADER})


def fail_with(canary_defs, run, submit, instance, engine, sandbox, caplog, route: str, error: dict) -> tuple[str, object]:
    """Submit the canary request, make `route` answer `error`, and return all that was recorded and the dead letter."""
    caplog.set_level(logging.DEBUG)
    sandbox.script(route, error)
    assert not run(_submit_canary_request(submit), defs=canary_defs).success
    seen = everything_recorded(instance, engine, sandbox, caplog)
    with engine.connect() as conn:
        return seen, conn.execute(sa.select(dead_letters)).one()


def test_webhook_error_echoing_headers_and_prompt_leaks_nothing(canary_defs, run, submit, instance, engine, sandbox,
                                                                caplog) -> None:
    """The webhook answers 401 with a body echoing its token, the API key header, the prompt and PII: none survives."""
    seen, letter = fail_with(canary_defs, run, submit, instance, engine, sandbox, caplog, "slack", {
        "status": 401, "json": {"error": {"code": "invalid_token", "message": f"Bearer {WEBHOOK_TOKEN} / X-Api-Key "
                                          f"{API_KEY_HEADER} rejected for payload '{PROMPT}' from {PII}"}}})
    assert_no_canary(seen)
    assert (letter.stage, letter.error_class) == ("notify", "AUTH_DENIED")
    assert letter.sanitized_context["webhook_header_names"] == ["authorization", "x-api-key"]
    assert "upstream answered 401 (invalid_token)" in letter.last_stack  # the stack is kept, its secrets are not
    [alert] = [e for e in sandbox.effects("slack.message") if e["path"] == "redrive-alerts"]
    assert "AUTH_DENIED" in alert["payload"]["text"]


def test_llm_error_echoing_the_prompt_and_key_leaks_nothing(canary_defs, run, submit, instance, engine, sandbox,
                                                            caplog) -> None:
    """The LLM answers 400 context_length_exceeded quoting the prompt and the API key: dead letter and logs stay clean."""
    seen, letter = fail_with(canary_defs, run, submit, instance, engine, sandbox, caplog, "llm", {
        "status": 400, "json": {"error": {
            "code": "context_length_exceeded", "type": "invalid_request_error",
            "message": f"Key {LLM_KEY}: your messages ('{PROMPT}', {PII}) exceed the context window"}}})
    assert_no_canary(seen)
    assert (letter.stage, letter.error_class) == ("llm", "CONTEXT_LENGTH_EXCEEDED")
    assert letter.sanitized_context["rubric_sha256"] and letter.payload_ref["fingerprint"]


def test_a_delivered_critique_carries_the_headers_to_the_webhook_only(canary_defs, run, submit, instance, engine,
                                                                      sandbox, caplog) -> None:
    """On success the webhook gets its credentials (header names in the sandbox log), nothing else records them."""
    caplog.set_level(logging.DEBUG)
    request_id = _submit_canary_request(submit)
    sandbox.script("llm", {"status": 401})  # first a dead letter, so the replay path is covered too
    assert not run(request_id, defs=canary_defs).success
    with engine.begin() as conn:
        [letter] = deadletters.list_(conn)
        deadletters.request_replay(conn, letter.id, evidence="INC-1 key fixed", confirm_safe=True,
                                   at=datetime.now(UTC))
    assert run(request_id, defs=canary_defs).success
    seen = everything_recorded(instance, engine, sandbox, caplog)
    assert_no_canary(seen)
    [delivery] = [r for r in sandbox.requests("slack") if r["path"].endswith("/requester/canary")]
    assert {"authorization", "x-api-key"} <= set(delivery["header_names"])
