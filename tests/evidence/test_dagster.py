"""The evidence pipeline in the code location: definitions, one run per file job and retry round through
the sensors (runs keyed by file job), a no-config launch and a backfill of file-job partitions, the in-run
retry of the race, replay of a dead-lettered row, and §6's metrics without runs."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, datetime

import dagster as dg
import sqlalchemy as sa

from assets.evidence import repository as repo
from redrive import deadletters
from redrive.clock import FrozenClock
from redrive.schema import work_items
from tests.evidence.helpers import Driver, put_zip, standard_job
from tests.evidence.test_worker import FailWriteOnce

A, O, W = repo.file_job_artifact, repo.evidence_outbox, work_items
# 20 % transient faults per attach request: 503, 500, accepted-but-answer-lost, dropped connection, timeout
TRANSIENT = {"503": 0.06, "500": 0.04, "effect_then_error": 0.04, "reset": 0.03, "timeout": 0.03}


class ClockedReliability:
    """The reliability resource on the test's frozen clock: sensor ticks and runs see the same time."""

    def __init__(self, resource, clock: FrozenClock) -> None:
        self.resource, self.clock = resource, clock

    def runtime(self, clock=None):
        return self.resource.runtime(clock or self.clock)


def clocked(defs: dg.Definitions, clock: FrozenClock) -> dg.Definitions:
    reliability = dg.ResourceDefinition.hardcoded_resource(ClockedReliability(defs.resources["reliability"], clock))
    return dg.Definitions(assets=defs.assets, asset_checks=defs.asset_checks, jobs=defs.jobs, schedules=defs.schedules,
                          sensors=defs.sensors, resources={**defs.resources, "reliability": reliability})


def ingest(driver: Driver, s3, bucket: str, inbox: str, name: str, rows: int, per_row: int):
    data, cases = standard_job(name, rows, per_row)
    put_zip(s3, bucket, f"{inbox}{name}.zip", data)
    [request] = driver.tick("evidence_inbox")
    assert driver.launch(request).success
    return request.partition_key, cases


def open_work(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).where(W.c.status.in_(("due", "leased")))).scalar()


def test_definitions_carry_the_pipeline(fast_defs) -> None:
    """One partitioned job, the inbox, due-work, deadline and metrics sensors, the metrics asset, resources,
    and the file jobs' replay target; no per-event job, no publisher, no metrics schedule."""
    repo_def = fast_defs.get_repository_def()
    evidence_jobs = {j for j in repo_def.job_names if j.startswith("evidence")}
    assert evidence_jobs == {"evidence_file_job"}
    sensors = {s.name for s in repo_def.sensor_defs if s.name.startswith("evidence")}
    assert sensors == {"evidence_inbox", "evidence_due_work", "evidence_retry_scheduler", "evidence_metrics",
                       "evidence_deferred_retries"}
    assert not [s for s in repo_def.schedule_defs if s.name.startswith("evidence")]
    assert dg.AssetKey("evidence_metrics") in {spec.key for spec in fast_defs.assets}
    assert {"case_api", "merchant_mail", "evidence_options", "evidence_hooks"} <= set(fast_defs.resources)
    job = repo_def.get_job("evidence_file_job")
    assert job.executor_def.name == "in_process"
    assert {n.name: n.definition.retry_policy is not None for n in job.nodes} == {
        "ingest_file_job": True, "attach_file_job_rows": True, "send_file_job_notifications": True}


