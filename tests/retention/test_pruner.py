"""The one pruner (redrive.retention): only what expired and finished goes, in batches; twice is once; a SIGKILL
mid-batch loses nothing that should stay; counters do not go back; personal fields go where the policy says."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from assets.conversion import repository as conv
from assets.criticizer import repository as crit
from assets.evidence import repository as ev
from assets.review_notifications import repository as review
from orchestration.metrics import build_registry
from orchestration.registry import retention_rules
from redrive import counters, observations, retention
from redrive.clock import FrozenClock
from redrive.schema import alert_deliveries, alerts, dead_letters, deferred_attempts, stage_checkpoints, work_items
from redrive.settings import Settings

NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
OLD, MID, RECENT, NEW = (NOW - timedelta(days=d) for d in (200, 40, 10, 1))


def ago(at: datetime) -> dict[str, datetime]:
    return {"created_at": at, "updated_at": at}


@pytest.fixture
def folders(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """Conversion's folders, as its worker and the pruner read them from the environment."""
    uploads, results = tmp_path / "uploads", tmp_path / "results"
    uploads.mkdir()
    results.mkdir()
    monkeypatch.setenv("UPLOADS_DIR", str(uploads))
    monkeypatch.setenv("RESULTS_DIR", str(results))
    return uploads, results


def letter(conn, pipeline: str, entity: str, status: str, at: datetime, **extra) -> None:
    conn.execute(sa.insert(dead_letters).values(
        pipeline=pipeline, stage="s", entity_ref=entity, error_class="E", error_message="m", retryable=False,
        attempts=1, first_failure_at=at, last_failure_at=at, status=status,
        resolved_at=at if status == "resolved" else None, **ago(at), **extra))


def conversion_job(conn, folders, name: str, status: str, at: datetime) -> str:
    job_id = str(uuid.uuid5(uuid.NAMESPACE_OID, name))
    uploads, results = folders
    (uploads / f"{job_id}.pdf").write_bytes(b"%PDF")
    result = None
    if status == "succeeded":
        result = f"{job_id}.xml"
        (results / result).write_bytes(b"<xml/>")
    conn.execute(sa.insert(conv.conversion_jobs).values(
        id=job_id, owner="alice", filename=f"{name}.pdf", source_location=f"{job_id}.pdf", source_bytes=4,
        source_sha256="x", status=status, result_location=result, completed_at=at if result else None,
        queued_at=at, **ago(at)))
    conn.execute(sa.insert(conv.conversion_job_events).values(job_id=job_id, event="queued", attempt=0, at=at,
                                                             meta={"reason": "upload"}))
    return job_id


