"""Review notifications at volume (issue 12): many jobs per run, a killed drain, retries as due rows, status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from datetime import timedelta

import dagster as dg
import sqlalchemy as sa
from alembic import command
from typer.testing import CliRunner

from assets.review_notifications import api, pipeline, policy, repository
from assets.review_notifications.cli import app as rn_cli
from devstack.postgres import create_database, drop_database, with_database
from redrive import deadletters, work
from redrive.clock import FrozenClock, SystemClock
from redrive.db import alembic_config, engine_for
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from redrive.schema import deferred_attempts, work_items
from redrive.settings import PROJECT_ROOT
from tests.review_notifications.conftest import (
    RECIPIENTS,
    drain_now,
    make_job,
    notifications,
    output,
    rows,
    work_row,
)


def posts(sandbox) -> list[dict]:
    return [r for r in sandbox.requests("mail.send") if r["method"] == "POST"]


def test_a_hundred_jobs_are_worked_by_at_most_two_runs(daemon, instance, engine, sandbox) -> None:
    """100 review jobs (200 recipients) created at once: ≤ 2 drain runs in the instance, every job succeeded once."""
    for i in range(100):
        make_job(engine, key=f"req-{i}", changelist=f"CL-{i}", recipients=RECIPIENTS[:2])
    while daemon.tick():
        assert len(daemon.runs) <= 2, "more than two drain runs for 100 jobs"
    assert len(instance.get_run_records(dg.RunsFilter(job_name=pipeline.JOB_NAME))) <= 2
    assert all(run.success for run in daemon.runs)
    assert sum(output(run)["jobs_succeeded"] for run in daemon.runs) == 100
    with engine.connect() as conn:
        assert repository.job_status_counts(conn) == {policy.SUCCEEDED: 100}
        assert work.counts(conn, policy.PIPELINE) == {"done": 100}
    tokens = Counter(e["idempotency_token"] for e in notifications(sandbox))
    assert len(tokens) == 200 and set(tokens.values()) == {1}
    assert len(posts(sandbox)) == 200


def test_sigkill_mid_drain_loses_nothing_and_sends_nothing_twice(daemon, engine, db_url, sandbox) -> None:
    """A drain process killed between a provider's 202 and its mark write: the next drain run reclaims its
    expired leases, looks up what may have been sent, and every recipient of every job gets exactly one email."""
    past = FrozenClock(SystemClock().now() - timedelta(hours=1))  # the killed drain ran an hour ago
    jobs = [make_job(engine, key=f"req-{i}", changelist=f"CL-{i}", clock=past) for i in range(12)]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    killed = subprocess.run([sys.executable, "-m", "tests.review_notifications.drain_worker", db_url,
                             past.now().isoformat(), "10"], cwd=PROJECT_ROOT, env=env, capture_output=True,
                            text=True, timeout=180)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert 10 <= len(notifications(sandbox)) < 36  # killed part-way
    with engine.connect() as conn:
        held = conn.execute(sa.select(sa.func.count()).select_from(work_items)
                            .where(work_items.c.status == "leased", work_items.c.lease_owner == "doomed")).scalar()
    assert held >= 1  # the dead process still "holds" rows; their leases ran out an hour ago

    run = daemon.drain()
    assert run.success and output(run)["backfilled"] >= 1  # the killed send was found, not resent
    assert daemon.tick() == []
    with engine.connect() as conn:
        assert repository.job_status_counts(conn) == {policy.SUCCEEDED: 12}
        assert work.counts(conn, policy.PIPELINE) == {"done": 12}
    expected = {policy.provider_token(j.changelist_id, r, 3) for j in jobs for r in RECIPIENTS}
    tokens = Counter(e["idempotency_token"] for e in notifications(sandbox))
    assert set(tokens) == expected and set(tokens.values()) == {1}
    assert [p for p in posts(sandbox) if p["status"] == 200] == []  # no token ever reached the provider twice


def test_a_503_on_one_recipient_makes_the_job_due_later_and_the_next_drain_completes_it(engine, runtime, mail,
                                                                                       clock, sandbox) -> None:
    """The second recipient's 503 stops the pass; the job's row is due after the send stage's full-jitter
    backoff on the injected clock; not before; then the next drain looks that recipient up and sends it once."""
    job = make_job(engine, clock=clock)
    sandbox.script("mail.send", {"kind": "ok"}, {"status": 503})
    first = drain_now(runtime, mail)
    assert (first.claimed, first.retried, first.done, first.dead_lettered) == (1, 1, 0, 0)
    ana, bo, cy = rows(engine, job.id)
    assert (ana.status, bo.status, cy.status) == ("sent", "sending", "pending")
    assert bo.last_error.startswith("PROVIDER_UNAVAILABLE")
    delay = policy.JOB_BACKOFF.delay(1, runtime.rng_for(f"{policy.PIPELINE}:{job.key}:send:1"))
    assert 0 < delay <= policy.JOB_BACKOFF.initial
    queued = work_row(engine, job.key)
    assert (queued.status, queued.due_at, queued.attempts) == ("due", clock.now() + timedelta(seconds=delay),
                                                               {"send": 1})
    with engine.connect() as conn:
        assert repository.job_by_id(conn, job.id).status == policy.RETRYABLE_FAILED

    assert drain_now(runtime, mail).claimed == 0  # not due yet
    clock.advance(delay)
    second = drain_now(runtime, mail)
    assert (second.claimed, second.done) == (1, 1)
    with engine.connect() as conn:
        assert repository.job_by_id(conn, job.id).status == policy.SUCCEEDED
    assert sorted(e["to"] for e in notifications(sandbox)) == sorted(RECIPIENTS)
    assert len(posts(sandbox)) == 4  # ana, bo (503), bo again after the lookup found nothing, cy
    assert len(sandbox.requests("mail.lookup")) >= 1


def test_status_and_show_tell_an_operator_what_the_queue_holds(engine, db_url, runtime, mail, clock,
                                                               sandbox) -> None:
    """`status` counts jobs, due rows and open letters (jobs vs recipients); `show` has the job's work row."""
    make_job(engine, clock=clock)
    sandbox.script("mail.send", {"status": 503})
    drain_now(runtime, mail)  # CL-1 due again later
    make_job(engine, key="req-2", changelist="CL-2", recipients=["gone@invalid.example"], clock=clock)
    drain_now(runtime, mail)  # CL-2's only recipient dead-lettered; CL-1 not due yet

    env = {"DATABASE_URL": db_url}
    shown = CliRunner().invoke(rn_cli, ["show", "CL-1:v3", "--json"], env=env)
    assert shown.exit_code == 0, shown.output
    queued = json.loads(shown.stdout)["work"]
    assert (queued["status"], queued["attempts"]) == ("due", {"send": 1})
    assert queued["last_error"].startswith("send attempt 1/5 of CL-1:v3: PROVIDER_UNAVAILABLE")
    text = CliRunner().invoke(rn_cli, ["show", "CL-1:v3"], env=env).stdout
    assert "work: due " in text and "attempts={'send': 1}" in text

    summary = json.loads(CliRunner().invoke(rn_cli, ["status", "--json"], env=env).stdout)
    assert summary["jobs"] == {policy.RETRYABLE_FAILED: 2}
    assert summary["work"]["rows"] == {"due": 1, "done": 1, "dead": 1}
    assert summary["dead_letters"] == {"jobs": 0, "recipients": 1}
    assert "1 recipients" in CliRunner().invoke(rn_cli, ["status"], env=env).stdout


