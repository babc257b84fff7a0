"""The Dagster job end to end: partitions, the sensor, stage retries, dead letters, replays, durable timers."""

from __future__ import annotations

import os
import subprocess
import sys

import dagster as dg
import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from assets.review_notifications import api, policy, repository
from assets.review_notifications.cli import app as rn_cli
from assets.review_notifications.pipeline import JOB_NAME
from orchestration.definitions import build_definitions
from redrive import deadletters
from orchestration.cli import app as redrive_cli
from redrive.clock import SystemClock
from redrive.schema import dead_letters, deferred_attempts
from redrive.settings import PROJECT_ROOT
from tests.review_notifications.conftest import RECIPIENTS, notifications, rows, tick
from tests.review_notifications.crash_worker import CRASHED

SENSOR = "review_notifications_pending_jobs"


def request(key: str = "req-1", version: int = 3, recipients=RECIPIENTS) -> dict:
    return {"idempotency_key": key, "changelist_id": "CL-1", "review_version": version,
            "recipients": list(recipients), "summary": "Looks good"}


def launch(defs: dg.Definitions, instance: dg.DagsterInstance, req: dg.RunRequest) -> dg.ExecuteInProcessResult:
    """Run a sensor's request as the daemon would, on its partition (the shared helper drops partition keys)."""
    tags = {**(req.tags or {}), **({"dagster/run_key": req.run_key} if req.run_key else {})}
    return defs.resolve_job_def(req.job_name or JOB_NAME).execute_in_process(
        run_config=req.run_config, tags=tags, instance=instance, partition_key=req.partition_key,
        raise_on_error=False)


def run_partition(defs, instance, key: str, run_config: dict | None = None) -> dg.ExecuteInProcessResult:
    return defs.resolve_job_def(JOB_NAME).execute_in_process(run_config=run_config or {}, instance=instance,
                                                             partition_key=key, raise_on_error=False)


def job_status(engine, key: str) -> str:
    with engine.connect() as conn:
        return repository.job_by_key(conn, key).status


def step_retries(instance, result) -> int:
    return len(instance.get_records_for_run(result.run_id, of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY).records)


