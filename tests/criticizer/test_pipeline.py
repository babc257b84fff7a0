"""The criticizer job end to end on the sandbox: stages, budgets, backoff, classification at the Dagster edge."""

from __future__ import annotations

import hashlib

import pytest
import sqlalchemy as sa

from assets.criticizer import api, repository
from orchestration.definitions import build_definitions
from tests.conftest import TIME_SCALE
from redrive.schema import dead_letters, stage_checkpoints
from tests.criticizer.conftest import ALERTS_PATH, CRITIQUE, RESULTS_PATH, sandbox_url, slack_posts, webhook_posts


def test_request_is_fetched_critiqued_and_delivered_to_webhook_and_slack(run, submit, engine, sandbox) -> None:
    """A clean run: one fetch, one LLM call, the webhook gets the critique with its headers, Slack the headline."""
    request_id = submit("clean")
    result = run(request_id)
    assert result.success

    assert sandbox.count("store.fetch") == 1 and sandbox.count("llm.call") == 1
    [posted] = webhook_posts(sandbox, "clean")
    assert posted["payload"]["criticizer"]["critique"] == CRITIQUE
    assert posted["payload"]["text"] == "Critique of clean: revise (6/10); 1 major, 1 minor"
    [webhook_request] = [r for r in sandbox.requests("slack") if r["path"].endswith("/requester/clean")]
    assert {"authorization", "idempotency-key"} <= set(webhook_request["header_names"])
    [result_post] = slack_posts(sandbox, RESULTS_PATH)
    assert "Critique of clean: revise (6/10)" in result_post["payload"]["text"]
    assert slack_posts(sandbox, ALERTS_PATH) == []

    found = api.status(engine, request_id)
    assert found.status == "done" and found.critique == CRITIQUE
    assert found.completed_stages == ("fetch", "llm", "notify")
    assert found.stage_attempts == {"fetch": 1, "llm": 1, "notify": 1}
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar() == 0


def dead_letter(engine):
    with engine.connect() as conn:
        rows = conn.execute(sa.select(dead_letters)).all()
    assert len(rows) == 1, rows
    return rows[0]


def test_each_stage_spends_only_its_own_budget(run, submit, engine, sandbox, instance) -> None:
    """§8.3: four failures in fetch, four in llm and four in notify (12 in all) still finish the request."""
    request_id = submit("budgets")
    sandbox.script("store", *[{"status": 503}] * 4)
    sandbox.script("llm", *[{"status": 503}] * 4)
    sandbox.script("slack", *[{"status": 503}] * 4)  # the webhook post is notify's first call
    result = run(request_id)
    assert result.success
    assert [len(result.waits(s)) for s in ("fetch", "llm", "notify")] == [4, 4, 4]
    assert api.status(engine, request_id).stage_attempts == {"fetch": 5, "llm": 5, "notify": 5}
    assert len(webhook_posts(sandbox, "budgets")) == 1 and len(slack_posts(sandbox, RESULTS_PATH)) == 1
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar() == 0


def test_llm_exhausting_its_budget_dead_letters_with_stage_metadata(run, submit, engine, sandbox, instance) -> None:
    """§8.3/§8.4: five 503s spend llm's budget; the dead letter says llm, 5 attempts, fetch's 1, hashes, times."""
    request_id = submit("exhaust", artifact=b"print('hello')\n")
    sandbox.script("llm", *[{"status": 503}] * 5)
    result = run(request_id)
    assert not result.success
    assert len(result.waits("llm")) == 4
    assert result.waits("fetch") == []

    letter = dead_letter(engine)
    assert (letter.pipeline, letter.stage, letter.entity_ref) == ("criticizer", "llm", "exhaust")
    assert (letter.error_class, letter.retryable, letter.attempts, letter.upstream_status) == (
        "NETWORK_TRANSIENT", True, 5, 503)
    assert letter.stage_attempts == {"fetch": 1, "llm": 5}
    context = letter.sanitized_context
    assert context["stage"] == "llm" and context["request_id"] == "exhaust" and context["attempts"] == 5
    assert context["artifact_sha256"] == hashlib.sha256(b"print('hello')\n").hexdigest()[:16]
    assert context["failing_since"] and context["webhook_host"] == "127.0.0.1"
    assert letter.payload_ref["request_id"] == "exhaust" and letter.payload_ref["table"] == "criticizer_requests"
    assert letter.first_failure_at <= letter.last_failure_at
    assert "HTTPStatusError" in letter.last_stack and "503" in letter.last_stack

    with engine.connect() as conn:  # fetch's output is intact for a replay; notify never ran
        kept = conn.execute(sa.select(stage_checkpoints.c.stage, stage_checkpoints.c.output)).all()
    assert [(s, o["sha256"]) for s, o in kept] == [("fetch", hashlib.sha256(b"print('hello')\n").hexdigest())]
    assert webhook_posts(sandbox, "exhaust") == []
    [alert] = slack_posts(sandbox, ALERTS_PATH)
    assert "NETWORK_TRANSIENT" in alert["payload"]["text"] and "exhaust" in alert["payload"]["text"]
    assert api.status(engine, request_id).status == "dead_lettered"


