"""Evidence demo: a ZIP in the inbox, attach through a flaky case API, retries as due rows, N1/N2.

Scripted faults (seeded): 503s and "accepted, answer lost" on the case API, one case deleted
(CASE_NOT_FOUND → dead letter + alert), and a manifest with a malformed row, a missing file, a
file of a refused type and a corrupted PDF. Sensors are ticked (`ctx.tick`: by hand in process, or
the daemon's own ticks waited for under `make demo`): the ingest run makes the first pass, then the
due-work sensor starts one run of the file job per retry round. Backoff runs at the demo's time scale (5 min → 3 s), so the demo waits for retries.
Safe to run twice: the session id is in the upload's key and case ids, so each run is a new file job.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import sqlalchemy as sa

from assets.evidence import policy, service
from assets.evidence import repository as repo
from assets.evidence.settings import EvidenceSettings
from redrive import work
from resources.aws import ensure_bucket

ROWS, PER_ROW = 6, 5
FAULTS = {"503": 0.12, "effect_then_error": 0.08}  # per attach request, seeded
THROUGH_DAEMON = True  # under `make demo` the daemon ticks the inbox, due-work and retry sensors
SETTLE_SECONDS = 900  # in process the rounds take seconds; through the daemon each is a launched run


def _pdf(label: str) -> bytes:
    return b"%PDF-1.4\n% " + label.encode() + b"\n%%EOF\n"


def _archive(session: str) -> tuple[bytes, list[str]]:
    import csv
    import io
    import zipfile

    cases = [str(uuid.uuid5(policy.NAMESPACE, f"demo-{session}-case-{i}")) for i in range(ROWS)]
    files: dict[str, bytes] = {}
    rows = []
    for i, case in enumerate(cases):
        names = [f"case{i}/doc-{k}.pdf" for k in range(PER_ROW)]
        files.update({n: _pdf(f"{session}/{n}") for n in names})
        rows.append([case, ";".join(names)])
    rows[0][1] += ";case0/not-in-the-zip.pdf;case0/tool.exe"  # S3_NOT_FOUND, INVALID_FORMAT
    files["case1/scan.pdf"] = b"GIF89a this is not a PDF"  # CORRUPTED_FILE
    rows[1][1] += ";case1/scan.pdf"
    rows.append(["not-a-case-id", "x.pdf"])  # a malformed row: INVALID_FORMAT, kept
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([["case_id", "evidence_files"], *rows])
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("manifest.csv", text.getvalue())
        for name, body in files.items():
            zf.writestr(name, body)
    return buf.getvalue(), cases


def run_demo(ctx):  # -> orchestration.demo.DemoReport
    from orchestration.demo import DemoReport

    report = DemoReport(service.PIPELINE)
    evidence = EvidenceSettings()
    bucket = evidence.bucket or ctx.settings.redrive_bucket
    s3 = ctx.defs.resources["s3"].get_client()
    ensure_bucket(s3, bucket)
    data, cases = _archive(ctx.session)
    key = f"{evidence.inbox_prefix}demo-{ctx.session}.zip"
    s3.put_object(Bucket=bucket, Key=key, Body=data, Metadata={"notify-to": f"merchant-{ctx.session}@example.com"})
    etag = str(s3.head_object(Bucket=bucket, Key=key)["ETag"]).strip('"')
    job = policy.file_job_id(bucket, key, etag)

    ctx.sandbox.mark_cases_missing(cases[-1])  # the last case was deleted: CASE_NOT_FOUND, dead letter, alert
    ctx.sandbox.random_faults("case.attach", seed=4, rates=FAULTS)
    runs = [r for r in ctx.tick("evidence_inbox") if r.dagster_run.tags.get("dagster/partition") == str(job)]
    assert runs and runs[0].success, "ingest run failed"
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline:
        drained = ctx.tick("evidence_due_work")
        assert all(r.success for r in drained), "an evidence run failed"
        runs += drained
        ctx.tick("evidence_retry_scheduler")
        with ctx.engine.connect() as conn:
            now = conn.execute(sa.select(sa.func.now())).scalar()
            backlog = work.backlog(conn, service.PIPELINE, now, group_key=str(job))
            n2_sent = repo.get_file_job(conn, job).n2_sent_at
        if n2_sent is not None and backlog.next_due_at is None:
            break
        if not drained and backlog.next_due_at is not None:  # the next retry round: wait for it, as the daemon would
            time.sleep(min(8.0, max(0.2, (backlog.next_due_at - now).total_seconds() + 0.2)))
    ctx.sandbox.stop_random_faults("case.attach")
    ctx.tick("evidence_metrics")  # §6 snapshot: a sensor's asset event, not a run

    with ctx.engine.connect() as conn:
        arts = conn.execute(sa.select(repo.file_job_artifact).where(repo.file_job_artifact.c.file_job_id == job)).all()
        file_job = repo.get_file_job(conn, job)
        letters = conn.execute(sa.text("SELECT id, error_class FROM dead_letters WHERE pipeline = 'evidence' "
                                       "AND entity_ref LIKE :job"), {"job": f"{job}/%"}).all()
        invalid_rows = conn.execute(sa.select(sa.func.count()).where(
            repo.file_job_row.c.file_job_id == job, repo.file_job_row.c.row_status == "INVALID")).scalar()
    attached = [a for a in arts if a.attachment_status == "ATTACHED"]
    final = [a for a in arts if a.retry_status == "PERMANENT_FAILED" and a.attachment_status != "ATTACHED"]
    assert len(attached) + len(final) == len(arts), "an artifact is still in flight"
    assert file_job.n1_sent_at and file_job.n2_sent_at, "N1/N2 not sent"
    tokens = Counter(m["idempotency_token"] for m in ctx.sandbox.effects("mail.send")
                     if m["idempotency_token"].startswith(f"evidence:{job}:"))
    assert tokens == {f"evidence:{job}:N1": 1, f"evidence:{job}:N2": 1}, tokens
    keys = Counter(e["idempotency_key"] for e in ctx.sandbox.effects("case.attach"))
    assert all(keys[str(a.id)] == 1 for a in attached), "an artifact was attached twice"
    assert letters

    report.done = len(attached)
    report.retried = sum(1 for a in arts if a.attempt_count > 1)
    report.dead_lettered = len(letters)
    recovered = sum(1 for a in attached if a.attempt_count > 1)
    lost = sum(1 for r in ctx.sandbox.requests("case.attach") if r["step"].startswith("effect_then_error"))
    codes = Counter(a.attachment_error_code for a in final)
    report.notes.append(f"file job {job}: {len(arts)} evidence files in {ROWS + 1} manifest rows "
                        f"({invalid_rows} malformed row kept as INVALID_FORMAT); {len(runs)} run{'' if len(runs) == 1 else 's'} "
                        f"of its partition (ingest + first pass; a retry round not yet due when a run ends gets a "
                        f"run of its own)")
    report.notes.append(f"{len(attached)} attached ({recovered} after a retry; {lost} 'accepted, answer lost' "
                        f"found by lookup, none attached twice); failed for good: {dict(sorted(codes.items()))}")
    report.notes.append(f"N1 and N2 sent once each to {file_job.notify_to}; "
                        f"{len(letters)} row dead-lettered ({', '.join(sorted({l.error_class for l in letters}))}) "
                        f"with an alert; replay with `redrive dlq replay <id>` once the case is restored")
    return report
