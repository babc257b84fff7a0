"""Secrets planted in a header, a prompt and an exception message reach no dead letter, alert or log."""

from __future__ import annotations

import json
import logging

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._serdes import serialize_value

from assets.rehearsal import pipeline as rehearsal
from assets.rehearsal import repository
from orchestration.definitions import build_definitions
from redrive.schema import alerts, dead_letters

CANARY = "sk-canary-9f8e7d6c5b4a39281706"
PII = "jane.doe.canary@example.com"


def everything_recorded(instance: dg.DagsterInstance, run_id: str, engine: sa.Engine, sandbox,
                        caplog: pytest.LogCaptureFixture) -> str:
    """One string of all that an operator, a log reader or a replay could ever see."""
    with engine.connect() as conn:
        letters = [dict(r._mapping) for r in conn.execute(sa.select(dead_letters))]
        alert_rows = [dict(r._mapping) for r in conn.execute(sa.select(alerts))]
    parts = [
        json.dumps(letters, default=str),
        json.dumps(alert_rows, default=str),
        json.dumps(sandbox.effects("slack.message")),
        json.dumps(sandbox.effects("mail.send")),
        json.dumps(sandbox.requests()),
        caplog.text,
        *[serialize_value(entry) for entry in instance.all_logs(run_id)],
    ]
    assert letters, "the scenario must dead-letter something, or the test proves nothing"
    return "\n".join(parts)


def test_canary_in_header_prompt_and_upstream_error_is_redacted(
    scaled_settings, instance, engine, sandbox, caplog
) -> None:
    """API key (Authorization header), prompt and a 401 body echoing the key: none survives anywhere."""
    caplog.set_level(logging.DEBUG)
    settings = scaled_settings.model_copy(update={"llm_api_key": CANARY})
    sandbox.put_store("docs/a.txt", b"artifact", "text/plain")
    with engine.begin() as conn:
        repository.create(conn, "req-canary", "docs/a.txt", f"PROMPT-7781 Contact {PII}, key {CANARY}: is it fair?")
    sandbox.script("llm", {"status": 401, "json": {"error": {
        "message": f"Incorrect API key provided: {CANARY}. Contact {PII}.", "type": "invalid_request_error",
        "code": "invalid_api_key"}}})
    result = build_definitions(settings).resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config("req-canary", {}), instance=instance, raise_on_error=False)
    assert not result.success
    seen = everything_recorded(instance, result.run_id, engine, sandbox, caplog)
    assert CANARY not in seen
    assert PII not in seen
    assert "PROMPT-7781" not in seen  # the prompt is kept as a hash only
    assert sandbox.count("slack.message") == 1


def test_canary_in_exception_message_is_redacted(scaled_settings, instance, engine, sandbox, caplog) -> None:
    """An httpx error whose message carries a token in the URL is stored and logged without it."""
    caplog.set_level(logging.DEBUG)
    with engine.begin() as conn:
        repository.create(conn, "req-url", f"missing.txt?access_token={CANARY}&password=hunter2canary",
                          "What is this?")
    result = build_definitions(scaled_settings).resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config("req-url", {}), instance=instance, raise_on_error=False)
    assert not result.success
    seen = everything_recorded(instance, result.run_id, engine, sandbox, caplog)
    assert CANARY not in seen
    assert "hunter2canary" not in seen
    with engine.connect() as conn:
        letter = conn.execute(sa.select(dead_letters)).one()
    assert letter.stage == "fetch" and letter.error_class == "NOT_FOUND"
    assert "HTTPStatusError" in letter.last_stack  # the stack is kept, only its secrets are not