def test_retry_after_120_then_900_wait_120_then_300_seconds_in_a_real_run(run, submit, sandbox, instance) -> None:
    """§8.2.2 in a real run: Retry-After 120 → due 120 s × scale later; 900 → capped at 300 s × scale."""
    request_id = submit("retry-after")
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "120"}},
                   {"status": 429, "headers": {"Retry-After": "900"}})
    result = run(request_id)
    assert result.success
    assert result.waits("llm") == [120 * TIME_SCALE, 300 * TIME_SCALE]
    assert [r["step"] for r in sandbox.requests("llm")] == ["status:429", "status:429", "ok"]


def test_failure_reclassified_non_retryable_stops_at_once(run, submit, engine, sandbox, instance) -> None:
    """§8.2.3: 429 and 503 are retried; the 401 that follows stops the stage with budget left."""
    request_id = submit("stops")
    sandbox.script("llm", {"status": 429}, {"status": 503}, {"status": 401})
    result = run(request_id)
    assert not result.success
    assert len(result.waits("llm")) == 2
    assert [r["step"] for r in sandbox.requests("llm")] == ["status:429", "status:503", "status:401"]
    letter = dead_letter(engine)
    assert (letter.stage, letter.error_class, letter.retryable, letter.attempts) == ("llm", "AUTH_DENIED", False, 3)


def test_retried_notify_posts_only_what_is_missing(run, submit, engine, sandbox, instance) -> None:
    """The webhook got the critique, Slack failed: the retry posts to Slack only, never the webhook twice."""
    request_id = submit("partial")
    sandbox.script("slack", {"kind": "ok"}, {"status": 503})
    result = run(request_id)
    assert result.success
    assert len(result.waits("notify")) == 1
    assert len(webhook_posts(sandbox, "partial")) == 1 and len(slack_posts(sandbox, RESULTS_PATH)) == 1
    with engine.connect() as conn:
        delivered = {d["target"]: d for d in repository.deliveries(conn, request_id)}
    assert delivered["webhook"]["upstream_status"] == 200 and set(delivered) == {"webhook", "slack"}
    assert delivered["webhook"]["idempotency_key"] == delivered["slack"]["idempotency_key"]


def test_a_webhook_that_acted_but_lost_its_answer_gets_the_same_key_and_delivers_once(run, submit, engine,
                                                                                      sandbox) -> None:
    """effect_then_error at a receiver that honours Idempotency-Key: notify's retry repeats the key, so the
    requester sees one delivery (at-least-once posting, deduplicated by the key)."""
    request_id = submit("lost-answer", webhook_url=sandbox_url("/webhook/requester/lost-answer"))
    sandbox.script("webhook", {"kind": "effect_then_error", "status": 500})
    result = run(request_id)
    assert result.success and len(result.waits("notify")) == 1
    [delivered] = sandbox.effects("webhook.delivery")
    with engine.connect() as conn:
        [recorded] = [d for d in repository.deliveries(conn, request_id) if d["target"] == "webhook"]
    assert delivered["path"] == "requester/lost-answer"
    assert delivered["idempotency_key"] == recorded["idempotency_key"] and recorded["upstream_status"] == 200
    posts = sandbox.requests("webhook")
    assert [p["status"] for p in posts] == [500, 200]
    assert all("idempotency-key" in p["header_names"] for p in posts)


# --------------------------------------------------------------------- §8.1 through the real services

