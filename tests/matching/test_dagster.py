"""The matching pipeline in the code location: queue sensor → drain run, set-up, replay, backfill, stuck alerts."""

from __future__ import annotations

import json
from datetime import timedelta

import dagster as dg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from assets.matching import repository
from assets.matching.pipeline import matching_drain_job
from orchestration.definitions import build_definitions
from orchestration.cli import app
from redrive.clock import SystemClock
from redrive.schema import alerts, dead_letters
from tests.dagster_helpers import launch, tick
from tests.matching.conftest import MATCH_FIRST, NO_MATCH, TENANT, doc, ingest, prepare, row


@pytest.fixture
def mdefs(monkeypatch, queue_names, scaled_settings):
    """The whole code location, with this test's own matching queues."""
    name, dlq = queue_names
    monkeypatch.setenv("MATCHING_QUEUE_NAME", name)
    monkeypatch.setenv("MATCHING_DLQ_NAME", dlq)
    monkeypatch.setenv("MATCHING_RECEIVE_WAIT_SECONDS", "0")
    monkeypatch.setenv("MATCHING_ADMIN_DOCUMENT_URL", "https://admin.test/d/{document_id}")
    return build_definitions(scaled_settings)


def evaluate(defs, instance, sensor_name: str, cursor: str | None = None):
    sensor = defs.resolve_sensor_def(sensor_name)
    with dg.build_sensor_context(instance=instance, resources=defs.resources, sensor_name=sensor_name,
                                 cursor=cursor) as context:
        return sensor.evaluate_tick(context)


def test_code_location_has_the_matching_jobs_and_sensors(mdefs) -> None:
    """Drain, set-up and re-queue jobs, the queue and stuck sensors, and the matching resource all resolve."""
    jobs = {j.name for j in mdefs.resolve_all_job_defs()}
    assert {"matching_drain_job", "matching_setup_job", "matching_requeue_job"} <= jobs
    sensors = {s.name for s in mdefs.sensors}
    assert {"matching_queue_sensor", "matching_stuck_documents"} <= sensors
    assert mdefs.resources["matching"].queue_name.startswith("matching-t-")


def test_setup_job_creates_queue_and_dlq(mdefs, instance, queue_names) -> None:
    """`matching_setup_job` creates the queue pair with its redrive policy; running it twice is fine."""
    for _ in range(2):
        result = mdefs.resolve_job_def("matching_setup_job").execute_in_process(instance=instance)
        assert result.success
    queue = mdefs.resources["matching"].queue()
    attrs = queue.attributes()
    assert attrs["VisibilityTimeout"] == "60"
    assert json.loads(attrs["RedrivePolicy"])["deadLetterTargetArn"].endswith(queue_names[1])


def test_queue_sensor_requests_a_drain_only_when_messages_are_visible(mdefs, instance, engine) -> None:
    """Empty queue: skip. Visible messages: one drain run, keyed by the cursor's count. Active drain: skip."""
    queue = mdefs.resources["matching"].queue()
    assert not evaluate(mdefs, instance, "matching_queue_sensor").run_requests
    ingest(engine, queue, doc("s-1"), doc("s-2"))

    result = evaluate(mdefs, instance, "matching_queue_sensor", cursor="4")
    [request] = result.run_requests
    assert request.run_key == "matching:drain:queue:attempt-5" and result.cursor == "5"
    assert request.tags["matching/visible_at_request"] == "2"

    instance.create_run_for_job(matching_drain_job, status=dg.DagsterRunStatus.STARTED)
    assert not evaluate(mdefs, instance, "matching_queue_sensor", cursor="5").run_requests