def test_two_file_jobs_with_transient_faults_take_one_run_per_round(fast_settings, inbox, instance, engine, s3, bucket,
                                                                   sandbox) -> None:
    """2 file jobs × 200 rows, 20 % transient faults, on a frozen clock moved an hour per round: the runs are
    at most file jobs × retry rounds (the ingest run is the first round), keyed by file job; every artifact
    ends attached exactly once (the sandbox's effect log) or failed for good with its code; N1/N2 once each."""
    from orchestration.definitions import build_definitions

    clock = FrozenClock(datetime.now(UTC))
    driver = Driver(clocked(build_definitions(fast_settings.model_copy(update={"redrive_time_scale": 1.0})), clock),
                    instance)
    sandbox.random_faults("case.attach", seed=12, rates=TRANSIENT, timeout_seconds=0)
    jobs = [ingest(driver, s3, bucket, inbox, name, rows=200, per_row=1)[0] for name in ("fa", "fb")]
    rounds = 1
    while open_work(engine):
        clock.advance(3600)
        requests = driver.tick("evidence_due_work")
        assert sorted(r.partition_key for r in requests) == sorted({r.partition_key for r in requests})
        assert all(r.run_config in (None, {}) for r in requests)  # a round needs no config
        for request in requests:
            assert driver.launch(request).success
        rounds += 1
        assert rounds <= 3, "a file job took more than its three attempts' rounds"
    runs = driver.launched
    per_job = Counter(r.dagster_run.tags["dagster/partition"] for r in runs)
    assert set(per_job) == set(jobs) and max(per_job.values()) <= 3 and len(runs) <= len(jobs) * 3
    with engine.connect() as conn:
        arts = conn.execute(sa.select(A.c.id, A.c.attachment_status, A.c.retry_status, A.c.attachment_error_code,
                                      A.c.attempt_count)).all()
    attached = {str(a.id) for a in arts if a.attachment_status == "ATTACHED"}
    failed = [a for a in arts if a.attachment_status != "ATTACHED"]
    assert len(arts) == 400 and all(a.retry_status == "PERMANENT_FAILED" and a.attachment_error_code for a in failed)
    assert len(attached) >= 380 and max(a.attempt_count for a in arts) >= 2
    keys = Counter(e["idempotency_key"] for e in sandbox.effects("case.attach"))
    assert set(keys) == attached and set(keys.values()) == {1}
    mails = Counter(m["idempotency_token"] for m in sandbox.effects("mail.send")
                    if m["idempotency_token"].startswith("evidence:"))
    assert mails == {f"evidence:{j}:{k}": 1 for j in jobs for k in ("N1", "N2")}
    print(f"\n2 file jobs × 200 rows: {len(runs)} runs ({dict(per_job)}), {rounds} rounds, {len(attached)} attached, "
          f"{Counter(a.attachment_error_code for a in failed)} failed for good")


def test_launch_without_config_works_the_file_jobs_due_rows(fast_settings, instance, engine, s3, bucket, inbox,
                                                             sandbox) -> None:
    """A launch of a file-job partition with no run config (the UI's launchpad, a backfill's run: tags only)
    attaches that file job's due rows and sends its notifications, and touches no other job."""
    from orchestration.definitions import build_definitions

    defs = build_definitions(fast_settings.model_copy(update={"redrive_time_scale": 1.0}))  # retries wait 5 min
    driver = Driver(defs, instance)
    sandbox.script("case.attach", *[{"status": 503}] * 4)  # the first pass of job "na" fails, once per artifact
    job, _ = ingest(driver, s3, bucket, inbox, "na", rows=2, per_row=2)
    other, _ = ingest(driver, s3, bucket, inbox, "nb", rows=1, per_row=1)
    with engine.begin() as conn:  # the retries fall due now (as an operator may make them)
        conn.execute(sa.update(W).where(W.c.group_key == job).values(due_at=sa.func.now()))
        conn.execute(sa.update(A).where(A.c.file_job_id == uuid.UUID(job)).values(next_retry_at=sa.func.now()))
    result = defs.resolve_job_def("evidence_file_job").execute_in_process(
        instance=instance, partition_key=job, tags={"dagster/backfill": "bf-1"}, raise_on_error=False)
    assert result.success
    assert result.output_for_node("attach_file_job_rows")["done"] == 2
    with engine.connect() as conn:
        assert set(conn.execute(sa.select(A.c.attachment_status).where(A.c.file_job_id == uuid.UUID(job))).scalars()) \
            == {"ATTACHED"}
        assert set(conn.execute(sa.select(W.c.status)).scalars()) == {"done"}
    tokens = {m["idempotency_token"] for m in sandbox.effects("mail.send")}
    assert {f"evidence:{job}:N1", f"evidence:{job}:N2", f"evidence:{other}:N2"} <= tokens


