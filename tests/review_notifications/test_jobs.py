"""Job creation (§6.1, §10.1) and processing modes (§6.2, §10.4) on the real database and command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from assets.review_notifications import api, policy, repository
from assets.review_notifications.cli import app
from assets.review_notifications.policy import Mode, VersionRegression
from redrive.settings import PROJECT_ROOT
from tests.review_notifications.conftest import RECIPIENTS, make_job, rows

REQUEST = {"idempotency_key": "req-1", "changelist_id": "CL-1", "review_version": 3,
           "recipients": list(RECIPIENTS), "summary": "Looks good"}


def counts(engine: sa.Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (conn.execute(sa.select(sa.func.count()).select_from(repository.review_jobs)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(repository.review_deliveries)).scalar_one())


def succeed(engine: sa.Engine, job: repository.Job) -> None:
    """Mark every row delivered as the send-and-mark path would, then finalize."""
    with engine.begin() as conn:
        for row in repository.deliveries_of(conn, job.id):
            conn.execute(sa.update(repository.review_deliveries).where(repository.review_deliveries.c.id == row.id)
                         .values(status="sent", notified_at=sa.func.now(), notification_id=f"msg_{row.id}"))
        api.finalize(conn, job.id, conn.execute(sa.select(sa.func.now())).scalar_one())


def test_creation_writes_job_and_one_outbox_row_per_recipient(engine) -> None:
    """§6.3: one delivery intent per (changelist, recipient, version), each with its derived token."""
    submission = api.submit(engine, REQUEST)
    assert submission.created and submission.mode is Mode.CREATED
    assert submission.job.key == "CL-1:v3" and submission.job.status == policy.PENDING
    delivered = rows(engine, submission.job.id)
    assert [r.recipient for r in delivered] == list(RECIPIENTS)
    assert {r.provider_token for r in delivered} == {policy.provider_token("CL-1", r, 3) for r in RECIPIENTS}
    assert all(r.status == "pending" and r.notified_at is None and r.attempts == 0 for r in delivered)


def test_duplicate_key_returns_the_original_and_creates_nothing(engine) -> None:
    """§10.1: the same idempotency key again — even with another body — is the original job."""
    first = api.submit(engine, REQUEST)
    again = api.submit(engine, REQUEST)
    changed = api.submit(engine, {**REQUEST, "review_version": 9, "recipients": ["zed@example.com"]})
    assert (again.job.id, again.mode, again.created, again.request_matches) == (first.job.id, Mode.DUPLICATE,
                                                                                False, True)
    assert (changed.job.id, changed.mode, changed.request_matches) == (first.job.id, Mode.DUPLICATE, False)
    assert counts(engine) == (1, 3)


def test_fifty_concurrent_creations_from_several_processes_make_one_job(engine, db_url) -> None:
    """50 callers (5 processes × 10 threads) submit one key at the same instant: one job, one id for all."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.review_notifications.concurrent_create", db_url, "10"],
                              cwd=PROJECT_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(5)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", p.stderr.read()  # type: ignore[union-attr]
        for p in procs:  # release all of them together
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
            results += json.loads(out.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert len(results) == 50
    assert len({job_id for job_id, _, _ in results}) == 1
    assert sorted(mode for _, mode, _ in results) == ["created"] + ["duplicate"] * 49
    assert sum(created for _, _, created in results) == 1
    assert counts(engine) == (1, 2)


def test_same_version_after_success_is_a_noop_returning_the_prior_result(engine) -> None:
    """§6.2/§10.4 v3 → v3: a new key for a succeeded version creates nothing and returns its result."""
    job = make_job(engine)
    succeed(engine, job)
    again = api.submit(engine, {**REQUEST, "idempotency_key": "req-2"})
    assert (again.mode, again.created, again.job.id) == (Mode.NOOP, False, job.id)
    assert again.job.status == policy.SUCCEEDED
    assert again.job.result == {"required": 3, "delivered": 3, "failed": 0, "waiting": 0}
    assert counts(engine) == (1, 3)


def test_same_version_while_running_joins_the_running_job(engine) -> None:
    """A second key for a version still in progress is that job, not a second one."""
    job = make_job(engine)
    again = api.submit(engine, {**REQUEST, "idempotency_key": "req-2"})
    assert (again.mode, again.job.id) == (Mode.EXISTING, job.id)
    assert counts(engine) == (1, 3)


def test_higher_version_is_a_versioned_rerun_with_new_delivery_keys(engine) -> None:
    """§6.2/§10.4 v3 → v4: a new job tied to the same changelist, with new outbox keys and tokens."""
    v3 = make_job(engine)
    succeed(engine, v3)
    v4 = api.submit(engine, {**REQUEST, "idempotency_key": "req-2", "review_version": 4})
    assert v4.created and v4.mode is Mode.VERSIONED_RERUN and v4.job.key == "CL-1:v4"
    old, new = rows(engine, v3.id), rows(engine, v4.job.id)
    assert [r.recipient for r in new] == [r.recipient for r in old]
    assert not {r.provider_token for r in new} & {r.provider_token for r in old}
    assert all(r.status == "pending" for r in new)


def test_lower_version_is_refused_and_writes_nothing(engine) -> None:
    """§6.2 v4 → v3: refused with REVIEW_VERSION_REGRESSION, whether or not v3 has a job."""
    make_job(engine, version=4)
    with pytest.raises(VersionRegression, match="REVIEW_VERSION_REGRESSION"):
        api.submit(engine, {**REQUEST, "idempotency_key": "req-2", "review_version": 3})
    assert counts(engine) == (1, 3)


def test_lower_version_refused_even_when_that_version_succeeded(engine) -> None:
    """v3 succeeded, v4 exists: v3 under a new key is refused, not answered with v3's old result."""
    v3 = make_job(engine)
    succeed(engine, v3)
    make_job(engine, key="req-2", version=4)
    with pytest.raises(VersionRegression):
        api.submit(engine, {**REQUEST, "idempotency_key": "req-3"})
    assert api.submit(engine, REQUEST).mode is Mode.DUPLICATE  # the original key still gets its job


def test_rerun_supersedes_an_unfinished_older_version(engine, clock) -> None:
    """v4 requested while v3 is unfinished: v3 stops (its unsent rows are not sent); notified rows stay."""
    v3 = make_job(engine)
    first = rows(engine, v3.id)[0]
    with engine.begin() as conn:
        repository.mark_sent(conn, first.id, "msg_1", clock.now())
    make_job(engine, key="req-2", version=4)
    with engine.connect() as conn:
        assert repository.job_by_id(conn, v3.id).status == policy.SUPERSEDED
    assert [r.status for r in rows(engine, v3.id)] == ["sent", "superseded", "superseded"]


def test_database_enforces_outbox_uniqueness_and_sent_marker(engine) -> None:
    """The schema, not only the code: one row per (changelist, recipient, version); sent ⇔ notified_at."""
    job = make_job(engine)
    row = rows(engine, job.id)[0]
    table = repository.review_deliveries
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.insert(table).values(job_id=job.id, changelist_id="CL-1", recipient=row.recipient,
                                             review_version=3, provider_token="rn-other"))
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.id == row.id).values(status="sent"))


