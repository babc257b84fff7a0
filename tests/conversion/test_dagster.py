"""The conversion pipeline in the code location: sensor decisions, worker runs, replay, and WORKER_CONCURRENCY."""

from __future__ import annotations

import ctypes
import errno
import json

import dagster as dg
import pytest
import sqlalchemy as sa
import yaml
from click.testing import CliRunner

from assets.conversion import files as files_module
from assets.conversion import pipeline
from assets.conversion.policy import dispatch
from assets.conversion.settings import ConversionSettings
from devstack.stack import DAGSTER_YAML
from redrive.breaker import CircuitBreaker
from orchestration.cli import app as redrive_cli
from redrive.schema import dead_letters
from sensors.core import should_alert_run_failure
from tests.conversion.conftest import job
from tests.dagster_helpers import evaluate_failure_sensor, launch, tick


@pytest.fixture
def conv_defs(monkeypatch, conv_settings, scaled_settings):
    """The whole code location on this test's database, with the conversion knobs of `conv_settings`."""
    from orchestration.definitions import build_definitions

    for key, value in {"UPLOADS_DIR": conv_settings.uploads_dir, "RESULTS_DIR": conv_settings.results_dir,
                       "WORKER_IDLE_EXIT_SEC": 0, "WORKER_IDLE_SLEEP_SEC": 0.01, "WORKER_LEASE_TTL_SEC": 5,
                       "CIRCUIT_COOLDOWN_MS": 0}.items():
        monkeypatch.setenv(key, str(value))
    return build_definitions(scaled_settings)


def sensor_requests(defs, instance) -> list[dg.RunRequest]:
    return tick(defs, instance, "conversion_workers")


def test_dispatch_policy_table() -> None:
    """Workers only while due work and a closed breaker; never more than WORKER_RUNS runs, nor more runs than the
    due jobs fill at WORKER_CONCURRENCY each (runs × concurrency in flight, not concurrency²); probe when open."""
    def runs(due: int, in_flight: int, max_runs: int = 4, per_run: int = 4) -> int:
        return dispatch(due=due, in_flight=in_flight, max_runs=max_runs, per_run=per_run, breaker_open=False,
                        probe_due=False).worker_runs

    assert runs(due=0, in_flight=0) == 0
    assert runs(due=2, in_flight=0) == 1  # one run holds both in flight
    assert runs(due=9, in_flight=0) == 3  # 4 + 4 + 1
    assert runs(due=50, in_flight=1) == 3
    assert runs(due=50, in_flight=4) == 0
    assert runs(due=50, in_flight=0, max_runs=1, per_run=32) == 1
    held = dispatch(due=50, in_flight=0, max_runs=4, per_run=4, breaker_open=True, probe_due=False)
    assert (held.worker_runs, held.probe) == (0, False) and "breaker open" in held.reason
    assert dispatch(due=50, in_flight=0, max_runs=4, per_run=4, breaker_open=True, probe_due=True).probe


def test_sensor_requests_workers_for_due_work_and_a_run_drains_the_queue(conv_defs, instance, engine, submit) -> None:
    """Due jobs → worker runs keyed by a cursor counter (no wall clock); a launched run converts them all."""
    assert sensor_requests(conv_defs, instance) == []
    ids = [submit() for _ in range(3)]
    requests = sensor_requests(conv_defs, instance)
    assert [r.run_key for r in requests] == ["conversion:worker:1"]  # WORKER_RUNS=1; its 4 slots hold all three
    assert all(r.tags["redrive/pipeline"] == "conversion" for r in requests)
    result = launch(conv_defs, instance, requests[0])
    assert result.success
    assert result.output_for_node("convert_due_jobs")["succeeded"] == 3
    assert {job(engine, i).status for i in ids} == {"succeeded"}