def test_db_write_failing_after_the_api_accepted_is_retried_in_run_without_a_second_attach(
        fast_defs, instance, engine, s3, bucket, inbox, sandbox) -> None:
    """Through Dagster: the hook fails the write after the case API accepted (our database: no attempt spent,
    counted apart); the drain makes the row due again shortly and works it again in the same run; that pass
    looks the artifact up, and the effect log has one attach each."""
    hooks = FailWriteOnce(victim_index=0)
    driver = Driver(fast_defs, instance, resources={"evidence_hooks": hooks})
    ingest(driver, s3, bucket, inbox, "race", rows=1, per_row=3)
    [result] = driver.launched
    assert result.success and hooks.fired
    report = result.output_for_node("attach_file_job_rows")
    assert (report["infrastructure"], report["retried"], report["done"]) == (1, 0, 1)
    with engine.connect() as conn:
        assert conn.execute(sa.select(W.c.attempts)).scalar() == {"attach": 1, "infrastructure": 1}
    keys = [e["idempotency_key"] for e in sandbox.effects("case.attach")]
    assert len(keys) == len(set(keys)) == 3
    assert [r["status"] for r in sandbox.requests("case.attach")] == [201, 201, 201]
    assert len(sandbox.requests("case.lookup")) >= 1
    with engine.connect() as conn:
        assert set(conn.execute(sa.select(A.c.attachment_status)).scalars()) == {"ATTACHED"}


def test_dead_lettered_row_is_replayed_after_the_case_is_restored(driver, engine, s3, bucket, inbox, sandbox) -> None:
    """CASE_NOT_FOUND dead-letters the row (one alert); after the fix, `dlq replay` makes its work row due, the
    due-work sensor starts a run of its file job, only its failed artifact is re-attempted, the letter resolves."""
    data, [case] = standard_job("replay", 1, 2)
    sandbox.mark_cases_missing(case)
    put_zip(s3, bucket, f"{inbox}replay.zip", data)
    [request] = driver.tick("evidence_inbox")
    assert driver.launch(request).success  # a final failure is data, not a failed run
    job = request.partition_key
    with engine.connect() as conn:
        letter = deadletters.list_(conn)[0]
    assert (letter.pipeline, letter.error_class, letter.entity_ref.split("/")[0]) == ("evidence", "CASE_NOT_FOUND", job)
    assert len(sandbox.effects("slack.message")) == 1

    sandbox.reset()  # the case is back (the sandbox forgets it was missing)
    with engine.begin() as conn:
        deadletters.request_replay(conn, letter.id, evidence="CASE-7: case restored", confirm_safe=True,
                                   at=datetime.now(UTC), operator="test")
    assert driver.tick("redrive_dead_letter_replays") == []  # a drained row replays through its work row
    [replay] = driver.tick("evidence_due_work")
    assert replay.partition_key == job and replay.job_name == "evidence_file_job"
    assert driver.launch(replay).success
    with engine.connect() as conn:
        assert deadletters.get(conn, letter.id).status == "resolved"
        assert set(conn.execute(sa.select(A.c.attachment_status)).scalars()) == {"ATTACHED"}
    assert sandbox.count("case.attach") == 2  # both, after the reset: nothing was attached while the case was gone