def seed(engine, folders) -> dict[str, str]:
    """One row of each kind the rules know, old and new, finished and not; returns named ids."""
    ids: dict[str, str] = {}
    with engine.begin() as conn:
        # the core's work queue: done / dead / open
        for name, status, at in (("done_old", "done", OLD), ("done_new", "done", NEW), ("due_old", "due", OLD),
                                 ("leased_old", "leased", OLD), ("dead_open", "dead", OLD),
                                 ("dead_resolved", "dead", OLD)):
            conn.execute(sa.insert(work_items).values(pipeline="rehearsal", entity_ref=name, status=status,
                                                      due_at=at, **ago(at)))
        letter(conn, "rehearsal", "dead_open", "open", OLD)
        letter(conn, "rehearsal", "dead_resolved", "resolved", OLD)
        letter(conn, "rehearsal", "resolved_recent", "resolved", RECENT)
        for entity in ("dead_open", "done_old", "due_old"):
            conn.execute(sa.insert(stage_checkpoints).values(pipeline="rehearsal", entity_ref=entity, stage="ask",
                                                             output={}, completed_at=OLD))
        for attempt, status in ((1, "requested"), (2, "waiting")):
            conn.execute(sa.insert(deferred_attempts).values(pipeline="criticizer", entity_ref="timer", attempt=attempt,
                                                             due_at=OLD, status=status, created_at=OLD))
        for key, delivery, at in (("a_sent", "sent", OLD), ("a_pending", "pending", OLD), ("a_new", "sent", NEW)):
            alert_id = conn.execute(sa.insert(alerts).values(dedupe_key=key, group_key="g", pipeline="rehearsal",
                                                             kind="dead_letter", summary="s", created_at=at)
                                    .returning(alerts.c.id)).scalar_one()
            conn.execute(sa.insert(alert_deliveries).values(alert_id=alert_id, channel="slack", status=delivery))
        # conversion: files after 30 days, the row after 90; an open dead letter or an unfinished job keeps all
        ids["conv_old"] = conversion_job(conn, folders, "old", "succeeded", OLD)
        ids["conv_mid"] = conversion_job(conn, folders, "mid", "succeeded", MID)
        ids["conv_new"] = conversion_job(conn, folders, "new", "succeeded", NEW)
        ids["conv_failed_open"] = conversion_job(conn, folders, "failed-open", "failed", OLD)
        ids["conv_queued"] = conversion_job(conn, folders, "queued", "queued", OLD)
        letter(conn, "conversion", ids["conv_failed_open"], "open", OLD)
        # criticizer: personal fields after 7 days, the request after 90
        for name, at in (("crit_old", OLD), ("crit_recent", RECENT), ("crit_new", NEW)):
            conn.execute(sa.insert(crit.criticizer_requests).values(
                request_id=name, artifact_url="https://files.example/secret.pdf", rubric="be kind",
                webhook_url="https://hooks.example/x", webhook_headers={"Authorization": "sealed"},
                fingerprint="fp", status="done", critique={"score": 1}, completed_at=at, created_at=at))
        # review notifications: a settled recipient's address after 7 days; the job after 90
        for name, at in (("CL-1", RECENT), ("CL-2", OLD)):
            job_id = conn.execute(sa.insert(review.review_jobs).values(
                idempotency_key=f"k-{name}", changelist_id=name, review_version=1, request_digest="d",
                status="succeeded", finished_at=at, **ago(at)).returning(review.review_jobs.c.id)).scalar_one()
            conn.execute(sa.insert(review.review_deliveries).values(
                job_id=job_id, changelist_id=name, recipient=f"dev@{name.lower()}.example", review_version=1,
                provider_token=f"rn-{name}", status="sent", notified_at=at, **ago(at)))
        # evidence: the merchant's address after 7 days (job and sent N2), the file job after 90
        job = uuid.uuid5(uuid.NAMESPACE_OID, "file-job")
        conn.execute(sa.insert(ev.file_job).values(
            id=job, source_bucket="b", source_key="k", source_etag="e", notify_to="merchant@shop.example",
            status="INGESTED", n1_sent_at=RECENT, n2_sent_at=RECENT, **ago(RECENT)))
        conn.execute(sa.insert(ev.evidence_outbox).values(
            event_id=uuid.uuid5(job, "n2"), event_type="EVIDENCE_N2_REQUESTED", topic="t", file_job_id=job,
            payload={"to": "merchant@shop.example", "text": "4 of 4 attached"}, status="CONSUMED",
            consumed_at=RECENT, created_at=RECENT, updated_at=RECENT))
        ids["file_job"] = str(job)
    return ids


def state(engine, folders) -> dict[str, object]:
    """Everything the rules could touch, as comparable values."""
    uploads, results = folders
    with engine.connect() as conn:
        def col(sql: str) -> list:
            return sorted(conn.execute(sa.text(sql)).scalars().all(), key=str)

        return {
            "work": col("SELECT entity_ref FROM work_items"),
            "letters": col("SELECT entity_ref || ':' || status FROM dead_letters"),
            "checkpoints": col("SELECT entity_ref FROM stage_checkpoints"),
            "timers": col("SELECT status FROM deferred_attempts"),
            "alerts": col("SELECT dedupe_key FROM alerts"),
            "deliveries": col("SELECT count(*) FROM alert_deliveries"),
            "conv": col("SELECT filename || ':' || (files_deleted_at IS NOT NULL) FROM conversion_jobs"),
            "conv_events": col("SELECT count(*) FROM conversion_job_events"),
            "files": sorted(p.name for p in [*uploads.iterdir(), *results.iterdir()] if p.is_file()),
            "crit": col("SELECT request_id || ':' || artifact_url || ':' || webhook_url || ':' || "
                        "COALESCE(critique::text, '-') FROM criticizer_requests"),
            "review_jobs": col("SELECT changelist_id FROM review_jobs"),
            "recipients": col("SELECT recipient FROM review_deliveries"),
            "file_jobs": col("SELECT notify_to FROM file_job"),
            "n2_to": col("SELECT payload->>'to' FROM evidence_outbox"),
        }