# --------------------------------------------------------------------------------------- the command


def cli(db_url: str, *args: str):
    return CliRunner().invoke(app, list(args), env={"DATABASE_URL": db_url, "DAGSTER_HOME": ""},
                              catch_exceptions=False)


def test_command_creates_once_and_refuses_a_regression_in_one_line(engine, db_url) -> None:
    """`create` twice with one key is one job; a lower version exits 2 with the canonical error, no trace."""
    args = ["create", "--idempotency-key", "cli-1", "--changelist", "CL-9", "--review-version", "v4",
            "--recipient", "ana@example.com", "--recipient", "bo@example.com", "--json"]
    first = cli(db_url, *args)
    second = cli(db_url, *args)
    assert first.exit_code == 0 and second.exit_code == 0, first.output + second.output
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert (a["mode"], b["mode"], a["job_id"]) == ("created", "duplicate", b["job_id"])
    assert a["job_key"] == "CL-9:v4"

    refused = cli(db_url, "create", "--idempotency-key", "cli-2", "--changelist", "CL-9", "--review-version", "3",
                  "--recipient", "ana@example.com")
    assert refused.exit_code == 2
    assert refused.stderr.strip().startswith("error: REVIEW_VERSION_REGRESSION: changelist CL-9")
    assert "Traceback" not in refused.output and len(refused.stderr.strip().splitlines()) == 1

    bad = cli(db_url, "create", "--idempotency-key", "cli-3", "--changelist", "CL:9", "--review-version", "1",
              "--recipient", "ana@example.com")
    assert bad.exit_code == 2 and "INVALID_REQUEST: changelist_id" in bad.stderr
    assert counts(engine) == (1, 2)


def test_command_show_lists_rows_without_addresses_in_json_keys(engine, db_url) -> None:
    """`show KEY --json` gives the job and each row's state for an operator."""
    make_job(engine)
    out = cli(db_url, "show", "CL-1:v3", "--json")
    assert out.exit_code == 0, out.output
    shown = json.loads(out.stdout)
    assert shown["job_key"] == "CL-1:v3" and [d["status"] for d in shown["deliveries"]] == ["pending"] * 3
    missing = cli(db_url, "show", "CL-404:v1")
    assert missing.exit_code == 2 and "UNKNOWN_JOB" in missing.stderr


def test_v3_and_v4_created_at_the_same_instant_never_leave_a_live_stale_version(engine) -> None:
    """Racing v3 and v4: v3 is refused or superseded, never left pending beside v4 (the changelist lock)."""
    import threading

    outcomes = []
    for i in range(8):
        barrier = threading.Barrier(2)
        got: dict[int, str] = {}

        def create(version: int, cl: str = f"CL-race-{i}") -> None:
            barrier.wait()
            try:
                got[version] = str(api.submit(engine, {**REQUEST, "idempotency_key": f"{cl}-{version}",
                                                       "changelist_id": cl, "review_version": version}).mode)
            except VersionRegression:
                got[version] = "refused"

        threads = [threading.Thread(target=create, args=(v,)) for v in (3, 4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with engine.connect() as conn:
            statuses = dict(conn.execute(sa.select(repository.review_jobs.c.review_version, repository.review_jobs.c.status)
                                         .where(repository.review_jobs.c.changelist_id == f"CL-race-{i}")).all())
        assert statuses.get(4) == policy.PENDING
        assert (got[3], statuses.get(3)) in {("refused", None), ("created", policy.SUPERSEDED)}
        assert got[4] in {"created", "versioned_rerun"}
        outcomes.append(got[3])
    assert set(outcomes) <= {"refused", "created"}