def test_metrics_sensor_records_the_snapshot_and_alerts_once_per_episode(fast_defs, instance, engine, seed_job,
                                                                         sandbox, settings) -> None:
    """The metrics sensor stores §6's numbers, reports them as a materialization of the evidence_metrics asset
    (no run), and raises the permanent-failure-rate and heartbeat alerts, each once while the condition lasts."""
    from assets.evidence.worker import AttachWorker
    from orchestration.demo import evaluate_sensor_tick
    from redrive.reliability import Reliability
    from resources.evidence import CaseApiResource
    from resources.factory import notifier_from

    runtime = Reliability(engine=engine, channels=notifier_from(settings).channels(), clock=FrozenClock(datetime.now(UTC)))
    job, events, _ = seed_job("m", rows=5, per_row=5)
    sandbox.random_faults("case.attach", seed=3, rates={"404": 0.4})
    with CaseApiResource(base_url=settings.case_url, token="t").session() as api:
        for event in events:
            AttachWorker(runtime, api, max_attempts=3).process_event(event)
    sensor = fast_defs.resolve_sensor_def("evidence_metrics")
    with dg.build_sensor_context(instance=instance, resources=fast_defs.resources,
                                 repository_def=fast_defs.get_repository_def()) as context:
        first = sensor.evaluate_tick(context)
    assert not first.run_requests
    [materialization] = first.asset_events
    assert materialization.asset_key == dg.AssetKey("evidence_metrics")
    meta = materialization.metadata
    assert meta["evidence.attach.finished"].value == 25
    permanent = meta["evidence.permanent_failures.count"].value
    assert 0.1 * 25 < permanent < 25
    assert meta["evidence.permanent_failures.by_error_code"].value == {"CASE_NOT_FOUND": permanent}
    assert set(meta["alerts_raised"].value.split(",")) == {"permanent_failure_rate", "scheduler_heartbeat"}
    evaluate_sensor_tick(fast_defs, instance, "evidence_metrics")
    kinds = [m["payload"]["text"].split("\n")[0] for m in sandbox.effects("slack.message")]
    assert sum("permanent failure rate" in k for k in kinds) == 1 and sum("scheduler heartbeat" in k for k in kinds) == 1
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(repo.evidence_metrics)).scalar() == 2
    assert instance.get_runs_count() == 0


def test_dagster_job_backfill_of_file_job_partitions_works_their_due_rows(fast_settings, inbox, engine, s3, bucket,
                                                                         sandbox, project_tmp) -> None:
    """`dagster job backfill -j evidence_file_job --partitions a,b` (no run config) against a real instance:
    one run per partition, each works its file job's due rows; every artifact ends attached once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from orchestration.definitions import build_definitions

    home = project_tmp / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(
        "telemetry:\n  enabled: false\n"
        "run_coordinator:\n  module: dagster._core.run_coordinator.default_run_coordinator\n"
        "  class: DefaultRunCoordinator\n"
        "run_launcher:\n  module: dagster._core.launcher.sync_in_memory_run_launcher\n  class: SyncInMemoryRunLauncher\n"
        "compute_logs:\n  module: dagster._core.storage.noop_compute_log_manager\n  class: NoOpComputeLogManager\n")
    settings = fast_settings.model_copy(update={"redrive_time_scale": 1.0})  # retries wait 5 min: not in-run
    instance = dg.DagsterInstance.from_config(str(home))
    driver = Driver(build_definitions(settings), instance)
    sandbox.script("case.attach", *[{"status": 503}] * 6)  # the first passes fail once per artifact
    jobs = [ingest(driver, s3, bucket, inbox, name, rows=1, per_row=3)[0] for name in ("ba", "bb")]
    with engine.begin() as conn:  # their retries fall due now
        conn.execute(sa.update(W).values(due_at=sa.func.now()))
        conn.execute(sa.update(A).values(next_retry_at=sa.func.now()))
    env = {**os.environ, "DAGSTER_HOME": str(home), "DATABASE_URL": settings.database_url or "",
           "REDRIVE_TIME_SCALE": "1.0"}
    dagster_cli = Path(sys.executable).with_name("dagster")
    done = subprocess.run([str(dagster_cli), "job", "backfill", "-m", "orchestration.definitions", "-a", "defs",
                           "-j", "evidence_file_job", "--partitions", ",".join(jobs), "--noprompt"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = [r for r in instance.get_runs() if r.tags.get("dagster/backfill")]
    assert sorted(r.tags["dagster/partition"] for r in runs) == sorted(jobs)
    assert all(r.status == dg.DagsterRunStatus.SUCCESS and not r.run_config.get("ops") for r in runs), \
        [(r.status, r.run_config) for r in runs]
    with engine.connect() as conn:
        assert set(conn.execute(sa.select(A.c.attachment_status)).scalars()) == {"ATTACHED"}
        assert set(conn.execute(sa.select(W.c.status)).scalars()) == {"done"}
    keys = Counter(e["idempotency_key"] for e in sandbox.effects("case.attach"))
    assert len(keys) == 6 and set(keys.values()) == {1}
    instance.dispose()


def test_a_file_job_run_that_dies_is_rerun_whatever_the_instance_default(fast_defs) -> None:
    """A run killed before ingest carries the whole ZIP: the job asks for its own automatic reruns (every op is
    idempotent), so even an instance that reruns nothing by default reruns it; a drain job's run is not (its rows come back by lease)."""
    with dg.instance_for_test(overrides={"run_retries": {"enabled": True, "max_retries": 0}}) as instance:
        def dies(name: str) -> str | None:
            job = fast_defs.resolve_job_def(name)
            run = instance.create_run_for_job(job_def=job, tags=job.tags)
            instance.report_run_failed(run)  # what Dagster records when the run worker is SIGKILLed
            return instance.get_run_by_id(run.run_id).tags.get("dagster/will_retry")

        assert dies("evidence_file_job") == "true"
        assert dies("criticizer_job") == "false"