def test_only_what_expired_and_finished_goes_in_batches_and_twice_is_once(engine, folders) -> None:
    """Old finished rows go (files with them, children with parents); open, due, leased, dead-lettered,
    recent or pending ones stay; batches of 2 take several; a second run finds nothing."""
    ids = seed(engine, folders)
    settings = Settings()
    rules = retention_rules(settings)
    pauses: list[float] = []
    planned = {p.rule.name: p.rows for p in retention.plan(engine, rules, settings, NOW)}
    assert planned["core.work_items"] == 2 and planned["conversion.files"] == 2 and planned["core.alerts"] == 1
    pruned = retention.prune(engine, rules, settings, NOW, batch_size=2, pause_seconds=0.5, sleep=pauses.append)
    after = state(engine, folders)
    assert after["work"] == ["dead_open", "done_new", "due_old", "leased_old"]
    assert after["letters"] == sorted(["dead_open:open", f"{ids['conv_failed_open']}:open",
                                       "resolved_recent:resolved"])
    assert after["checkpoints"] == ["dead_open", "due_old"]
    assert after["timers"] == ["waiting"]
    assert after["alerts"] == ["a_new", "a_pending"] and after["deliveries"] == [2]
    # the 200-day-old job went whole; the 40-day-old one lost its files (download: 410 EXPIRED), kept its row
    assert after["conv"] == ["failed-open.pdf:false", "mid.pdf:true", "new.pdf:false", "queued.pdf:false"]
    assert after["conv_events"] == [4]
    kept = {ids[k] for k in ("conv_new", "conv_failed_open", "conv_queued")}
    assert {name.split(".")[0] for name in after["files"]} == kept
    assert pruned.files == 4  # the old and mid jobs' PDF and XML each
    assert pruned.rows["core.work_items"] == 2 and pruned.rows["conversion.jobs"] == 1
    assert pruned.batches >= 6 and pauses and set(pauses) == {0.5}  # a full batch of 2 is followed by a pause
    assert state(engine, folders) == after
    again = retention.prune(engine, rules, settings, NOW, batch_size=2, pause_seconds=0, sleep=pauses.append)
    assert again.total == 0 and state(engine, folders) == after
    assert sum(p.rows for p in retention.plan(engine, rules, settings, NOW)) == 0


def test_personal_fields_go_where_the_policy_says_and_the_record_stays(engine, folders) -> None:
    """After 7 days: criticizer URLs and critique cleared, a review recipient hashed, the merchant's address gone
    from its file job and sent N2; the records stay (idempotency, audit) until their own 90 days."""
    seed(engine, folders)
    settings = Settings()
    retention.prune(engine, retention_rules(settings), settings, NOW, pause_seconds=0)
    after = state(engine, folders)
    assert after["crit"] == ["crit_new:https://files.example/secret.pdf:https://hooks.example/x:{\"score\": 1}",
                             "crit_recent:::-"]  # the 200-day-old request is gone
    assert after["review_jobs"] == ["CL-1"]  # CL-2 (200 days) went with its delivery
    [hashed] = after["recipients"]
    assert hashed.startswith("sha256:") and "example" not in hashed
    assert after["file_jobs"] == [""] and after["n2_to"] == ["redacted"]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT payload->>'text' FROM evidence_outbox")).scalar_one() == "4 of 4 attached"
        assert conn.execute(sa.text("SELECT webhook_headers FROM criticizer_requests WHERE request_id = "
                                    "'crit_recent'")).scalar_one() == {}


def scrape(engine) -> dict[tuple[str, tuple], float]:
    text = generate_latest(build_registry(engine, FrozenClock(NOW))).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if f.type in ("counter", "histogram")}


def test_counters_do_not_go_back_when_the_history_they_count_is_pruned(engine, folders) -> None:
    """Events counted as they happened stay counted after the pruner deletes the events and their rows."""
    seed(engine, folders)
    with engine.begin() as conn:
        observations.observe(conn, "rehearsal", "ask", observations.DONE, count=3)
        counters.add(conn, counters.ALERTS_SENT, {"pipeline": "rehearsal", "channel": "slack"}, 2)
    before = scrape(engine)
    assert before[("redrive_conversion_jobs_created_total", ())] == 5
    settings = Settings()
    assert retention.prune(engine, retention_rules(settings), settings, NOW, pause_seconds=0).total > 0
    after = scrape(engine)
    assert after == before