def test_sensor_holds_while_the_breaker_is_open_and_asks_for_a_probe(conv_defs, instance, engine, submit,
                                                                     sandbox, conv_settings) -> None:
    """Breaker open: no worker run while jobs are due, one probe run; the probe closes it once the gateway is healthy.

    A probe that finds the gateway still down is a failed run (issue 16 §4: it shows as failing in the UI),
    tagged so the run-failure sensor adds no dead letter (the breaker's own alert went out when it opened).
    """
    submit()
    breaker = CircuitBreaker(engine, "pdf-gateway", conv_settings.breaker_policy())
    for _ in range(10):
        breaker.record(ok=False)
    [probe] = sensor_requests(conv_defs, instance)
    assert probe.job_name == "conversion_breaker_probe_job"
    sandbox.script("pdf.health", {"status": 503})
    failed = launch(conv_defs, instance, probe)
    assert not failed.success
    run = instance.get_run_by_id(failed.run_id)
    assert run.status == dg.DagsterRunStatus.FAILURE
    assert not should_alert_run_failure(run.tags)
    assert "health probe failed" in failed.failure_data_for_node("probe_gateway").error.message
    assert not breaker.allows()  # still unhealthy
    [again] = sensor_requests(conv_defs, instance)
    assert again.run_key != probe.run_key
    assert launch(conv_defs, instance, again).success
    assert breaker.allows()
    assert [r.job_name for r in sensor_requests(conv_defs, instance)] == ["conversion_worker_job"]


def test_sensor_counts_conversion_runs_in_flight_against_worker_runs(conv_defs, instance, submit, monkeypatch,
                                                                    scaled_settings) -> None:
    """With WORKER_RUNS=3 and WORKER_CONCURRENCY=4: 10 due jobs fill three runs; with two runs not finished yet the
    sensor asks for one more, with three for none."""
    from orchestration.definitions import build_definitions

    monkeypatch.setenv("WORKER_RUNS", "3")  # on top of conv_defs' knobs, still set
    monkeypatch.setenv("WORKER_CONCURRENCY", "4")
    defs = build_definitions(scaled_settings)
    for _ in range(10):
        submit()
    job_def = defs.resolve_job_def("conversion_worker_job")
    assert len(sensor_requests(defs, instance)) == 3
    for _ in range(2):
        instance.create_run_for_job(job_def, tags=pipeline.TAGS, status=dg.DagsterRunStatus.NOT_STARTED)
    assert len(sensor_requests(defs, instance)) == 1
    instance.create_run_for_job(job_def, tags=pipeline.TAGS, status=dg.DagsterRunStatus.STARTED)
    assert sensor_requests(defs, instance) == []


def test_worker_runs_is_the_instance_tag_limit_on_every_conversion_job() -> None:
    """dagster.yaml limits runs tagged redrive/pipeline=conversion to WORKER_RUNS; all our jobs carry the tag."""
    limits = yaml.safe_load(DAGSTER_YAML)["run_coordinator"]["config"]["tag_concurrency_limits"]
    [limit] = [lim for lim in limits if lim["key"] == "redrive/pipeline" and lim["value"] == "conversion"]
    assert limit["limit"] == ConversionSettings().worker_runs
    for job_def in (pipeline.conversion_worker_job, pipeline.conversion_breaker_probe_job,
                    pipeline.conversion_replay_job):
        assert job_def.tags["redrive/pipeline"] == "conversion"


def test_dead_letter_replay_requeues_and_the_next_worker_run_closes_it(conv_defs, instance, engine, submit,
                                                                       sandbox, db_url) -> None:
    """`redrive dlq replay` → the replay sensor's run requeues the failed job → a worker run converts it → resolved."""
    job_id = submit()
    sandbox.script("pdf.convert", {"status": 400})
    assert launch(conv_defs, instance, sensor_requests(conv_defs, instance)[0]).success
    assert job(engine, job_id).status == "failed"
    listed = json.loads(CliRunner().invoke(redrive_cli, ["dlq", "list", "--json"], env={"DATABASE_URL": db_url}).output)
    [letter] = [d for d in listed if d["pipeline"] == "conversion"]
    out = CliRunner().invoke(redrive_cli, ["dlq", "replay", str(letter["id"]), "--note", "INC-7: mapping fixed",
                                           "--confirm-safe"], env={"DATABASE_URL": db_url})
    assert out.exit_code == 0, out.output
    [replay] = tick(conv_defs, instance, "redrive_dead_letter_replays")
    assert replay.job_name == "conversion_replay_job"
    assert launch(conv_defs, instance, replay).success
    assert job(engine, job_id).status == "queued"
    assert launch(conv_defs, instance, sensor_requests(conv_defs, instance)[0]).success
    assert job(engine, job_id).status == "succeeded"
    with engine.connect() as conn:
        assert conn.execute(sa.select(dead_letters.c.status)).scalar() == "resolved"


