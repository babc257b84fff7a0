"""Unexpected run failures reach Slack once; runs Dagster will retry, or the core already reported, do not."""

from __future__ import annotations

import dagster as dg

from assets.rehearsal import pipeline as rehearsal
from sensors.core import should_alert_run_failure
from tests.dagster_helpers import evaluate_failure_sensor


def test_unexpected_run_failure_is_posted_once(defs, instance, sandbox) -> None:
    """A bug (the request does not exist) fails the run outside any stage policy: one Slack message."""
    result = defs.resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config("no-such-request", {}), instance=instance, raise_on_error=False)
    assert not result.success
    evaluate_failure_sensor(defs, instance, result.run_id)
    evaluate_failure_sensor(defs, instance, result.run_id)  # a second evaluation of the same failure
    [message] = sandbox.effects("slack.message")
    assert "rehearsal_job" in message["payload"]["text"] and result.run_id in message["payload"]["text"]


def test_dead_lettered_run_is_not_posted_again(defs, instance, sandbox, rehearsal_request) -> None:
    """The stage already dead-lettered and alerted; the run-failure sensor stays silent."""
    sandbox.script("llm", {"status": 403})
    result = defs.resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config(rehearsal_request, {}), instance=instance, raise_on_error=False)
    assert sandbox.count("slack.message") == 1
    evaluate_failure_sensor(defs, instance, result.run_id)
    assert sandbox.count("slack.message") == 1


def test_policy_skips_runs_dagster_will_retry() -> None:
    """`dagster/will_retry=true` means Dagster will retry the run: no alert yet."""
    assert should_alert_run_failure({}) is True
    assert should_alert_run_failure({"dagster/will_retry": "true"}) is False
    assert should_alert_run_failure({"dagster/will_retry": "false"}) is True
    assert should_alert_run_failure({"redrive/dead_lettered": "true"}) is False
    assert should_alert_run_failure({"redrive/deferred": "true"}) is False


def test_run_that_dagster_will_retry_is_not_posted(defs, sandbox) -> None:
    """With run retries on, Dagster tags the failed run `dagster/will_retry=true`; the sensor stays silent."""
    with dg.instance_for_test(overrides={"run_retries": {"enabled": True, "max_retries": 2}}) as instance:
        result = defs.resolve_job_def("rehearsal_job").execute_in_process(
            run_config=rehearsal.run_config("no-such-request", {}), instance=instance, raise_on_error=False,
            tags={"dagster/max_retries": "2"})
        assert instance.get_run_by_id(result.run_id).tags.get("dagster/will_retry") == "true"
        evaluate_failure_sensor(defs, instance, result.run_id)
    assert sandbox.count("slack.message") == 0


def test_a_killed_drain_run_gives_its_leases_back_and_is_told_once_without_a_dead_letter(
        defs, instance, engine, sandbox) -> None:
    """A drain run dies (its worker SIGKILLed; Dagster records the run failed): the rows it leased are due at
    once instead of after their lease, no `run:<id>` dead letter that `redrive dlq replay` could not act on,
    and one alert, however often the sensor sees the failure."""
    from datetime import timedelta

    import sqlalchemy as sa

    from redrive import work
    from redrive.schema import dead_letters

    job = defs.resolve_job_def("criticizer_job")
    run = instance.create_run_for_job(job_def=job, tags=job.tags)
    with engine.begin() as conn:
        now = conn.execute(sa.select(sa.func.now())).scalar_one()
        for i in range(3):
            work.enqueue(conn, "criticizer", f"killed-{run.run_id[:8]}-{i}", now=now)
        held = work.claim(conn, "criticizer", owner=f"run:{run.run_id}", limit=3, lease_seconds=300, now=now)
    assert len(held) == 3
    instance.report_run_failed(run)

    evaluate_failure_sensor(defs, instance, run.run_id)
    evaluate_failure_sensor(defs, instance, run.run_id)

    with engine.connect() as conn:
        states = [work.state(conn, "criticizer", item.entity_ref) for item in held]
        letters = conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar_one()
    assert {s.status for s in states} == {"due"} and {s.lease_owner for s in states} == {None}
    assert all(s.due_at < now + timedelta(seconds=60) for s in states)  # due now, not 300 s after the claim
    assert letters == 0
    [message] = sandbox.effects("slack.message")
    assert run.run_id in message["payload"]["text"] and "3 leased entities are due again" in message["payload"]["text"]