def test_a_sigkill_mid_batch_loses_nothing_that_should_stay(engine, db_url, folders, tmp_path) -> None:
    """The pruner is killed while a batch's transaction is open (its files half removed): that batch rolls
    back, what should stay is all there, and the next run ends where one uninterrupted run would have."""
    ids = seed(engine, folders)
    with engine.begin() as conn:  # more expired jobs than one batch, so the kill lands in a later batch
        for n in range(6):
            conversion_job(conn, folders, f"bulk-{n}", "succeeded", OLD)
    armed = tmp_path / "in-batch"
    script = textwrap.dedent(f"""
        import dataclasses, sys, time
        from datetime import datetime
        from pathlib import Path
        from orchestration.registry import retention_rules
        from redrive import retention
        from redrive.db import engine_for
        from redrive.settings import Settings

        settings = Settings()
        rules = [r for r in retention_rules(settings) if r.name.startswith("conversion.")]
        calls = []

        def slow(rows, remove=rules[0].remove):
            remove(rows)  # the files of this batch are gone, its rows not yet committed
            calls.append(len(rows))
            if len(calls) == 2:
                Path({str(armed)!r}).write_text("x")
                time.sleep(60)

        rules[0] = dataclasses.replace(rules[0], remove=slow)
        retention.prune(engine_for(sys.argv[1]), rules, settings, datetime.fromisoformat({NOW.isoformat()!r}),
                        batch_size=2, pause_seconds=0)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", script, db_url], env=env)
    try:
        deadline = time.monotonic() + 60
        while not armed.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the pruner never reached its second batch"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    with engine.connect() as conn:
        marked = conn.execute(sa.text("SELECT count(*) FROM conversion_jobs WHERE files_deleted_at IS NOT NULL")
                              ).scalar_one()
        kept = set(conn.execute(sa.text("SELECT CAST(id AS text) FROM conversion_jobs")).scalars())
    assert marked == 2  # the first batch committed; the killed one rolled back
    assert {ids["conv_new"], ids["conv_failed_open"], ids["conv_queued"], ids["conv_mid"]} <= kept
    uploads, _ = folders
    for key in ("conv_new", "conv_failed_open", "conv_queued"):
        assert (uploads / f"{ids[key]}.pdf").exists()
    settings = Settings()
    retention.prune(engine, retention_rules(settings), settings, NOW, batch_size=2, pause_seconds=0)
    after = state(engine, folders)
    assert after["conv"] == ["failed-open.pdf:false", "mid.pdf:true", "new.pdf:false", "queued.pdf:false"]
    assert {name.split(".")[0] for name in after["files"]} == {ids[k] for k in ("conv_new", "conv_failed_open",
                                                                                 "conv_queued")}


def test_every_rule_reads_through_an_index(engine) -> None:
    """EXPLAIN of each rule's batch statement finds its rows through an index of their age, not the primary key."""
    settings = Settings()
    with engine.begin() as conn:
        conn.execute(sa.text("SET LOCAL enable_seqscan = off"))  # an empty table would be read sequentially anyway
        for rule in retention_rules(settings):
            if rule.table == "healthchecks":
                continue  # a few rows a day: its primary key is its index
            plan = "\n".join(conn.execute(sa.text("EXPLAIN " + retention.batch_sql(rule)),
                                          {"cutoff": NOW, "now": NOW, "pipeline": "p", "batch": 10}).scalars())
            # the first scan of the table is the batch's choice of rows (the CTE's `t`, renamed t_1 by EXPLAIN)
            scans = [line for line in plan.splitlines() if "Scan" in line and re.search(rf" on {rule.table} t(_\d+)? ", line)]
            assert scans, (rule.name, plan)
            lines = plan.splitlines()
            scan = scans[0]
            if "Bitmap Heap Scan" in scan:  # the index is named on the line below
                scan = lines[lines.index(scan) + 2] if "Recheck" in lines[lines.index(scan) + 1] else \
                    lines[lines.index(scan) + 1]
                scan = scan.replace("Bitmap Index Scan on ", "using ")
            # a partial or age index of the pruner's (migrations 0021 and the pipelines' x21), not the primary key
            assert " using ix_" in scan or " using idx_" in scan, (rule.name, plan)


def test_the_command_plans_then_runs(engine, db_url, folders) -> None:
    """`redrive retention plan` lists what would go and changes nothing; `run` removes it; a second plan is empty."""
    seed(engine, folders)
    redrive = str(Path(sys.executable).parent / "redrive")
    env = {**os.environ, "DATABASE_URL": db_url}

    def call(*args: str) -> str:
        done = subprocess.run([redrive, "retention", *args], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    # the command's clock is the real one: everything seeded 200 days before NOW is long expired by now too
    before = state(engine, folders)
    planned = {p["rule"]: p for p in json.loads(call("plan", "--json"))}
    assert planned["core.dead_letters"]["rows"] >= 1 and planned["core.dead_letters"]["setting"] == \
        "RETENTION_RESOLVED_DEAD_LETTER_DAYS"
    assert state(engine, folders) == before
    out = call("run", "--pause", "0")
    assert "core.work_items:" in out and "rows in" in out
    assert "0 rows would go" in call("plan")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM dead_letters WHERE status <> 'resolved'")).scalar_one() == 2
