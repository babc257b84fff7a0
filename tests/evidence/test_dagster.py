"""The evidence pipeline in the code location: definitions, the outbox publisher, in-run retry of the
race, replay of a dead-lettered row, and §6's metrics and alerts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import dagster as dg
import sqlalchemy as sa

from assets.evidence import repository as repo
from assets.evidence import service
from redrive import deadletters
from redrive.clock import FrozenClock
from redrive.reliability import Reliability
from tests.evidence.helpers import Driver, put_zip, standard_job
from tests.evidence.test_worker import FailWriteOnce

O = repo.evidence_outbox


def ingest(driver: Driver, s3, bucket: str, inbox: str, name: str, rows: int, per_row: int):
    data, cases = standard_job(name, rows, per_row)
    put_zip(s3, bucket, f"{inbox}{name}.zip", data)
    [request] = driver.tick("evidence_inbox")
    assert driver.launch(request).success
    return request.partition_key, cases


def test_definitions_carry_the_pipeline(fast_defs) -> None:
    """Jobs, sensors, the metrics schedule, resources and both replay targets are in the code location."""
    repo_def = fast_defs.get_repository_def()
    assert {"evidence_file_job", "evidence_attach_job", "evidence_metrics_job"} <= set(repo_def.job_names)
    assert {"evidence_inbox", "evidence_outbox_publisher", "evidence_retry_scheduler", "evidence_deferred_retries",
            "evidence_file_jobs_deferred_retries"} <= {s.name for s in repo_def.sensor_defs}
    assert "evidence_metrics_schedule" in {s.name for s in repo_def.schedule_defs}
    assert {"case_api", "merchant_mail", "evidence_options", "evidence_hooks"} <= set(fast_defs.resources)


def test_publisher_runs_each_event_once_keyed_by_its_id(driver, engine, s3, bucket, inbox, sandbox) -> None:
    """PENDING events become runs of the file job's partition with the event id in the run key and are
    marked PUBLISHED; the worker marks them CONSUMED; a second tick requests nothing."""
    job, _ = ingest(driver, s3, bucket, inbox, "pub", rows=2, per_row=2)
    requests = driver.tick("evidence_outbox_publisher")
    with engine.connect() as conn:
        events = {e.event_id: e for e in conn.execute(sa.select(O))}
    assert {r.run_key for r in requests} == {f"evidence:run:outbox-{e}:attempt-1" for e in events}
    assert {r.partition_key for r in requests} == {job} and {r.job_name for r in requests} == {"evidence_attach_job"}
    assert {e.status for e in events.values()} == {"PUBLISHED"}
    assert driver.tick("evidence_outbox_publisher") == []
    for request in requests:
        assert driver.launch(request).success
    assert driver.tick_and_launch("evidence_outbox_publisher")  # the N1 and N2 events
    with engine.connect() as conn:
        assert {s for (s,) in conn.execute(sa.select(O.c.status))} == {"CONSUMED"}
    assert sandbox.count("case.attach") == 4
    assert sum(1 for m in sandbox.effects("mail.send") if m["idempotency_token"].startswith("evidence:")) == 2


def test_unconsumed_event_is_republished_then_failed_and_alerted(engine, runtime, clock, seed_job, sandbox) -> None:
    """A published event nobody consumed is published again (a new run key) and, out of attempts, FAILED;
    the monitor alerts on it once."""
    job, [event], _ = seed_job("stale", per_row=1)
    after = timedelta(minutes=30)
    first = service.publish(engine, now=clock.now(), limit=10, republish_after=after, max_attempts=2)
    assert [(e.event_id, e.attempts) for e in first.published] == [(event, 1)]
    assert service.publish(engine, now=clock.now() + after - timedelta(seconds=1), limit=10, republish_after=after,
                           max_attempts=2).published == []
    clock.advance(after.total_seconds())
    again = service.publish(engine, now=clock.now(), limit=10, republish_after=after, max_attempts=2)
    assert [(e.event_id, e.attempts) for e in again.published] == [(event, 2)]
    clock.advance(after.total_seconds())
    gave_up = service.publish(engine, now=clock.now(), limit=10, republish_after=after, max_attempts=2)
    assert gave_up.published == [] and [e.event_id for e in gave_up.failed] == [event]
    from assets.evidence.policy import Thresholds
    thresholds = Thresholds(0.1, 20, 500, 600, 6 * 3600, 900)
    report = service.monitor(runtime, thresholds=thresholds, window=timedelta(hours=1))
    assert "outbox_event_failed" in [a.kind for a in report.alerts]
    service.monitor(runtime, thresholds=thresholds, window=timedelta(hours=1))
    texts = [m["payload"]["text"] for m in sandbox.effects("slack.message")]
    assert sum(str(event) in t for t in texts) == 1


def test_db_write_failing_after_the_api_accepted_is_retried_in_run_without_a_second_attach(
        fast_defs, instance, engine, s3, bucket, inbox, sandbox) -> None:
    """Through Dagster: the hook fails the write after the case API accepted; the stage runner retries
    the step in the same run; the retry looks the artifact up, and the effect log has one attach each."""
    hooks = FailWriteOnce(victim_index=0)
    driver = Driver(fast_defs, instance, resources={"evidence_hooks": hooks})
    ingest(driver, s3, bucket, inbox, "race", rows=1, per_row=3)
    [request] = driver.tick("evidence_outbox_publisher")
    result = driver.launch(request)
    assert result.success and hooks.fired
    retries = instance.get_records_for_run(result.run_id, of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY).records
    assert len(retries) == 1
    keys = [e["idempotency_key"] for e in sandbox.effects("case.attach")]
    assert len(keys) == len(set(keys)) == 3
    assert [r["status"] for r in sandbox.requests("case.attach")] == [201, 201, 201]
    assert len(sandbox.requests("case.lookup")) >= 1
    with engine.connect() as conn:
        assert set(conn.execute(sa.select(repo.file_job_artifact.c.attachment_status)).scalars()) == {"ATTACHED"}


def test_dead_lettered_row_is_replayed_after_the_case_is_restored(driver, engine, s3, bucket, inbox, sandbox) -> None:
    """CASE_NOT_FOUND dead-letters the row (one alert); after the fix, `dlq replay` re-attempts only its
    failed artifact through the core's replay sensor and the letter is resolved."""
    job, [case] = ingest(driver, s3, bucket, inbox, "replay", rows=1, per_row=2)
    sandbox.mark_cases_missing(case)
    [request] = driver.tick("evidence_outbox_publisher")
    assert driver.launch(request).success  # a final failure is data, not a failed run
    with engine.connect() as conn:
        letter = deadletters.list_(conn)[0]
    assert (letter.pipeline, letter.error_class, letter.entity_ref.split("/")[0]) == ("evidence", "CASE_NOT_FOUND", job)
    assert len(sandbox.effects("slack.message")) == 1

    sandbox.reset()  # the case is back (the sandbox forgets it was missing)
    with engine.begin() as conn:
        deadletters.request_replay(conn, letter.id, evidence="CASE-7: case restored", confirm_safe=True,
                                   at=datetime.now(UTC), operator="test")
    [replay] = driver.tick("redrive_dead_letter_replays")
    assert replay.partition_key == job and replay.job_name == "evidence_attach_job"
    assert driver.launch(replay).success
    with engine.connect() as conn:
        assert deadletters.get(conn, letter.id).status == "resolved"
        assert set(conn.execute(sa.select(repo.file_job_artifact.c.attachment_status)).scalars()) == {"ATTACHED"}
    assert sandbox.count("case.attach") == 2  # both, after the reset: nothing was attached while the case was gone