def test_migration_carries_existing_jobs_into_the_work_queue(admin_url) -> None:
    """0502 on a database of the run-per-job era: unfinished jobs due, dead-lettered ones dead (a requested
    replay due with its replay), finished ones left out, durable timers dropped."""
    name = "redrive_rn_0502"
    drop_database(admin_url, name)
    create_database(admin_url, name)
    url = with_database(admin_url, name)
    cfg = alembic_config(url)
    try:
        command.upgrade(cfg, "0501")
        command.upgrade(cfg, "0004")
        engine = engine_for(url)
        now = SystemClock().now()
        pending = make_job(engine, key="a", changelist="CL-A")
        failed_job = make_job(engine, key="b", changelist="CL-B")
        replaying = make_job(engine, key="c", changelist="CL-C")
        recipient_job = make_job(engine, key="d", changelist="CL-D", recipients=RECIPIENTS[:1])
        finished = make_job(engine, key="e", changelist="CL-E")
        failed_row = rows(engine, recipient_job.id)[0]
        with engine.begin() as conn:
            conn.execute(sa.delete(work_items))  # the old era had no work rows
            for job in (failed_job, replaying, recipient_job):
                repository.set_job_status(conn, job.id, policy.RETRYABLE_FAILED)
            repository.finish_job(conn, finished.id, policy.finalize({policy.D_SENT: 3}), now)
            repository.fail_delivery(conn, failed_row.id, "INVALID_RECIPIENT")
            letter_ids = {}
            for ref in (failed_job.key, replaying.key, policy.delivery_ref(recipient_job.key, failed_row.id)):
                letter_ids[ref] = deadletters.record(conn, FinalFailure(
                    pipeline=policy.PIPELINE, stage="send", entity_ref=ref, attempts=1, at=now,
                    failure=Failure.of(Code.AUTH_DENIED))).dead_letter.id
            deadletters.request_replay(conn, letter_ids[replaying.key], evidence="INC-1", confirm_safe=True, at=now)
            conn.execute(sa.insert(deferred_attempts).values(pipeline=policy.PIPELINE, entity_ref=pending.key,
                                                             attempt=2, due_at=now))
        command.upgrade(cfg, "heads")
        with engine.connect() as conn:
            got = {r.entity_ref: (r.status, dict(r.payload)) for r in conn.execute(sa.select(work_items))}
            timers = conn.execute(sa.select(sa.func.count()).select_from(deferred_attempts)).scalar()
        assert got == {
            pending.key: ("due", {}),
            failed_job.key: ("dead", {}),
            replaying.key: ("due", {"replay_of": letter_ids[replaying.key], "replay_from": "failed_stage"}),
            recipient_job.key: ("due", {}),
            policy.delivery_ref(recipient_job.key, failed_row.id): ("dead", {}),
        }
        assert timers == 0
        api.submit(engine, {"idempotency_key": "f", "changelist_id": "CL-F", "review_version": 1,
                            "recipients": ["ana@example.com"]})  # and new jobs enqueue as usual
        assert work_row(engine, "CL-F:v1").status == "due"
    finally:
        engine_for(url).dispose()
        drop_database(admin_url, name)