def test_a_run_ending_during_the_due_tick_gets_no_second_run(driver, instance, engine) -> None:
    """The due sensor reads a file job's active runs before its due rows. File job P's run is working when the tick
    starts and ends (its rows done) just after the tick read the due rows: P gets no empty second run; Q, due and
    idle, gets its run. (In the other order P's rows were read due, then its run looked idle: a run of nothing.)"""
    from datetime import timedelta

    from redrive import work

    p, q = str(uuid.uuid4()), str(uuid.uuid4())
    instance.add_dynamic_partitions("evidence_file_jobs", [p, q])
    with engine.begin() as conn:
        work.enqueue_many(conn, "evidence", [(f"{p}/r1", p), (f"{q}/r1", q)],
                          now=datetime.now(UTC) - timedelta(seconds=5))
    job = driver.defs.resolve_job_def("evidence_file_job")
    working = instance.create_run_for_job(job, run_config={}, tags={"dagster/partition": p},
                                          status=dg.DagsterRunStatus.STARTED)
    ended: list[bool] = []

    def run_ends(conn, cursor, statement, parameters, context, executemany) -> None:  # type: ignore[no-untyped-def]
        if "group_key" in statement and "GROUP BY" in statement and not ended:
            ended.append(True)  # P's run finishes its rows and ends, right after the due read
            with engine.begin() as c:
                c.execute(sa.update(W).where(W.c.group_key == p).values(status="done"))
            instance.delete_run(working.run_id)

    sa.event.listen(sa.engine.Engine, "after_cursor_execute", run_ends)
    try:
        requests = driver.tick("evidence_due_work")
    finally:
        sa.event.remove(sa.engine.Engine, "after_cursor_execute", run_ends)
    assert ended == [True]
    assert [r.partition_key for r in requests] == [q]


def test_a_lost_inbox_cursor_asks_for_no_zip_ingested_already(driver, s3, bucket, inbox, engine) -> None:
    """The inbox sensor's cursor lost (a reset sensor, a new Dagster storage): the ZIP ingested before gets no second
    (empty) ingest run; a ZIP dropped since still gets its first."""
    first, _ = ingest(driver, s3, bucket, inbox, "ka", rows=1, per_row=1)
    driver.cursors["evidence_inbox"] = None
    assert driver.tick("evidence_inbox") == []
    data, _ = standard_job("kb", 1, 1)
    put_zip(s3, bucket, f"{inbox}kb.zip", data)
    driver.cursors["evidence_inbox"] = None
    [request] = driver.tick("evidence_inbox")
    assert request.partition_key != first and request.run_config["ops"]["ingest_file_job"]["config"]["key"].endswith(
        "kb.zip")
