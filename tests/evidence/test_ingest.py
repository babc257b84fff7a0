"""Ingest through moto S3: a ZIP in the inbox becomes a partition, rows, artifacts and attach events, once."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import sqlalchemy as sa

from assets.evidence import policy
from assets.evidence import repository as repo
from sensors.evidence import new_zips
from tests.evidence.helpers import case_uuid, make_zip, pdf, put_zip


def _one(conn, table, **where):
    q = sa.select(table)
    for k, v in where.items():
        q = q.where(table.c[k] == v)
    return conn.execute(q).all()


def test_inbox_zip_becomes_partition_rows_artifacts_and_events(driver, engine, s3, bucket, inbox, sandbox) -> None:
    """Valid files are extracted to S3 and recorded; a malformed row and a missing file keep their codes;
    one attach event per attachable row is written with them; a second look changes nothing."""
    good, other = case_uuid("ing", 1), case_uuid("ing", 2)
    data = make_zip([[good, "a.pdf;b.pdf"], ["oops", "a.pdf"], [other, "c.pdf;gone.pdf"]],
                    {"a.pdf": pdf("a"), "b.pdf": pdf("b"), "c.pdf": pdf("c")})
    etag = put_zip(s3, bucket, inbox + "upload-1.zip", data, notify_to="acme@example.com")
    job_id = policy.file_job_id(bucket, inbox + "upload-1.zip", etag)

    [request] = driver.tick("evidence_inbox")
    assert request.partition_key == str(job_id)
    assert request.run_key == f"evidence:ingest:{job_id}:attempt-1"
    assert str(job_id) in driver.instance.get_dynamic_partitions("evidence_file_jobs")
    result = driver.launch(request, op_selection=["ingest_file_job"])  # what ingest records, before the drain
    assert result is not None and result.success
    assert driver.tick("evidence_inbox") == []  # the cursor moved past it

    with engine.connect() as conn:
        job = repo.get_file_job(conn, job_id)
        rows = conn.execute(sa.select(repo.file_job_row).order_by(repo.file_job_row.c.line_no)).all()
        artifacts = conn.execute(sa.select(repo.file_job_artifact).order_by(repo.file_job_artifact.c.file_name)).all()
        events = conn.execute(sa.select(repo.evidence_outbox)).all()
    assert (job.status, job.notify_to, job.row_count, job.artifact_count) == ("INGESTED", "acme@example.com", 3, 4)
    assert [(r.line_no, r.row_status, r.row_error_code, r.evidence_status) for r in rows] == [
        (2, "VALID", None, "PENDING"), (3, "INVALID", "INVALID_FORMAT", "FAILED"), (4, "VALID", None, "PARTIALLY_FAILED")]
    assert [(a.file_name, a.attachment_status, a.attachment_error_code, a.retry_status, a.error_category)
            for a in artifacts] == [
        ("a.pdf", "PENDING", None, "PENDING", "SYSTEM"), ("b.pdf", "PENDING", None, "PENDING", "SYSTEM"),
        ("c.pdf", "PENDING", None, "PENDING", "SYSTEM"), ("gone.pdf", "FAILED", "S3_NOT_FOUND", "PERMANENT_FAILED", "DATA")]
    assert sorted((e.event_type, e.status, e.topic) for e in events) == [
        ("EVIDENCE_ATTACH_REQUESTED", "PENDING", "evidence.attach.requests")] * 2
    payload = next(e.payload for e in events if e.file_job_row_id == rows[0].id)
    assert payload["schema_version"] == 1 and len(payload["artifacts"]) == 2
    extracted = s3.get_object(Bucket=bucket, Key=artifacts[0].s3_key.split(f"s3://{bucket}/", 1)[1])
    assert extracted["Body"].read() == pdf("a") and extracted["Metadata"]["sha256"] == artifacts[0].content_sha256

    # the same run requested again is deduplicated; a forced rerun of the op records nothing new
    assert driver.launch(request) is None
    rerun = driver.defs.resolve_job_def("evidence_file_job").execute_in_process(
        run_config=request.run_config, instance=driver.instance, partition_key=request.partition_key,
        op_selection=["ingest_file_job"])
    assert rerun.success
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(repo.file_job_artifact)).scalar() == 4
        assert conn.execute(sa.select(sa.func.count()).select_from(repo.evidence_outbox)).scalar() == 2


def test_corrupted_archive_is_the_file_jobs_error_not_a_crash(driver, engine, s3, bucket, inbox, sandbox) -> None:
    """A ZIP that is not a ZIP: the run succeeds, the job is INGEST_FAILED with CORRUPTED_FILE, and the
    merchant gets N1 and N2 saying so (no dead letter: nothing an operator could replay)."""
    etag = put_zip(s3, bucket, inbox + "broken.zip", b"PK\x03\x04 definitely truncated")
    job_id = policy.file_job_id(bucket, inbox + "broken.zip", etag)
    [request] = driver.tick("evidence_inbox")
    assert driver.launch(request).success
    with engine.connect() as conn:
        job = repo.get_file_job(conn, job_id)
        assert (job.status, job.error_code) == ("INGEST_FAILED", "CORRUPTED_FILE")
        kinds = [e.payload["kind"] for e in repo.notification_events(conn, job_id)]
        assert kinds == ["N1", "N2"]
        assert conn.execute(sa.text("SELECT count(*) FROM dead_letters")).scalar() == 0
    assert driver.tick("evidence_due_work") == []  # the ingest run sent both; no row to attach, no other run
    mails = [m for m in sandbox.effects("mail.send") if m["idempotency_token"].startswith("evidence:")]
    assert sorted(m["idempotency_token"].rsplit(":", 1)[1] for m in mails) == ["N1", "N2"]
    assert all(m["to"] == "merchant@example.com" for m in mails)


def test_zip_gone_before_ingest_is_dead_lettered(driver, engine, s3, bucket, inbox, sandbox) -> None:
    """The inbox saw a ZIP that is deleted before its run: S3_NOT_FOUND, one dead letter and one alert."""
    put_zip(s3, bucket, inbox + "vanishing.zip", make_zip([], {}))
    [request] = driver.tick("evidence_inbox")
    s3.delete_object(Bucket=bucket, Key=inbox + "vanishing.zip")
    result = driver.launch(request)
    assert not result.success
    with engine.connect() as conn:
        letter = conn.execute(sa.text("SELECT pipeline, stage, entity_ref, error_class FROM dead_letters")).one()
    assert tuple(letter) == ("evidence", "ingest", request.partition_key, "S3_NOT_FOUND")
    slack = sandbox.effects("slack.message")
    assert len(slack) == 1 and "S3_NOT_FOUND" in slack[0]["payload"]["text"]


def test_inbox_cursor_is_a_time_and_keeps_same_second_keys() -> None:
    """ZIPs are new when modified after the cursor; keys seen at the cursor's instant are not repeated."""
    t1, t2 = datetime(2026, 3, 1, 9, tzinfo=UTC), datetime(2026, 3, 1, 10, tzinfo=UTC)
    objects = [{"Key": "in/b.zip", "LastModified": t1}, {"Key": "in/a.zip", "LastModified": t2},
               {"Key": "in/readme.txt", "LastModified": t2}]
    fresh, cursor = new_zips(objects, None)
    assert [o["Key"] for o in fresh] == ["in/b.zip", "in/a.zip"]
    assert json.loads(cursor) == {"after": t2.isoformat(), "keys": ["in/a.zip"]}
    late = objects + [{"Key": "in/0-late.zip", "LastModified": t2}]
    fresh, cursor2 = new_zips(late, cursor)
    assert [o["Key"] for o in fresh] == ["in/0-late.zip"]
    assert json.loads(cursor2)["keys"] == ["in/0-late.zip", "in/a.zip"]
    assert new_zips(late, cursor2) == ([], cursor2)
