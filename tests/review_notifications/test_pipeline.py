"""The pipeline end to end as drain runs: the due-work sensor, retries as due rows, dead letters, replays."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import dagster as dg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner as ClickRunner
from typer.testing import CliRunner

from assets.review_notifications import api, policy, repository
from assets.review_notifications.cli import app as rn_cli
from assets.review_notifications.pipeline import JOB_NAME
from orchestration.cli import app as redrive_cli
from redrive import deadletters
from redrive.clock import SystemClock
from redrive.schema import dead_letters, deferred_attempts
from redrive.settings import PROJECT_ROOT
from tests.review_notifications.conftest import (
    RECIPIENTS,
    SENSOR,
    drain_now,
    make_job,
    notifications,
    output,
    rows,
    work_row,
)
from tests.review_notifications.crash_worker import CRASHED


def request(key: str = "req-1", version: int = 3, recipients=RECIPIENTS) -> dict:
    return {"idempotency_key": key, "changelist_id": "CL-1", "review_version": version,
            "recipients": list(recipients), "summary": "Looks good"}


def job_status(engine, key: str) -> str:
    with engine.connect() as conn:
        return repository.job_by_key(conn, key).status


def letters(engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(sa.select(dead_letters).order_by(dead_letters.c.id)).all()


def test_definitions_have_the_drain_job_its_sensor_and_resource(defs) -> None:
    """The code location loads the drain job (one op, no partitions), its due-work sensor and the provider."""
    job = defs.resolve_job_def(JOB_NAME)
    assert job.partitions_def is None
    assert [node.name for node in job.nodes] == ["send_notifications"]
    assert job.nodes[0].definition.retry_policy is not None
    sensors = {s.name for s in defs.sensors}
    assert SENSOR in sensors
    assert not {"review_notifications_pending_jobs", "review_notifications_deferred_retries"} & sensors
    assert "review_mail" in defs.resources


def test_sensor_starts_a_drain_run_for_a_new_job_once(daemon, instance, engine, sandbox) -> None:
    """A created job is due at once; one tick starts one drain run (a round, not the job), the next none."""
    api.submit(engine, request())
    assert work_row(engine, "CL-1:v3").status == "due"
    run = daemon.drain()
    assert run.success
    assert run.dagster_run.tags["dagster/run_key"] == "review_notifications:drain:round-1"
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert work_row(engine, "CL-1:v3").status == "done"
    assert len(notifications(sandbox)) == 3
    assert (output(run)["claimed"], output(run)["sent"], output(run)["jobs_succeeded"]) == (1, 3, 1)
    assert daemon.tick() == []  # worked jobs are not requested again


def test_a_job_created_without_dagster_at_hand_is_worked(daemon, engine, sandbox) -> None:
    """Another service creating jobs through the API alone needs no Dagster instance: its work row is enough."""
    api.submit(engine, request())
    assert daemon.drain().success
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED


def test_versions_v3_noop_v4_rerun_v3_refused(defs, daemon, instance, engine, sandbox) -> None:
    """v3 → v3 is a no-op with the prior result; v3 → v4 mails everyone again under new keys; v4 → v3 is refused."""
    api.submit(engine, request())
    assert daemon.drain().success

    again = api.submit(engine, request(key="req-2"))
    assert again.mode is policy.Mode.NOOP and again.job.result == {"required": 3, "delivered": 3, "failed": 0,
                                                                   "waiting": 0}
    assert daemon.tick() == []
    manual = defs.resolve_job_def(JOB_NAME).execute_in_process(instance=instance)  # even a manual run sends nothing
    assert manual.success and output(manual)["claimed"] == 0
    assert len(notifications(sandbox)) == 3

    v4 = api.submit(engine, request(key="req-3", version=4))
    assert v4.mode is policy.Mode.VERSIONED_RERUN
    assert daemon.drain().success
    sent = sorted((e["to"], e["idempotency_token"]) for e in notifications(sandbox))
    assert sent == sorted((r, policy.provider_token("CL-1", r, v)) for r in RECIPIENTS for v in (3, 4))

    with pytest.raises(policy.VersionRegression, match="REVIEW_VERSION_REGRESSION"):
        api.submit(engine, request(key="req-4", version=3))


def test_crash_after_accept_then_the_pipeline_run_sends_one_email_per_recipient(daemon, engine, db_url,
                                                                               sandbox) -> None:
    """A worker dies after the provider accepted; the next drain backfills that row by lookup and sends the rest."""
    api.submit(engine, request())
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    crashed = subprocess.run([sys.executable, "-m", "tests.review_notifications.crash_worker", db_url, "CL-1:v3",
                              "1"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert crashed.returncode == CRASHED, crashed.stderr[-2000:]
    result = daemon.drain()
    assert result.success
    assert sorted(e["to"] for e in notifications(sandbox)) == sorted(RECIPIENTS)
    assert len(sandbox.requests("mail.send")) == 3
    assert (output(result)["backfilled"], output(result)["sent"]) == (1, 2)


def test_provider_outage_is_retried_by_the_row_falling_due_then_succeeds(daemon, engine, sandbox) -> None:
    """Each 503 makes the job's row due again after the send stage's backoff; the lingering run finishes it."""
    api.submit(engine, request())
    sandbox.script("mail.send", *[{"status": 503}] * policy.ROW_MAX_ATTEMPTS)
    result = daemon.drain()
    assert result.success and output(result)["retried"] == policy.ROW_MAX_ATTEMPTS
    assert len(daemon.instance.get_run_records(dg.RunsFilter(job_name=JOB_NAME))) == 1
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert work_row(engine, "CL-1:v3").attempts == {"send": policy.ROW_MAX_ATTEMPTS + 1}
    assert sorted(e["to"] for e in notifications(sandbox)) == sorted(RECIPIENTS)
    assert letters(engine) == []


def test_bad_credentials_dead_letter_the_job_and_a_replay_finishes_it(daemon, engine, sandbox, db_url) -> None:
    """401: the job's send stage is dead-lettered once (entity = the job) and alerted; after the fix a replay completes."""
    api.submit(engine, request())
    sandbox.script("mail.send", {"status": 401})
    run = daemon.drain()
    assert run.success and output(run)["dead_lettered"] == 1  # a dead-lettered job never fails the drain run
    # … but the run says so in the run list (issue 27: a drain run that dead-letters must not look healthy)
    assert daemon.instance.get_run_by_id(run.run_id).tags["redrive/entities_dead_lettered"] == "1"
    [letter] = letters(engine)
    assert (letter.entity_ref, letter.stage, letter.error_class) == ("CL-1:v3", "send", "PROVIDER_AUTH_DENIED")
    assert job_status(engine, "CL-1:v3") == policy.RETRYABLE_FAILED
    assert len(sandbox.effects("slack.message")) == 1
    assert daemon.tick() == []  # dead: nothing due until an operator acts

    out = ClickRunner().invoke(redrive_cli, ["dlq", "replay", str(letter.id), "--note", "INC-9: token rotated",
                                           "--confirm-safe"], env={"DATABASE_URL": db_url})
    assert out.exit_code == 0, out.output
    assert daemon.drain().success
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert letters(engine)[0].status == "resolved"
    assert sorted(e["to"] for e in notifications(sandbox)) == sorted(RECIPIENTS)