ROWS = [
    # (row, stage, route, steps, error_class or None when retried and done)
    ("network transient: 503 from the store", "fetch", "store", [{"status": 503}], None),
    ("network transient: TCP reset", "llm", "llm", [{"kind": "reset"}], None),
    ("rate limiting: 429", "llm", "llm", [{"status": 429}], None),
    ("upstream internal: LLM internal_error", "llm", "llm", [{"status": 500}], None),
    ("upstream internal: webhook 5xx", "notify", "slack", [{"status": 502}], None),
    ("conflict in idempotent fetch: retried", "fetch", "store", [{"status": 409}], None),
    ("conflict in idempotent llm: retried", "llm", "llm", [{"status": 409}], None),
    ("conflict in non-idempotent notify: not retried", "notify", "slack", [{"status": 409}], "CONFLICT"),
    ("validation: schema mismatch", "llm", "llm", [{"kind": "schema_invalid"}], "SCHEMA_INVALID"),
    ("validation: malformed JSON", "llm", "llm", [{"kind": "malformed"}], "MALFORMED_PAYLOAD"),
    ("validation: context window", "llm", "llm", [{"status": 400, "error_code": "context_length_exceeded"}],
     "CONTEXT_LENGTH_EXCEEDED"),
    ("auth: invalid API key", "llm", "llm", [{"status": 401}], "AUTH_DENIED"),
    ("auth: webhook 403", "notify", "slack", [{"status": 403}], "AUTH_DENIED"),
    ("not found: deleted destination channel", "notify", "slack", [{"status": 404}], "NOT_FOUND"),
    ("policy: moderation block", "llm", "llm", [{"status": 400, "error_code": "content_policy_violation"}],
     "POLICY_REJECTED"),
]


@pytest.mark.parametrize(("row", "stage", "route", "steps", "error_class"), ROWS, ids=[r[0] for r in ROWS])
def test_8_1_rows_through_the_real_services(run, submit, engine, sandbox, instance, row, stage, route, steps,
                                            error_class) -> None:
    """Each §8.1 row, injected in the sandbox: retryable ones are retried once and finish, others dead-letter at once."""
    request_id = submit("row")
    sandbox.script(route, *steps)
    result = run(request_id)
    waits = result.waits(stage)
    if error_class is None:
        assert result.success and len(waits) == 1
        assert api.status(engine, request_id).status == "done"
        return
    assert not result.success and waits == []
    letter = dead_letter(engine)
    assert (letter.stage, letter.error_class, letter.retryable, letter.attempts) == (stage, error_class, False, 1)
    assert len(slack_posts(sandbox, ALERTS_PATH)) == 1


def test_missing_artifact_is_not_found_at_fetch(run, submit, engine, sandbox) -> None:
    """§8.1 not found: a 404 for the immutable input artifact dead-letters fetch after one attempt."""
    request_id = submit("gone")
    sandbox.reset()  # the store forgets the artifact
    result = run(request_id)
    assert not result.success
    letter = dead_letter(engine)
    assert (letter.stage, letter.error_class, letter.attempts, letter.upstream_status) == ("fetch", "NOT_FOUND", 1, 404)


def test_artifact_outside_the_allowed_stores_is_denied_by_policy(run, submit, engine, sandbox) -> None:
    """§8.1 explicit deny: a request stored before the store list changed is refused at fetch, never fetched."""
    request_id = submit("elsewhere", artifact_url="http://169.254.169.254/latest/meta-data")
    result = run(request_id)
    assert not result.success
    letter = dead_letter(engine)
    assert (letter.stage, letter.error_class, letter.retryable, letter.attempts) == (
        "fetch", "POLICY_REJECTED", False, 1)
    assert sandbox.count("store.fetch") == 0


def test_bad_deploy_config_is_a_runtime_bug_not_retried(crit_settings, run, submit, engine, sandbox) -> None:
    """§8.1 configuration bug: an LLM URL with a wrong scheme dead-letters llm at once as CONFIG_OR_RUNTIME_BUG."""
    request_id = submit("misconfigured")
    defs = build_definitions(crit_settings.model_copy(update={"llm_base_url": "htp://llm.internal/v1"}))
    result = run(request_id, defs=defs)
    assert not result.success
    letter = dead_letter(engine)
    assert (letter.stage, letter.error_class, letter.retryable, letter.attempts) == (
        "llm", "CONFIG_OR_RUNTIME_BUG", False, 1)


def test_client_side_socket_timeout_is_retried(crit_settings, run, submit, engine, sandbox, instance) -> None:
    """§8.1 network transient: the LLM holding the socket past our timeout is NETWORK_TIMEOUT, retried, then done."""
    request_id = submit("slow")
    defs = build_definitions(crit_settings.model_copy(update={"http_timeout_seconds": 0.3}))
    sandbox.script("llm", {"kind": "timeout", "seconds": 1.5})
    result = run(request_id, defs=defs)
    assert result.success and len(result.waits("llm")) == 1
    assert [r["error_class"] for r in result.report["retries"]] == ["NETWORK_TIMEOUT"]