def _replay_tick(defs, instance, sensor, cursor):
    with dg.build_sensor_context(instance=instance, resources=defs.resources, cursor=cursor,
                                 repository_def=defs.get_repository_def()) as context:
        data = sensor.evaluate_tick(context)
    return list(data.run_requests or []), data.cursor


def test_replays_of_a_requeue_pipeline_are_batched_and_the_cursor_walks_the_backlog(
        conv_defs, instance, engine, submit, sandbox, clock) -> None:
    """60 dead letters replayed: ticks of 25 give three requeue runs (25, 25, 10), not 60; a fourth tick starts nothing;
    a letter whose replay failed again and is replayed once more comes round in the next tick."""
    from orchestration.pipelines.conversion import pipeline_defs
    from redrive import deadletters
    from redrive.settings import Settings
    from sensors.core import REPLAY_TAG, dead_letter_replay_sensor

    ids = [submit(name=f"doc-{i}.pdf") for i in range(60)]
    sandbox.script("pdf.convert", *[{"status": 400}] * 60)
    assert launch(conv_defs, instance, sensor_requests(conv_defs, instance)[0]).success
    assert {job(engine, i).status for i in ids} == {"failed"}
    with engine.begin() as conn:
        letters = conn.execute(sa.select(dead_letters.c.id, dead_letters.c.entity_ref)
                               .where(dead_letters.c.pipeline == "conversion")).all()
        for letter in letters:
            deadletters.request_replay(conn, letter.id, evidence="INC-9: gateway mapping fixed", confirm_safe=True,
                                       at=clock.now())
    assert len(letters) == 60

    sensor = dead_letter_replay_sensor(pipeline_defs(Settings()).replay_targets, limit=25)
    cursor, batches = None, []
    for _ in range(4):
        requests, cursor = _replay_tick(conv_defs, instance, sensor, cursor)
        batches.append(requests)
    assert [len(b) for b in batches] == [1, 1, 1, 0]
    requeued = [r.run_config["ops"]["requeue_failed_job"]["config"]["job_ids"] for [r] in batches[:3]]
    assert [len(b) for b in requeued] == [25, 25, 10]
    assert sorted(sum(requeued, [])) == sorted(ids)  # each letter once
    for [request] in batches[:3]:
        assert request.tags[REPLAY_TAG] and launch(conv_defs, instance, request).success
    assert {job(engine, i).status for i in ids} == {"queued"}

    sandbox.script("pdf.convert", *[{"status": 400}] * 60)  # the replays fail again: letters leave replaying
    assert launch(conv_defs, instance, sensor_requests(conv_defs, instance)[0]).success
    again = next(letter for letter in letters if letter.entity_ref == ids[7])
    with engine.begin() as conn:
        assert deadletters.get(conn, again.id).status == "escalated"  # the same class after a replay (§8.5)
        deadletters.request_replay(conn, again.id, evidence="INC-9 second fix", confirm_safe=True, at=clock.now())
    [[request], cursor] = _replay_tick(conv_defs, instance, sensor, cursor)
    assert request.run_config["ops"]["requeue_failed_job"]["config"]["job_ids"] == [ids[7]]
    assert _replay_tick(conv_defs, instance, sensor, cursor)[0] == []


