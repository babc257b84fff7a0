"""Issue 13 item 3: an entity failed for good without a dead letter is repaired once, by the core."""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from assets.conversion import repository as conversion
from redrive import deadletters
from redrive.clock import FrozenClock
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from redrive.reconcile import Repaired, next_since, reconcile
from redrive.reliability import Reliability
from redrive.schema import alerts, dead_letters
from tests.dagster_helpers import tick

START = datetime(2026, 3, 8, 6, 0, tzinfo=UTC)
SOURCES = {"conversion": conversion.failed_for_good}


def crashed_failure(engine: sa.Engine, at: datetime) -> str:
    """A job the worker failed for good, then crashed before its dead-letter commit (the first commit only)."""
    job_id = str(uuid.uuid4())
    with engine.begin() as conn:
        conversion.create(conn, conversion.NewJob(job_id, "owner-1", "a.pdf", "u/a.pdf", 10, "0" * 64), at)
        lease = conversion.claim(conn, "worker-1", at, 60, "pdf_gateway")
        assert lease is not None and lease.job_id == job_id
        assert conversion.fail(conn, lease, "GW_4XX", "gateway refused the file", at, {})
    return job_id


def counts(engine: sa.Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar_one(),
                conn.execute(sa.select(sa.func.count()).select_from(alerts)).scalar_one())


def test_failed_job_without_dead_letter_is_repaired_once(engine) -> None:
    """One dead letter and one alert for the orphaned failure; a second pass repairs nothing."""
    clock = FrozenClock(START)
    job_id = crashed_failure(engine, START)
    runtime = Reliability(engine=engine, clock=clock)
    clock.advance(120)

    repaired = reconcile(runtime, SOURCES)
    assert [(r.pipeline, r.entity_ref) for r in repaired] == [("conversion", job_id)]
    assert counts(engine) == (1, 1)
    with engine.connect() as conn:
        letter = deadletters.active_for(conn, "conversion", job_id)
    assert letter is not None and (letter.error_class, letter.stage, letter.retryable) == ("GW_4XX", "convert", False)
    assert letter.last_failure_at == START

    assert reconcile(runtime, SOURCES) == []
    assert counts(engine) == (1, 1)


def test_a_failure_younger_than_the_grace_period_is_left_to_its_worker(engine) -> None:
    """The worker's own second commit is milliseconds away: the reconciler waits before stepping in."""
    clock = FrozenClock(START)
    crashed_failure(engine, START)
    assert reconcile(Reliability(engine=engine, clock=clock), SOURCES) == []
    assert counts(engine) == (0, 0)


def test_a_resolved_dead_letter_is_not_reopened(engine) -> None:
    """An operator's resolve stands: the job is still failed, but its failure has a letter."""
    clock = FrozenClock(START)
    job_id = crashed_failure(engine, START)
    runtime = Reliability(engine=engine, clock=clock)
    with engine.begin() as conn:
        runtime.fail_for_good(FinalFailure("conversion", "convert", job_id, Failure.of(Code.BAD_REQUEST), 1, START),
                              conn=conn)
        letter = deadletters.active_for(conn, "conversion", job_id)
        assert letter is not None
        deadletters.resolve(conn, letter.id, note="converted by hand", at=START)
    clock.advance(120)
    assert reconcile(runtime, SOURCES) == []
    assert counts(engine) == (1, 1)


def test_concurrent_reconcilers_write_one_letter_and_one_alert(engine) -> None:
    """Eight reconcilers at once over the same orphans: each entity gets exactly one letter and one alert."""
    clock = FrozenClock(START + timedelta(minutes=5))
    jobs = {crashed_failure(engine, START) for _ in range(5)}
    results: list[list[str]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def run() -> None:
        try:
            barrier.wait()
            results.append([r.entity_ref for r in reconcile(Reliability(engine=engine, clock=clock), SOURCES)])
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(e for r in results for e in r) == sorted(jobs)  # each repaired by exactly one reconciler
    assert counts(engine) == (5, 5)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.max(dead_letters.c.occurrences))).scalar_one() == 1