def test_sensor_started_drain_run_matches_the_queue(mdefs, instance, engine, sandbox) -> None:
    """Tick → launch: every message matched in one run, queue empty; the next request gets the next run key."""
    queue = mdefs.resources["matching"].queue()
    ingest(engine, queue, doc("r-1"))
    prepare(engine, "r-1")
    ingest(engine, queue, doc("r-2", references=["INV-r-1"]), doc("r-3", counterparty="Other", references=[]))
    sandbox.set_default("llm", content=MATCH_FIRST)
    [request] = tick(mdefs, instance, "matching_queue_sensor")
    result = launch(mdefs, instance, request)
    assert result.success
    assert result.output_for_node("drain_matching_queue") == {"succeeded": 3}
    with engine.connect() as conn:
        assert repository.status_counts(conn, ["r-1", "r-2", "r-3"]) == {"succeeded": 3}
        assert ("r-1", "r-2") in repository.edges_of(conn, TENANT)
    assert queue.depth().visible == queue.depth().in_flight == 0
    assert tick(mdefs, instance, "matching_queue_sensor") == []

    ingest(engine, queue, doc("r-4"))  # a later tick, even without its cursor, asks for a new run key
    [later] = tick(mdefs, instance, "matching_queue_sensor")
    assert (request.run_key, later.run_key) == ("matching:drain:queue:attempt-1", "matching:drain:queue:attempt-2")


def test_drain_run_leaves_messages_when_its_own_bookkeeping_breaks(mdefs, instance, engine, sandbox) -> None:
    """The document table unreachable: the run fails loudly and the message stays in SQS for redelivery."""
    queue = mdefs.resources["matching"].queue()
    ingest(engine, queue, doc("broken-1"))
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE document RENAME TO document_away"))
    try:
        result = mdefs.resolve_job_def("matching_drain_job").execute_in_process(
            instance=instance, raise_on_error=False)
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE document_away RENAME TO document"))
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "1 deliveries left for redelivery" in failure.event_specific_data.error.message
    assert queue.depth().in_flight == 1  # not deleted: back after its visibility timeout


def cli(db_url: str, *args: str):
    return CliRunner().invoke(app, list(args), env={"DATABASE_URL": db_url}, catch_exceptions=False)


def test_dead_letter_replay_requeues_and_success_closes_it(mdefs, instance, engine, sandbox, db_url) -> None:
    """401 → failed + dead letter; after the fix `redrive dlq replay` re-queues it; the drain resolves it."""
    queue = mdefs.resources["matching"].queue()
    ingest(engine, queue, doc("p-1"))
    prepare(engine, "p-1")
    ingest(engine, queue, doc("p-2", references=["INV-p-1"]))
    queue.purge()
    queue.publish("p-2")
    sandbox.script("llm", {"status": 401})
    drain = mdefs.resolve_job_def("matching_drain_job")
    assert drain.execute_in_process(instance=instance).success  # handled: failed, notified, deleted
    assert row(engine, "p-2")["matching_status"] == "failed"
    [letter_id] = [d["id"] for d in json.loads(cli(db_url, "dlq", "list", "--json").output)]

    sandbox.set_default("llm", content=MATCH_FIRST)  # the key is rotated
    out = cli(db_url, "dlq", "replay", str(letter_id), "--note", "INC-7: LLM key rotated", "--confirm-safe")
    assert out.exit_code == 0, out.output
    [request] = tick(mdefs, instance, "redrive_dead_letter_replays")
    assert request.run_key.startswith("matching:replay-batch:") and request.job_name == "matching_requeue_job"
    assert request.run_config["ops"]["requeue_for_matching"]["config"]["document_ids"] == ["p-2"]
    assert request.tags["redrive/replay_of"] == str(letter_id)
    assert launch(mdefs, instance, request).success
    assert row(engine, "p-2")["matching_status"] == "pending"

    assert drain.execute_in_process(instance=instance).success
    p2 = row(engine, "p-2")
    assert (p2["matching_status"], p2["matching_attempts"]) == ("succeeded", 2)
    with engine.connect() as conn:
        status = conn.execute(sa.select(dead_letters.c.status).where(dead_letters.c.id == letter_id)).scalar()
    assert status == "resolved"


def test_backfill_requeues_failed_and_never_queued_documents(mdefs, instance, engine) -> None:
    """Backfill: failed documents and matchable ones from before the feature are published; others are not."""
    queue = mdefs.resources["matching"].queue()
    ingest(engine, queue, doc("f-1"), doc("old-1"), doc("memo-1", doc_type="memo"), doc("ok-1"))
    queue.purge()
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE document SET matching_status = CASE id WHEN 'f-1' THEN 'failed' "
                             "WHEN 'ok-1' THEN 'succeeded' ELSE NULL END"))
    result = mdefs.resolve_job_def("matching_requeue_job").execute_in_process(
        instance=instance,
        run_config={"ops": {"requeue_for_matching": {"config": {"statuses": ["failed"], "tenant": TENANT,
                                                                 "include_never_queued": True}}}})
    assert result.success and result.output_for_node("requeue_for_matching") == 2
    published = sorted(json.loads(m.body)["document_id"] for m in queue.receive(10, 0))
    assert published == ["f-1", "old-1"]
    assert row(engine, "memo-1")["matching_status"] is None and row(engine, "ok-1")["matching_status"] == "succeeded"