def test_a_failed_batch_replay_run_reopens_its_letters_for_another_replay(
        conv_defs, instance, engine, submit, sandbox, clock) -> None:
    """A batch replay run dies before it requeues anything (its worker killed): its letters do not stay
    `replaying` for ever. The run-failure sensor opens them again, alerts once, and records no `run:<id>`
    letter; the operator's next replay of them is accepted and the replay sensor starts it."""
    from orchestration.pipelines.conversion import pipeline_defs
    from redrive import deadletters
    from redrive.settings import Settings
    from sensors.core import dead_letter_replay_sensor, replayed_letters

    ids = [submit(name=f"doc-{i}.pdf") for i in range(3)]
    sandbox.script("pdf.convert", *[{"status": 400}] * 3)
    assert launch(conv_defs, instance, sensor_requests(conv_defs, instance)[0]).success
    with engine.begin() as conn:
        letter_ids = conn.execute(sa.select(dead_letters.c.id).where(dead_letters.c.pipeline == "conversion")
                                  .order_by(dead_letters.c.id)).scalars().all()
        for letter_id in letter_ids:
            deadletters.request_replay(conn, letter_id, evidence="INC-7: mapping fixed", confirm_safe=True,
                                       at=clock.now())
    slack_before = sandbox.count("slack.message")

    sensor = dead_letter_replay_sensor(pipeline_defs(Settings()).replay_targets)
    [request], cursor = _replay_tick(conv_defs, instance, sensor, None)
    assert sorted(replayed_letters(request.tags)) == sorted(letter_ids)
    job_def = conv_defs.resolve_job_def(request.job_name)
    run = instance.create_run_for_job(job_def=job_def, run_config=request.run_config,
                                      tags={**job_def.tags, **request.tags})
    instance.report_run_failed(run)  # what the code server records for a run whose worker was SIGKILLed

    evaluate_failure_sensor(conv_defs, instance, run.run_id)
    evaluate_failure_sensor(conv_defs, instance, run.run_id)  # the same failure seen twice

    with engine.begin() as conn:
        letters = [deadletters.get(conn, i) for i in letter_ids]
        run_letters = conn.execute(sa.select(sa.func.count()).select_from(dead_letters)
                                   .where(dead_letters.c.entity_ref.like("run:%"))).scalar_one()
        assert {letter.status for letter in letters} == {"open"}
        assert all(letter.notes[-1]["kind"] == "replay_failed" and run.run_id in letter.notes[-1]["text"]
                   for letter in letters)
        assert run_letters == 0
        deadletters.request_replay(conn, letter_ids[0], evidence="INC-7: rerun", confirm_safe=True, at=clock.now())
    alerts = sandbox.effects("slack.message")[slack_before:]
    assert len(alerts) == 1 and run.run_id in alerts[0]["payload"]["text"]
    assert "3 of its 3 dead letters are open again" in alerts[0]["payload"]["text"]

    [again], _ = _replay_tick(conv_defs, instance, sensor, cursor)
    assert replayed_letters(again.tags) == [letter_ids[0]]
    assert again.run_config["ops"]["requeue_failed_job"]["config"]["job_ids"] == [letters[0].entity_ref]
    assert {letter.entity_ref for letter in letters} == set(ids)


@pytest.mark.skipif(files_module._syncfs_call() is None, reason="RESULTS_SYNC=turn needs Linux 5.8+")
def test_a_worker_run_whose_results_are_not_durable_is_retried_by_dagster_with_a_clean_worker(
        conv_defs, instance, engine, submit, monkeypatch, conv_settings) -> None:
    """A write error syncfs reports fails the worker's op (its leases given back), with a canonical message and
    no path; Dagster's op retry starts a new worker with a new store, which converts every job."""
    real, calls = files_module._syncfs_call(), []

    def fails_once(fd: int) -> int:
        calls.append(fd)
        if len(calls) == 1:
            ctypes.set_errno(errno.EIO)
            return -1
        return real(fd)

    monkeypatch.setattr(files_module, "_syncfs_call", lambda: fails_once)
    ids = [submit() for _ in range(3)]
    [request] = sensor_requests(conv_defs, instance)
    result = launch(conv_defs, instance, request)
    assert result.success
    assert {job(engine, i).status for i in ids} == {"succeeded"}
    assert result.output_for_node("convert_due_jobs")["succeeded"] == 3  # all by the retried attempt
    failures = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE
                or e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]
    assert failures, "the first attempt failed and was retried"
    text = json.dumps([str(e.event_specific_data) for e in failures])
    assert "convert_due_jobs: UNKNOWN: unclassified error (ResultsNotDurable)" in text  # named, retried, not a bug
    assert str(conv_settings.results_dir) not in text and "Input/output" not in text  # no data path nor OS detail