def test_the_core_sensor_repairs_through_the_code_location(defs, instance, engine) -> None:
    """The reconciliation sensor of the built Definitions finds the conversion source and repairs the job."""
    job_id = crashed_failure(engine, START)  # START is long past: outside the grace period
    assert tick(defs, instance, "redrive_dead_letter_reconciliation") == []
    with engine.connect() as conn:
        assert deadletters.active_for(conn, "conversion", job_id) is not None
        kinds = conn.execute(sa.select(alerts.c.kind, alerts.c.entity_ref)).all()
    assert [(k.kind, k.entity_ref) for k in kinds] == [("dead_letter", job_id)]
    tick(defs, instance, "redrive_dead_letter_reconciliation")
    assert counts(engine) == (1, 1)


def test_a_pass_since_reads_only_what_failed_from_then_on(engine) -> None:
    """The sensor's pass reads the failures from its `since` on (an index on the failure time), so its cost is
    what failed lately; a pass without `since` (the command) reads them all."""
    clock = FrozenClock(START + timedelta(hours=3))
    old = crashed_failure(engine, START)
    recent = crashed_failure(engine, START + timedelta(hours=2))
    runtime = Reliability(engine=engine, clock=clock)
    assert [r.entity_ref for r in reconcile(runtime, SOURCES, since=START + timedelta(hours=1))] == [recent]
    assert [r.entity_ref for r in reconcile(runtime, SOURCES, since=START + timedelta(hours=1))] == []
    assert [r.entity_ref for r in reconcile(runtime, SOURCES)] == [old]
    assert counts(engine) == (2, 2)


def test_the_sensor_reads_from_its_cursor_after_a_first_full_pass(defs, instance, engine) -> None:
    """The first tick (no cursor) reads every failure; its cursor makes the next read from a little before it
    started: a new orphan is repaired, one stamped months before is left to `redrive dlq reconcile`."""
    from orchestration.demo import evaluate_sensor_tick

    first = crashed_failure(engine, START)
    data = evaluate_sensor_tick(defs, instance, "redrive_dead_letter_reconciliation", None)
    with engine.connect() as conn:
        assert deadletters.active_for(conn, "conversion", first) is not None
    since = datetime.fromisoformat(data.cursor)
    now = datetime.now(UTC)
    assert now - timedelta(hours=2) < since < now - timedelta(hours=1)  # its start, less grace and overlap
    fresh = crashed_failure(engine, now - timedelta(minutes=10))
    stale = crashed_failure(engine, START + timedelta(days=1))
    evaluate_sensor_tick(defs, instance, "redrive_dead_letter_reconciliation", data.cursor)
    with engine.connect() as conn:
        assert deadletters.active_for(conn, "conversion", fresh) is not None
        assert deadletters.active_for(conn, "conversion", stale) is None


def test_the_next_pass_starts_before_this_one_unless_a_batch_was_full() -> None:
    """Where the reconciliation sensor's next pass starts: this one's start less grace and overlap; where this
    one started when some pipeline's batch was full (its backlog goes on next tick)."""
    started = START + timedelta(days=3)
    before = START
    one = [Repaired("conversion", "j1", 1)]
    assert next_since(before, started, one, limit=2, grace_seconds=60, overlap_seconds=3600) == \
        started - timedelta(seconds=3660)
    full = [Repaired("conversion", "j1", 1), Repaired("conversion", "j2", 2), Repaired("matching", "d", 3)]
    assert next_since(before, started, full, limit=2) == before
    assert next_since(None, started, full, limit=2) is None  # a first pass goes on reading everything
    assert next_since(None, started, [], limit=2, grace_seconds=60, overlap_seconds=0) == \
        started - timedelta(seconds=60)


def test_command_reconciles_once(db_url, engine) -> None:
    """`redrive dlq reconcile` repairs the orphan and says so; run again, it repairs nothing."""
    from click.testing import CliRunner

    from orchestration.cli import app

    job_id = crashed_failure(engine, START)
    first = CliRunner().invoke(app, ["dlq", "reconcile"], env={"DATABASE_URL": db_url})
    assert first.exit_code == 0, first.output
    assert f"conversion {job_id}: dead letter" in first.output and "1 repaired" in first.output
    again = CliRunner().invoke(app, ["dlq", "reconcile"], env={"DATABASE_URL": db_url})
    assert "0 repaired" in again.output
    assert counts(engine) == (1, 1)


