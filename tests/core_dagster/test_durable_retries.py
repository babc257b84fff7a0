"""Long waits leave the run: a timer row in Postgres, and a sensor that requests the next attempt when due."""

from __future__ import annotations

import sqlalchemy as sa

from assets.rehearsal import pipeline as rehearsal
from orchestration.definitions import build_definitions
from redrive.schema import deferred_attempts
from tests.dagster_helpers import launch, tick


def test_wait_over_threshold_becomes_timer_and_sensor_resumes(scaled_settings, instance, engine, sandbox,
                                                              rehearsal_request) -> None:
    """Retry-After 3 s over a 2 s threshold: no in-run retry; the timer's run finishes the work."""
    settings = scaled_settings.model_copy(update={"redrive_durable_wait_threshold_seconds": 2.0,
                                                  "redrive_time_scale": 0.0})  # due at once, no sleeping
    defs = build_definitions(settings)
    sandbox.set_default("llm", content='{"verdict": "fine"}')
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "3"}})

    first = defs.resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config(rehearsal_request, {}), instance=instance)
    assert first.success  # deferral is not a failure: ask ended without output, nothing idles
    assert instance.get_run_by_id(first.run_id).tags["redrive/deferred"] == "true"
    with engine.connect() as conn:
        timer = conn.execute(sa.select(deferred_attempts)).one()
    assert (timer.entity_ref, timer.attempt, timer.status) == ("req-1", 2, "waiting")
    assert timer.payload == {"stage": "ask", "prior_attempts": {"ask": 1}}

    [request] = tick(defs, instance, "rehearsal_deferred_retries")
    assert request.run_key == "rehearsal:run:req-1:attempt-2"
    second = launch(defs, instance, request)
    assert second.success
    with engine.connect() as conn:
        assert conn.execute(sa.select(deferred_attempts.c.status)).scalar() == "requested"
        assert conn.execute(sa.text("SELECT result FROM rehearsal_requests")).scalar() == {"verdict": "fine"}
    assert tick(defs, instance, "rehearsal_deferred_retries") == []
    assert sandbox.count("store.fetch") == 1


def test_attempts_carry_across_durable_runs(scaled_settings, instance, engine, sandbox, rehearsal_request) -> None:
    """The budget counts attempts of earlier runs: the resumed run's failure is attempt 2, not 1."""
    settings = scaled_settings.model_copy(update={"redrive_durable_wait_threshold_seconds": 2.0,
                                                  "redrive_time_scale": 0.0})  # due at once, no sleeping
    defs = build_definitions(settings)
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "3"}}, {"status": 401})
    defs.resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config(rehearsal_request, {}), instance=instance)
    [request] = tick(defs, instance, "rehearsal_deferred_retries")
    assert not launch(defs, instance, request).success
    with engine.connect() as conn:
        letter = conn.execute(sa.text("SELECT attempts, stage_attempts FROM dead_letters")).one()
    assert letter.attempts == 2 and letter.stage_attempts == {"ask": 2}
