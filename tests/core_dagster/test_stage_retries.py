"""A real Dagster job under the core: scripted upstream faults become retries, one dead letter, one alert."""

from __future__ import annotations


import dagster as dg
import sqlalchemy as sa

from assets.rehearsal import pipeline as rehearsal
from redrive.backoff import FullJitter
from redrive.reliability import Reliability
from redrive.schema import dead_letters
from tests.conftest import TIME_SCALE


def retry_waits(instance: dg.DagsterInstance, run_id: str, step: str) -> list[float]:
    events = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY).records
    return [r.event_log_entry.dagster_event.step_retry_data.seconds_to_wait for r in events
            if r.event_log_entry.step_key == step]


def expected_wait(attempt: int, retry_after: float | None) -> float:
    """What the policy says for the rehearsal's ask stage, with the same per-attempt jitter seed."""
    rng = Reliability(engine=None).rng_for(f"rehearsal:req-1:ask:{attempt}")  # type: ignore[arg-type]
    return FullJitter().delay(attempt, rng, retry_after) * TIME_SCALE


def test_429_then_503_then_401_retries_twice_and_dead_letters_once(defs, instance, engine, sandbox,
                                                                   rehearsal_request) -> None:
    """429 (Retry-After 3) and 503 are retried with the policy's delays; the 401 stops at once."""
    sandbox.script("llm",
                   {"status": 429, "headers": {"Retry-After": "3"}},
                   {"status": 503},
                   {"status": 401})
    job = defs.resolve_job_def("rehearsal_job")
    result = job.execute_in_process(run_config=rehearsal.run_config(rehearsal_request, {}), instance=instance,
                                    raise_on_error=False)
    assert not result.success

    waits = retry_waits(instance, result.run_id, "rehearsal_ask")
    assert waits == [expected_wait(1, 3.0), expected_wait(2, None)]
    assert waits[0] == 3.0 * TIME_SCALE  # max(full jitter ≤ 1 s, Retry-After 3 s)
    assert 0 <= waits[1] <= 2.0 * TIME_SCALE
    assert [r["step"] for r in sandbox.requests("llm")] == ["status:429", "status:503", "status:401"]

    with engine.connect() as conn:
        rows = conn.execute(sa.select(dead_letters)).all()
    assert len(rows) == 1
    letter = rows[0]
    assert (letter.pipeline, letter.stage, letter.entity_ref) == ("rehearsal", "ask", "req-1")
    assert letter.error_class == "AUTH_DENIED" and letter.retryable is False
    assert letter.attempts == 3 and letter.upstream_status == 401
    assert letter.stage_attempts == {"ask": 3}

    slack = sandbox.effects("slack.message")
    assert len(slack) == 1
    assert "AUTH_DENIED" in slack[0]["payload"]["text"] and "req-1" in slack[0]["payload"]["text"]
    assert sandbox.count("mail.send") == 1  # the email channel, configured beside Slack
    tags = instance.get_run_by_id(result.run_id).tags
    assert tags.get("redrive/dead_lettered") == "true"


def test_budget_exhaustion_dead_letters_after_five_attempts(defs, instance, engine, sandbox,
                                                            rehearsal_request) -> None:
    """Five retryable failures spend the ask stage's budget; fetch's budget is untouched."""
    sandbox.script("llm", *[{"status": 503}] * 5)
    job = defs.resolve_job_def("rehearsal_job")
    result = job.execute_in_process(run_config=rehearsal.run_config(rehearsal_request, {}), instance=instance,
                                    raise_on_error=False)
    assert not result.success
    assert len(retry_waits(instance, result.run_id, "rehearsal_ask")) == 4
    assert retry_waits(instance, result.run_id, "rehearsal_fetch") == []
    with engine.connect() as conn:
        letter = conn.execute(sa.select(dead_letters)).one()
    assert letter.error_class == "UPSTREAM_UNAVAILABLE" and letter.retryable is True
    assert letter.attempts == 5 and letter.stage_attempts == {"ask": 5}
    assert sandbox.count("slack.message") == 1


def test_success_after_transient_faults_leaves_no_dead_letter(defs, instance, engine, sandbox,
                                                              rehearsal_request) -> None:
    """Two timeouts-as-503 then success: the run succeeds, nothing is dead-lettered or alerted."""
    sandbox.set_default("llm", content='{"verdict": "fair"}')
    sandbox.script("llm", {"status": 503}, {"status": 502})
    result = defs.resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config(rehearsal_request, {}), instance=instance)
    assert result.success
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar() == 0
        assert conn.execute(sa.text("SELECT result FROM rehearsal_requests")).scalar() == {"verdict": "fair"}
    assert sandbox.count("slack.message") == 0


def test_dagster_holds_the_run_for_the_requested_wait(scaled_settings, instance, engine, sandbox,
                                                      rehearsal_request) -> None:
    """Pins Dagster's behaviour the durable threshold relies on: the retry starts no earlier than the wait."""
    from orchestration.definitions import build_definitions

    defs = build_definitions(scaled_settings.model_copy(update={"redrive_time_scale": 0.05}))
    sandbox.set_default("llm", content='{"verdict": "ok"}')
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "3"}})
    result = defs.resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config(rehearsal_request, {}), instance=instance)
    assert result.success
    [up] = instance.get_records_for_run(result.run_id, of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY).records
    [restarted] = instance.get_records_for_run(result.run_id, of_type=dg.DagsterEventType.STEP_RESTARTED).records
    wait = up.event_log_entry.dagster_event.step_retry_data.seconds_to_wait
    assert wait == 3.0 * 0.05
    assert restarted.event_log_entry.timestamp - up.event_log_entry.timestamp >= wait