def test_matching_and_review_notification_sources_are_repaired(engine) -> None:
    """A failed document and a failed delivery row, each without its letter, are found by their repositories."""
    from assets.matching import repository as matching
    from assets.matching.policy import DocumentIn
    from assets.review_notifications import policy as rn_policy
    from assets.review_notifications import repository as review

    clock = FrozenClock(START + timedelta(minutes=5))
    with engine.begin() as conn:
        matching.insert_document(conn, DocumentIn(id="doc-1", tenant="acme", doc_type="invoice",
                                                  counterparty="ACME", references=["INV-1"]))
        matching.mark_failed(conn, "doc-1", "AUTH_DENIED: provider refused the key", START)
        job = review.insert_job(conn, rn_policy.ReviewRequest(idempotency_key="k-1", changelist_id="cl-9",
                                                              review_version=2, recipients=("bob@example.com",)))
        assert job is not None
        review.insert_deliveries(conn, job, ["bob@example.com"])
        delivery_id = conn.execute(sa.select(review.review_deliveries.c.id)).scalar_one()
        conn.execute(sa.update(review.review_deliveries).values(updated_at=START))
        assert review.fail_delivery(conn, delivery_id, "INVALID_RECIPIENT: mailbox does not exist")
        conn.execute(sa.update(review.review_deliveries).values(updated_at=START))
    sources = {"matching": matching.failed_for_good, "review_notifications": review.failed_for_good}
    repaired = reconcile(Reliability(engine=engine, clock=clock), sources)
    assert sorted((r.pipeline, r.entity_ref) for r in repaired) == [
        ("matching", "doc-1"), ("review_notifications", f"cl-9:v2:d{delivery_id}")]
    with engine.connect() as conn:
        classes = dict(conn.execute(sa.select(dead_letters.c.pipeline, dead_letters.c.error_class)).all())
    assert classes == {"matching": "AUTH_DENIED", "review_notifications": "INVALID_RECIPIENT"}
    assert reconcile(Reliability(engine=engine, clock=clock), sources) == []


def test_evidence_source_repairs_a_settled_row_but_not_a_data_failure(engine) -> None:
    """A row whose artifacts were closed for good (N2) without its letter is repaired; DATA-only rows are N2's."""
    from assets.evidence import policy as ev_policy
    from assets.evidence import repository as ev_repo
    from tests.evidence.helpers import standard_job

    data, _ = standard_job("rc", 2, 2)
    parsed = ev_policy.parse_archive(data, file_types=frozenset({"pdf", "png", "txt"}),
                                     limits=ev_policy.ArchiveLimits(max_file_bytes=10**7, max_archive_bytes=10**9))
    job_id = ev_policy.file_job_id("bucket", "inbox/rc.zip", "etag")
    with engine.begin() as conn:
        job = ev_repo.upsert_file_job(conn, job_id, bucket="bucket", key="inbox/rc.zip", etag="etag",
                                      notify_to="merchant@example.com", now=START)
        ev_repo.record_ingest(conn, job, parsed, s3_uri=lambda aid, n: f"s3://bucket/files/{aid}/{n}", now=START)
        rows = sorted(set(ev_repo.close_open_artifacts(conn, job_id, START)))
        a = ev_repo.file_job_artifact
        conn.execute(sa.update(a).where(a.c.file_job_row_id == rows[1]).values(attachment_error_code="CORRUPTED_FILE"))
    clock = FrozenClock(START + timedelta(minutes=5))
    sources = {"evidence": ev_repo.failed_for_good}
    repaired = reconcile(Reliability(engine=engine, clock=clock), sources)
    assert [r.entity_ref for r in repaired] == [ev_policy.row_entity(job_id, rows[0])]
    with engine.connect() as conn:
        assert conn.execute(sa.select(dead_letters.c.error_class)).scalar_one() == "SYSTEM_ERROR"
    assert reconcile(Reliability(engine=engine, clock=clock), sources) == []
