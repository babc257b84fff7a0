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
    # no word from the retry daemon: waiting for it within the grace, never retried after it
    assert not declined_retry({"dagster/will_retry": "true"}, [], failed_seconds_ago=299, grace=300)
    assert declined_retry({"dagster/will_retry": "true"}, [], failed_seconds_ago=300, grace=300)
    assert not declined_retry({"dagster/will_retry": "true", "dagster/auto_retry_run_id": "r2"}, [],
                              failed_seconds_ago=3600, grace=300)


def _declined_and_waiting(instance: dg.DagsterInstance, job: dg.JobDefinition) -> tuple[dg.DagsterRun, dg.DagsterRun]:
    """Two failed matchmaking partition runs tagged will_retry=true: Dagster declined the first one's retry
    (its backfill had ended), and has not decided on the second yet."""
    def failed_run(partition: str) -> dg.DagsterRun:
        run = instance.create_run_for_job(job_def=job, tags={**job.tags, "dagster/partition": partition,
                                                             "dagster/backfill": "bkf1"})
        instance.report_run_failed(run)
        assert instance.get_run_by_id(run.run_id).tags.get("dagster/will_retry") == "true"
        return run

    declined, waiting = failed_run("2026-03-08|America/New_York"), failed_run("2026-03-09|America/New_York")
    instance.report_engine_event(
        "Not retrying run since it is part of a backfill that is in a terminal state (COMPLETED).", declined)
    return declined, waiting


def test_a_run_whose_retry_dagster_declined_is_started_once_more(defs, sandbox, engine) -> None:
    """Found by the chaos run (twice): a job backfill ends as soon as its runs are submitted, and Dagster declines
    to retry a run of an ended backfill, so a matchmaking partition run killed with its worker (or timed out
    starting) was never run again and its 250 users stayed `running` under a dead letter. The sensor now asks
    for the same job, partition and config once more, outside the backfill (so Dagster's run retries cover the
    new run); no letter, no alert; a second tick asks nothing more; a run still waiting for the retry daemon is
    left alone."""
    import sqlalchemy as sa

    from redrive.schema import dead_letters
    from sensors.core import RETRY_OF_TAG

    sensor = defs.get_sensor_def("redrive_declined_run_retries")
    job = defs.resolve_job_def("matchmaking_job")
    with dg.instance_for_test(overrides={"run_retries": {"enabled": True, "max_retries": 1}}) as instance:
        declined, waiting = _declined_and_waiting(instance, job)
        repository = defs.get_repository_def()
        with dg.build_sensor_context(instance=instance, resources=defs.resources,
                                     repository_def=repository) as context:
            [request] = sensor.evaluate_tick(context).run_requests
        assert (request.job_name, request.partition_key) == ("matchmaking_job", "2026-03-08|America/New_York")
        assert request.tags[RETRY_OF_TAG] == declined.run_id and "dagster/backfill" not in request.tags
        assert request.tags["redrive/pipeline"] == "matchmaking" and request.run_key == f"retry-of:{declined.run_id}"

        retry = instance.create_run_for_job(job_def=job, run_config=request.run_config,
                                            tags={**request.tags, "dagster/partition": request.partition_key})
        with dg.build_sensor_context(instance=instance, resources=defs.resources,
                                     repository_def=repository) as context:
            assert sensor.evaluate_tick(context).run_requests == []  # its retry exists: nothing more
        # linked where Dagster looks (its UI and its retry daemon, which then never retries it a second time)
        assert instance.get_run_by_id(declined.run_id).tags["dagster/auto_retry_run_id"] == retry.run_id

    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar_one() == 0
    assert sandbox.effects("slack.message") == []


def test_a_run_dagster_never_retried_is_started_once_more_after_the_grace(defs, sandbox) -> None:
    """The chaos run (seed 16): an evidence ingest run SIGKILLed with its worker, tagged will_retry=true, was never
    retried and Dagster never said why (its retry daemon SIGKILLed, backends cut); its 50 rows were never
    ingested. Past the grace the sensor starts it once more; within the grace it waits for the daemon."""
    from sensors.core import RETRY_OF_TAG, declined_retry_sensor

    job = defs.resolve_job_def("matchmaking_job")
    with dg.instance_for_test(overrides={"run_retries": {"enabled": True, "max_retries": 1}}) as instance:
        run = instance.create_run_for_job(job_def=job, tags={**job.tags, "dagster/partition": "2026-03-08|America/New_York"})
        instance.report_run_failed(run)

        def requests(grace: float) -> list[dg.RunRequest]:
            sensor = declined_retry_sensor(jobs=[job], retry_grace=grace)
            with dg.build_sensor_context(instance=instance, resources=defs.resources,
                                         repository_def=defs.get_repository_def()) as context:
                return sensor.evaluate_tick(context).run_requests

        assert requests(grace=3600) == []  # the retry daemon may still retry it
        [request] = requests(grace=0)
        assert request.tags[RETRY_OF_TAG] == run.run_id and request.partition_key == "2026-03-08|America/New_York"
    assert sandbox.effects("slack.message") == []


def test_a_declined_run_of_a_job_the_sensor_cannot_start_is_dead_lettered_once(defs, sandbox, engine) -> None:
    """The run-failure sensor trusts will_retry=true and stays silent; a declined run the sensor cannot start
    again is dead-lettered on its partition and alerted, once (so the partition is never silently neither done
    nor dead-lettered)."""
    import sqlalchemy as sa

    from redrive.schema import dead_letters
    from sensors.core import declined_retry_sensor

    sensor = declined_retry_sensor(jobs=())
    job = defs.resolve_job_def("matchmaking_job")
    with dg.instance_for_test(overrides={"run_retries": {"enabled": True, "max_retries": 1}}) as instance:
        declined, waiting = _declined_and_waiting(instance, job)
        for _ in range(2):  # a second tick records nothing twice
            with dg.build_sensor_context(instance=instance, resources=defs.resources) as context:
                assert sensor.evaluate_tick(context).run_requests == []

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