def test_metrics_asset_records_the_snapshot_and_alerts_once_per_episode(fast_defs, instance, engine, seed_job,
                                                                        clock, sandbox, settings) -> None:
    """The metrics asset stores §6's numbers and raises the permanent-failure-rate and heartbeat alerts,
    each once while the condition lasts."""
    from resources.factory import notifier_from
    from resources.evidence import CaseApiResource
    from assets.evidence.worker import AttachWorker

    runtime = Reliability(engine=engine, channels=notifier_from(settings).channels(), clock=FrozenClock(datetime.now(UTC)))
    job, events, _ = seed_job("m", rows=5, per_row=5)
    sandbox.random_faults("case.attach", seed=3, rates={"404": 0.4})
    with CaseApiResource(base_url=settings.case_url, token="t").session() as api:
        for event in events:
            AttachWorker(runtime, api, max_attempts=3).process_event(event)
    job_def = fast_defs.resolve_job_def("evidence_metrics_job")
    first = job_def.execute_in_process(instance=instance)
    assert first.success
    [materialization] = first.asset_materializations_for_node("evidence_metrics")
    meta = materialization.metadata
    assert meta["evidence.attach.finished"].value == 25
    permanent = meta["evidence.permanent_failures.count"].value
    assert 0.1 * 25 < permanent < 25
    assert meta["evidence.permanent_failures.by_error_code"].value == {"CASE_NOT_FOUND": permanent}
    assert set(meta["alerts_raised"].value.split(",")) == {"permanent_failure_rate", "scheduler_heartbeat"}
    assert job_def.execute_in_process(instance=instance).success
    kinds = [m["payload"]["text"].split("\n")[0] for m in sandbox.effects("slack.message")]
    assert sum("permanent failure rate" in k for k in kinds) == 1 and sum("scheduler heartbeat" in k for k in kinds) == 1
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(repo.evidence_metrics)).scalar() == 2