def letters(engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(sa.select(dead_letters).order_by(dead_letters.c.id)).all()


def test_definitions_have_the_partitioned_job_sensor_and_resource(defs) -> None:
    """The code location loads the job (dynamic partitions), its sensor, its retry sensor and the provider."""
    job = defs.resolve_job_def(JOB_NAME)
    assert isinstance(job.partitions_def, dg.DynamicPartitionsDefinition)
    assert job.partitions_def.name == api.PARTITIONS_NAME
    sensors = {s.name for s in defs.sensors}
    assert {SENSOR, "review_notifications_deferred_retries"} <= sensors
    assert "review_mail" in defs.resources


def test_sensor_starts_each_new_job_once_on_its_partition(defs, instance, engine, sandbox) -> None:
    """A created job is a partition; the sensor requests its first run under a stable run key."""
    api.create_job(engine, request(), instance=instance)
    assert instance.has_dynamic_partition(api.PARTITIONS_NAME, "CL-1:v3")
    [req] = tick(defs, instance, SENSOR)
    assert (req.partition_key, req.run_key) == ("CL-1:v3", "review_notifications:run:CL-1:v3:attempt-1")
    result = launch(defs, instance, req)
    assert result.success
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert len(notifications(sandbox)) == 3
    assert tick(defs, instance, SENSOR) == []  # started jobs are not requested again


def test_sensor_registers_partitions_of_jobs_created_without_an_instance(defs, instance, engine) -> None:
    """A job created by another service (no Dagster instance at hand) gets its partition from the sensor."""
    api.submit(engine, request())
    sensor = defs.resolve_sensor_def(SENSOR)
    with dg.partition_loading_context(dynamic_partitions_store=instance), \
            dg.build_sensor_context(instance=instance, resources=defs.resources, sensor_name=SENSOR,
                                    repository_def=defs.get_repository_def(),
                                    instance_ref=instance.get_ref()) as context:
        result = sensor.evaluate_tick(context)
    assert [r.partition_keys for r in result.dynamic_partitions_requests] == [["CL-1:v3"]]
    assert [r.partition_key for r in result.run_requests] == ["CL-1:v3"]


def test_versions_v3_noop_v4_rerun_v3_refused(defs, instance, engine, sandbox) -> None:
    """v3 → v3 is a no-op with the prior result; v3 → v4 mails everyone again under new keys; v4 → v3 is refused."""
    api.create_job(engine, request(), instance=instance)
    assert run_partition(defs, instance, "CL-1:v3").success

    again = api.create_job(engine, request(key="req-2"), instance=instance)
    assert again.mode is policy.Mode.NOOP and again.job.result == {"required": 3, "delivered": 3, "failed": 0,
                                                                   "waiting": 0}
    assert tick(defs, instance, SENSOR) == []
    assert run_partition(defs, instance, "CL-1:v3").success  # even a manual rerun of the partition sends nothing
    assert len(notifications(sandbox)) == 3

    v4 = api.create_job(engine, request(key="req-3", version=4), instance=instance)
    assert v4.mode is policy.Mode.VERSIONED_RERUN
    [req] = tick(defs, instance, SENSOR)
    assert launch(defs, instance, req).success
    sent = sorted((e["to"], e["idempotency_token"]) for e in notifications(sandbox))
    assert sent == sorted((r, policy.provider_token("CL-1", r, v)) for r in RECIPIENTS for v in (3, 4))

    with pytest.raises(policy.VersionRegression, match="REVIEW_VERSION_REGRESSION"):
        api.create_job(engine, request(key="req-4", version=3), instance=instance)


def test_crash_after_accept_then_the_pipeline_run_sends_one_email_per_recipient(defs, instance, engine, db_url,
                                                                               sandbox) -> None:
    """A worker dies after the provider accepted; the next run backfills that row by lookup and sends the rest."""
    api.create_job(engine, request(), instance=instance)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    crashed = subprocess.run([sys.executable, "-m", "tests.review_notifications.crash_worker", db_url, "CL-1:v3",
                              "1"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert crashed.returncode == CRASHED, crashed.stderr[-2000:]
    result = run_partition(defs, instance, "CL-1:v3")
    assert result.success
    assert sorted(e["to"] for e in notifications(sandbox)) == sorted(RECIPIENTS)
    assert len(sandbox.requests("mail.send")) == 3
    meta = result.output_for_node("send_notifications")
    assert (meta["backfilled"], meta["sent"]) == (1, 2)


def test_provider_outage_is_retried_by_the_stage_then_succeeds(defs, instance, engine, sandbox) -> None:
    """The in-process budget runs out; the stage's RetryRequested runs the op again; nothing is sent twice."""
    api.create_job(engine, request(), instance=instance)
    sandbox.script("mail.send", *[{"status": 503}] * policy.ROW_MAX_ATTEMPTS)
    result = run_partition(defs, instance, "CL-1:v3")
    assert result.success and step_retries(instance, result) == 1
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert sorted(e["to"] for e in notifications(sandbox)) == sorted(RECIPIENTS)
    assert letters(engine) == []


def test_bad_credentials_dead_letter_the_job_and_a_replay_finishes_it(defs, instance, engine, sandbox,
                                                                     db_url) -> None:
    """401: the job's send stage is dead-lettered once (entity = the job) and alerted; after the fix a replay completes."""
    api.create_job(engine, request(), instance=instance)
    sandbox.script("mail.send", {"status": 401})
    assert not run_partition(defs, instance, "CL-1:v3").success
    [letter] = letters(engine)
    assert (letter.entity_ref, letter.stage, letter.error_class) == ("CL-1:v3", "send", "PROVIDER_AUTH_DENIED")
    assert job_status(engine, "CL-1:v3") == policy.RETRYABLE_FAILED
    assert len(sandbox.effects("slack.message")) == 1

    out = CliRunner().invoke(redrive_cli, ["dlq", "replay", str(letter.id), "--note", "INC-9: token rotated",
                                           "--confirm-safe"], env={"DATABASE_URL": db_url})
    assert out.exit_code == 0, out.output
    [req] = tick(defs, instance, "redrive_dead_letter_replays")
    assert req.partition_key == "CL-1:v3"
    assert launch(defs, instance, req).success
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert letters(engine)[0].status == "resolved"
    assert sorted(e["to"] for e in notifications(sandbox)) == sorted(RECIPIENTS)


def test_rejected_recipient_replayed_after_the_fix_completes_the_job(defs, instance, engine, sandbox) -> None:
    """Policy rejection: that row's dead letter; the job waits (retryable_failed); the row's replay sends it once."""
    api.create_job(engine, request(), instance=instance)
    sandbox.script("mail.send", {"status": 422, "error_code": "content_policy_violation"})
    result = run_partition(defs, instance, "CL-1:v3")
    assert result.success  # the job ran; one recipient needs an operator
    assert job_status(engine, "CL-1:v3") == policy.RETRYABLE_FAILED
    [letter] = letters(engine)
    first = rows(engine, repository_job_id(engine))[0]
    assert letter.entity_ref == f"CL-1:v3:d{first.id}" and letter.error_class == "POLICY_REJECTED"

    with engine.begin() as conn:
        deadletters.request_replay(conn, letter.id, evidence="INC-10: allow-listed by the provider",
                                   confirm_safe=True, at=SystemClock().now())
    [req] = tick(defs, instance, "redrive_dead_letter_replays")
    assert req.partition_key == "CL-1:v3"
    assert launch(defs, instance, req).success
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert letters(engine)[0].status == "resolved"
    assert sorted(e["to"] for e in notifications(sandbox)) == sorted(RECIPIENTS)


def repository_job_id(engine) -> int:
    with engine.connect() as conn:
        return repository.job_by_key(conn, "CL-1:v3").id


def test_waiving_an_invalid_recipient_lets_the_job_succeed(defs, instance, engine, sandbox, db_url) -> None:
    """An undeliverable address: the operator waives it (`waive ID --note`), its letter closes, the job succeeds."""
    api.create_job(engine, request(recipients=["ana@example.com", "gone@invalid.example"]), instance=instance)
    assert run_partition(defs, instance, "CL-1:v3").success
    assert job_status(engine, "CL-1:v3") == policy.RETRYABLE_FAILED
    failed = rows(engine, repository_job_id(engine))[1]
    refused = CliRunner().invoke(rn_cli, ["waive", str(failed.id)], env={"DATABASE_URL": db_url})
    assert refused.exit_code == 2 and "--note" in refused.stderr
    out = CliRunner().invoke(rn_cli, ["waive", str(failed.id), "--note", "INC-11: reviewer left"],
                             env={"DATABASE_URL": db_url})
    assert out.exit_code == 0, out.output
    assert "succeeded" in out.stdout
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert [row.status for row in letters(engine)] == ["resolved"]


def test_long_retry_after_becomes_a_durable_timer_and_its_sensor_finishes_the_job(scaled_settings, instance,
                                                                                   engine, sandbox) -> None:
    """Retry-After 120 s over a 60 s threshold: no worker waits; the timer's run (attempt 2) sends."""
    settings = scaled_settings.model_copy(update={"redrive_durable_wait_threshold_seconds": 60.0})
    defs = build_definitions(settings)
    api.create_job(engine, request(recipients=RECIPIENTS[:1]), instance=instance)
    sandbox.script("mail.send", *[{"status": 429, "headers": {"Retry-After": "120"}}] * policy.ROW_MAX_ATTEMPTS)
    first = run_partition(defs, instance, "CL-1:v3")
    assert first.success and instance.get_run_by_id(first.run_id).tags["redrive/deferred"] == "true"
    assert job_status(engine, "CL-1:v3") == policy.RETRYABLE_FAILED
    with engine.connect() as conn:
        timer = conn.execute(sa.select(deferred_attempts)).one()
    assert (timer.entity_ref, timer.attempt) == ("CL-1:v3", 2)

    with engine.begin() as conn:  # let the (scaled) wait pass
        conn.execute(sa.update(deferred_attempts).values(due_at=sa.func.now()))
    [req] = tick(defs, instance, "review_notifications_deferred_retries")
    assert (req.partition_key, req.run_key) == ("CL-1:v3", "review_notifications:run:CL-1:v3:attempt-2")
    assert launch(defs, instance, req).success
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert len(notifications(sandbox)) == 1


def test_replayed_job_letter_closes_while_a_recipient_letter_keeps_the_job_open(defs, instance, engine, sandbox,
                                                                               db_url) -> None:
    """The job's stage completes on replay (its letter closes); the invalid recipient's own letter stays open."""
    api.create_job(engine, request(recipients=["ana@example.com", "gone@invalid.example"]), instance=instance)
    sandbox.script("mail.send", {"status": 401})
    assert not run_partition(defs, instance, "CL-1:v3").success
    [job_letter] = letters(engine)
    with engine.begin() as conn:
        deadletters.request_replay(conn, job_letter.id, evidence="INC-12: token rotated", confirm_safe=True,
                                   at=SystemClock().now())
    [req] = tick(defs, instance, "redrive_dead_letter_replays")
    assert launch(defs, instance, req).success
    by_entity = {row.entity_ref: row for row in letters(engine)}
    assert by_entity["CL-1:v3"].status == "resolved"
    recipient_letter = next(row for ref, row in by_entity.items() if ref != "CL-1:v3")
    assert (recipient_letter.error_class, recipient_letter.status) == ("INVALID_RECIPIENT", "open")
    assert job_status(engine, "CL-1:v3") == policy.RETRYABLE_FAILED
    assert tick(defs, instance, "redrive_dead_letter_replays") == []  # nothing left replaying
