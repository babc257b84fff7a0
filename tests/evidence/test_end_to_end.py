"""End to end through moto S3, the sandbox case API and mail provider, and Dagster runs: 1,000 artifacts,
20 % transient and 5 % permanent faults, driven by the sensors until nothing is left to do."""

from __future__ import annotations

import time
import uuid
from collections import Counter

import sqlalchemy as sa

from assets.evidence import repository as repo
from tests.evidence.helpers import Driver, put_zip, standard_job

A = repo.file_job_artifact
# Per request on case.attach: 20 % transient (503, 500, accepted-but-answer-lost, unreadable 200,
# dropped connection, gateway timeout), 5 % permanent (404 → CASE_NOT_FOUND, 400 → INVALID_FORMAT).
FAULTS = {"503": 0.05, "500": 0.03, "effect_then_error": 0.05, "malformed": 0.02, "reset": 0.03, "timeout": 0.02,
          "404": 0.03, "400": 0.02}
TRANSIENT_CODES = {"503", "500"}
PERMANENT_CODES = {"CASE_NOT_FOUND", "INVALID_FORMAT"}


def drive_until_quiet(driver: Driver, engine: sa.Engine, max_rounds: int = 12) -> int:
    """What the daemon does: tick the due-work sensor (launching its runs) and the scheduler, until the outbox
    is drained and no artifact is in flight. Backoff × 0 makes every retry due at once."""
    for rounds in range(1, max_rounds + 1):
        t0 = time.monotonic()
        runs = driver.tick_and_launch("evidence_due_work")
        print(f"round {rounds}: {len(runs)} runs in {time.monotonic() - t0:.1f}s", flush=True)
        assert all(r.success for r in runs), [r.run_id for r in runs if not r.success]
        assert driver.tick("evidence_retry_scheduler") == []  # it forces N2 at the deadline, it requests no run
        with engine.connect() as conn:
            open_events = conn.execute(sa.select(sa.func.count()).where(
                repo.evidence_outbox.c.status.in_(("PENDING", "PUBLISHED")))).scalar()
            in_flight = conn.execute(sa.select(sa.func.count()).where(
                A.c.attachment_status != "ATTACHED", A.c.retry_status != "PERMANENT_FAILED")).scalar()
        if not runs and open_events == 0 and in_flight == 0:
            return rounds
    raise AssertionError(f"not quiet after {max_rounds} rounds: {open_events} events open, {in_flight} in flight")


def test_thousand_artifacts_with_faults_end_attached_or_failed_for_good(driver, engine, s3, bucket, inbox,
                                                                       sandbox) -> None:
    """Every artifact ends ATTACHED or PERMANENT_FAILED with its code; the case API holds exactly one
    attachment per attached artifact and none for the others (no attach was ever replayed); N1 and N2
    each went out once; rows with operational final failures were dead-lettered."""
    started = time.monotonic()
    data, _ = standard_job("e2e", rows=10, per_row=100)
    put_zip(s3, bucket, f"{inbox}e2e.zip", data)
    [ingest] = driver.tick("evidence_inbox")
    # before the ingest run: its drain makes the first pass (the faults apply to it as to the retries)
    sandbox.random_faults("case.attach", seed=20_260_302, rates=FAULTS, timeout_seconds=0)
    t0 = time.monotonic()
    assert driver.launch(ingest).success
    print(f"ingest {time.monotonic() - t0:.1f}s", flush=True)
    job = ingest.partition_key

    rounds = drive_until_quiet(driver, engine)

    with engine.connect() as conn:
        arts = conn.execute(sa.select(A.c.id, A.c.attachment_status, A.c.retry_status, A.c.attachment_error_code,
                                      A.c.attempt_count, A.c.case_attachment_id)).all()
        rows = conn.execute(sa.select(repo.file_job_row.c.evidence_status)).scalars().all()
        letters = conn.execute(sa.text("SELECT error_class FROM dead_letters WHERE pipeline = 'evidence'")).scalars().all()
        file_job = repo.get_file_job(conn, uuid.UUID(job))
    attached = {a.id for a in arts if a.attachment_status == "ATTACHED"}
    failed = [a for a in arts if a.attachment_status != "ATTACHED"]
    assert len(arts) == 1000
    assert all(a.retry_status == "PERMANENT_FAILED" and a.attachment_error_code for a in failed)
    assert all(1 <= a.attempt_count <= 3 for a in arts)
    codes = Counter(a.attachment_error_code for a in failed)
    assert set(codes) <= TRANSIENT_CODES | PERMANENT_CODES and set(codes) & PERMANENT_CODES, codes
    assert 850 <= len(attached) <= 990, (len(attached), codes)

    effects = sandbox.effects("case.attach")
    keys = Counter(e["idempotency_key"] for e in effects)
    assert max(keys.values()) == 1  # no artifact attached twice
    assert set(keys) == {str(a) for a in attached}  # and nothing attached that we think failed
    assert {e["attachment_id"] for e in effects} == {a.case_attachment_id for a in arts if a.id in attached}
    statuses = Counter(r["status"] for r in sandbox.requests("case.attach"))
    replays = [r for r in sandbox.requests("case.attach") if r["step"] == "ok" and r["status"] == 200]
    assert replays == []  # an "accepted, answer lost" was looked up, never re-sent (a replay answers 200)
    assert statuses[500] > 0 and len(sandbox.requests("case.lookup")) > 0

    mails = Counter(m["idempotency_token"] for m in sandbox.effects("mail.send")
                    if m["idempotency_token"].startswith("evidence:"))
    assert mails == {f"evidence:{job}:N1": 1, f"evidence:{job}:N2": 1}
    assert file_job.n1_sent_at <= file_job.n2_sent_at and not file_job.n2_forced
    assert set(rows) <= {"COMPLETED", "PARTIALLY_FAILED", "FAILED"}
    assert letters and set(letters) <= TRANSIENT_CODES | {"CASE_NOT_FOUND"}
    assert len(sandbox.effects("slack.message")) >= 1
    elapsed = time.monotonic() - started
    print(f"\n1,000 artifacts: {len(attached)} attached, {dict(codes)} failed for good, {rounds} rounds, "
          f"{len(driver.launched)} runs, {len(letters)} dead letters, {elapsed:.1f}s")