def test_rejected_recipient_replayed_after_the_fix_completes_the_job(daemon, engine, sandbox) -> None:
    """Policy rejection: that row's dead letter; the job waits (retryable_failed); the row's replay sends it once."""
    api.submit(engine, request())
    sandbox.script("mail.send", {"status": 422, "error_code": "content_policy_violation"})
    result = daemon.drain()
    assert result.success  # the job ran; one recipient needs an operator
    assert job_status(engine, "CL-1:v3") == policy.RETRYABLE_FAILED
    [letter] = letters(engine)
    first = rows(engine, repository_job_id(engine))[0]
    assert letter.entity_ref == f"CL-1:v3:d{first.id}" and letter.error_class == "POLICY_REJECTED"
    assert work_row(engine, letter.entity_ref).status == "dead"

    with engine.begin() as conn:
        deadletters.request_replay(conn, letter.id, evidence="INC-10: allow-listed by the provider",
                                   confirm_safe=True, at=SystemClock().now())
    assert daemon.drain().success
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert letters(engine)[0].status == "resolved"
    assert sorted(e["to"] for e in notifications(sandbox)) == sorted(RECIPIENTS)


def test_a_replayed_recipient_refused_again_is_one_letter_escalated(daemon, engine, sandbox) -> None:
    """The replay fails with the same permanent error: the same letter is escalated (§8.5), not closed."""
    api.submit(engine, request(recipients=["gone@invalid.example"]))
    assert daemon.drain().success
    [letter] = letters(engine)
    with engine.begin() as conn:
        deadletters.request_replay(conn, letter.id, evidence="INC-13: retried", confirm_safe=True,
                                   at=SystemClock().now())
    run = daemon.drain()
    assert run.success and output(run)["dead_lettered"] == 1
    [again] = letters(engine)
    assert (again.id, again.status, again.error_class) == (letter.id, "escalated", "INVALID_RECIPIENT")
    assert rows(engine, repository_job_id(engine))[0].status == "failed"
    assert work_row(engine, letter.entity_ref).status == "dead"
    assert job_status(engine, "CL-1:v3") == policy.RETRYABLE_FAILED