def test_declined_retry_is_pure() -> None:
    """Only a run tagged will_retry, never retried, with Dagster's own "Not retrying run" event counts."""
    from sensors.core import declined_retry

    said = ["Not retrying run since it is part of a backfill that is in a terminal state (COMPLETED)."]
    assert declined_retry({"dagster/will_retry": "true"}, said)
    assert not declined_retry({"dagster/will_retry": "true"}, ["Run timed out"])  # the daemon has not decided
    assert not declined_retry({"dagster/will_retry": "true", "dagster/auto_retry_run_id": "r2"}, said)
    assert not declined_retry({"dagster/will_retry": "false"}, said)


def test_a_run_dagster_said_it_would_retry_and_then_did_not_is_dead_lettered_once(defs, sandbox, engine) -> None:
    """Found by the chaos run: a matchmaking partition run of an ended backfill timed out starting; Dagster tagged
    it will_retry=true, then declined ("part of a backfill that is in a terminal state"). The run-failure sensor
    trusts the tag and stays silent, so the partition was neither done nor dead-lettered. The declined-retry sensor
    dead-letters it on its partition and alerts, once; a run still waiting for the retry daemon is left alone."""
    import sqlalchemy as sa

    from redrive.schema import dead_letters

    sensor = defs.get_sensor_def("redrive_declined_run_retries")
    job = defs.resolve_job_def("matchmaking_job")
    with dg.instance_for_test(overrides={"run_retries": {"enabled": True, "max_retries": 1}}) as instance:
        def failed_run(partition: str) -> dg.DagsterRun:
            run = instance.create_run_for_job(job_def=job, tags={**job.tags, "dagster/partition": partition})
            instance.report_run_failed(run)
            assert instance.get_run_by_id(run.run_id).tags.get("dagster/will_retry") == "true"
            return run

        declined, waiting = failed_run("2026-03-08|America/New_York"), failed_run("2026-03-09|America/New_York")
        instance.report_engine_event(
            "Not retrying run since it is part of a backfill that is in a terminal state (COMPLETED).", declined)

        for _ in range(2):  # a second tick records nothing twice
            with dg.build_sensor_context(instance=instance, resources=defs.resources) as context:
                sensor.evaluate_tick(context)

    with engine.connect() as conn:
        letters = conn.execute(sa.select(dead_letters.c.pipeline, dead_letters.c.entity_ref, dead_letters.c.run_id)).all()
    assert [(p, ref) for p, ref, _ in letters] == [("matchmaking", "2026-03-08|America/New_York")]
    assert letters[0].run_id == declined.run_id and waiting.run_id not in {r for *_, r in letters}
    [message] = sandbox.effects("slack.message")
    assert "matchmaking" in message["payload"]["text"]


def test_a_killed_matching_drain_run_is_told_once_without_a_run_letter(defs, instance, engine, sandbox) -> None:
    """The chaos run's `run:<id>` matching letter: a matching drain run's entities are SQS messages, which come
    back by their visibility timeout, so a killed run is one alert and no dead letter no replay could act on."""
    import sqlalchemy as sa

    from redrive.schema import dead_letters

    job = defs.resolve_job_def("matching_drain_job")
    run = instance.create_run_for_job(job_def=job, tags=job.tags)
    instance.report_run_failed(run)
    evaluate_failure_sensor(defs, instance, run.run_id)
    evaluate_failure_sensor(defs, instance, run.run_id)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar_one() == 0
    [message] = sandbox.effects("slack.message")
    assert run.run_id in message["payload"]["text"]