def test_requeue_refuses_an_unknown_status(mdefs, instance) -> None:
    """A typo in statuses is a clear failure, not a silent zero."""
    result = mdefs.resolve_job_def("matching_requeue_job").execute_in_process(
        instance=instance, raise_on_error=False,
        run_config={"ops": {"requeue_for_matching": {"config": {"statuses": ["faild"]}}}})
    assert not result.success


def make_in_progress(engine, doc_id: str, minutes_ago: float) -> None:
    with engine.begin() as conn:
        repository.mark_in_progress(conn, doc_id, SystemClock().now() - timedelta(minutes=minutes_ago))


def test_stuck_in_progress_alerts_once_per_document_and_delivery(mdefs, instance, engine, sandbox) -> None:
    """In-progress for 11 min: one alert (with admin link); again on the next tick: none; a new stuck delivery: one."""
    queue = mdefs.resources["matching"].queue()
    ingest(engine, queue, doc("stuck-1"), doc("fresh-1"))
    make_in_progress(engine, "stuck-1", 11)
    make_in_progress(engine, "fresh-1", 1)

    assert "1 newly alerted" in evaluate(mdefs, instance, "matching_stuck_documents").skip_message
    assert "0 newly alerted" in evaluate(mdefs, instance, "matching_stuck_documents").skip_message
    [slack] = sandbox.effects("slack.message")
    text = slack["payload"]["text"]
    assert "stuck-1" in text and "delivery 1" in text and "https://admin.test/d/stuck-1" in text

    make_in_progress(engine, "stuck-1", 12)  # redelivered, and the worker crashed again
    assert "1 newly alerted" in evaluate(mdefs, instance, "matching_stuck_documents").skip_message
    with engine.connect() as conn:
        keys = sorted(conn.execute(sa.select(alerts.c.dedupe_key)).scalars())
    assert keys == ["matching:stuck:stuck-1:delivery-1", "matching:stuck:stuck-1:delivery-2"]


def test_drain_run_with_no_match_answer(mdefs, instance, engine, sandbox) -> None:
    """The run's metadata counts LLM calls and edges; an empty decision writes no edge."""
    queue = mdefs.resources["matching"].queue()
    ingest(engine, queue, doc("n-1"))
    prepare(engine, "n-1")
    ingest(engine, queue, doc("n-2"))
    queue.purge()
    queue.publish("n-2")
    sandbox.set_default("llm", content=NO_MATCH)
    result = mdefs.resolve_job_def("matching_drain_job").execute_in_process(instance=instance)
    assert result.output_for_node("drain_matching_queue") == {"succeeded": 1}
    output = next(e for e in result.all_events if e.event_type_value == "STEP_OUTPUT")
    metadata = output.event_specific_data.metadata
    assert metadata["llm_calls"].value == 1 and metadata["edges_written"].value == 0


@pytest.mark.parametrize(("value", "in_flight"), [(None, None), ("70", 70)])
def test_in_flight_setting_sizes_the_drain_runs_worker(scaled_settings, monkeypatch, value, in_flight) -> None:
    """MATCHING_IN_FLIGHT (issue 26 §2) reaches the worker a drain run builds: how many documents it works at once
    (a thread each) to fill the LLM's slots; unset, two batches."""
    from assets.matching.pipeline import build_worker

    monkeypatch.setenv("MATCHING_BATCH_SIZE", "5")
    if value is None:
        monkeypatch.delenv("MATCHING_IN_FLIGHT", raising=False)
    else:
        monkeypatch.setenv("MATCHING_IN_FLIGHT", value)
    resources = build_definitions(scaled_settings).resources
    built = build_worker(dg.build_op_context(), resources["reliability"], resources["matching"], resources["llm"])
    assert built.config.batch_size == 5
    assert built.config.in_flight == in_flight