def repository_job_id(engine) -> int:
    with engine.connect() as conn:
        return repository.job_by_key(conn, "CL-1:v3").id


def test_waiving_an_invalid_recipient_lets_the_job_succeed(daemon, engine, sandbox, db_url) -> None:
    """An undeliverable address: the operator waives it (`waive ID --note`), its letter closes, the job succeeds."""
    api.submit(engine, request(recipients=["ana@example.com", "gone@invalid.example"]))
    assert daemon.drain().success
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


def test_long_retry_after_is_a_later_due_time_not_a_timer_or_a_waiting_worker(engine, runtime, mail, clock,
                                                                               sandbox) -> None:
    """Retry-After 120 s: the drain ends, the job's row is due at now + 120 s (injected clock), and then sends."""
    make_job(engine, recipients=RECIPIENTS[:1], clock=clock)
    sandbox.script("mail.send", {"status": 429, "headers": {"Retry-After": "120"}})
    first = drain_now(runtime, mail)
    assert (first.claimed, first.retried, first.done) == (1, 1, 0)
    assert job_status(engine, "CL-1:v3") == policy.RETRYABLE_FAILED
    assert work_row(engine, "CL-1:v3").due_at == clock.now() + timedelta(seconds=120)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(deferred_attempts)).scalar() == 0

    assert drain_now(runtime, mail).claimed == 0  # not due yet
    clock.advance(120)
    assert drain_now(runtime, mail).done == 1
    assert job_status(engine, "CL-1:v3") == policy.SUCCEEDED
    assert len(notifications(sandbox)) == 1


def test_replayed_job_letter_closes_while_a_recipient_letter_keeps_the_job_open(daemon, engine, sandbox,
                                                                               db_url) -> None:
    """The job's stage completes on replay (its letter closes); the invalid recipient's own letter stays open."""
    api.submit(engine, request(recipients=["ana@example.com", "gone@invalid.example"]))
    sandbox.script("mail.send", {"status": 401})
    assert daemon.drain().success
    [job_letter] = letters(engine)
    with engine.begin() as conn:
        deadletters.request_replay(conn, job_letter.id, evidence="INC-12: token rotated", confirm_safe=True,
                                   at=SystemClock().now())
    assert daemon.drain().success
    by_entity = {row.entity_ref: row for row in letters(engine)}
    assert by_entity["CL-1:v3"].status == "resolved"
    recipient_letter = next(row for ref, row in by_entity.items() if ref != "CL-1:v3")
    assert (recipient_letter.error_class, recipient_letter.status) == ("INVALID_RECIPIENT", "open")
    assert job_status(engine, "CL-1:v3") == policy.RETRYABLE_FAILED
    assert daemon.tick() == []  # nothing left replaying or due
