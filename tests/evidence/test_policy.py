"""Pure decisions of the evidence pipeline: manifest validation, rollups, attempt plans, outcomes, gates, alerts."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from assets.evidence import policy
from assets.evidence.policy import ArtifactState, AttemptOutcome, PlannedAttempt
from redrive.failures import Code, Failure
from redrive.vocabularies import EVIDENCE, evidence_category
from tests.evidence.helpers import case_uuid, make_zip, pdf

NOW = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
TYPES = frozenset({"pdf", "png", "jpg", "txt"})


def parse(data: bytes, **kw):
    limits = policy.ArchiveLimits(max_file_bytes=kw.get("max_file", 10_000),
                                  max_archive_bytes=kw.get("max_archive", 10_000_000))
    return policy.parse_archive(data, file_types=TYPES, limits=limits)


# ----------------------------------------------------------------------------------------- manifest


def test_every_row_and_file_is_kept_with_its_code() -> None:
    """Malformed rows and bad files become row/artifact errors with 004's codes; nothing is dropped."""
    good, other = case_uuid("p", 1), case_uuid("p", 2)
    data = make_zip(
        [[good, "a.pdf;b.png;missing.pdf;evil.exe;../escape.pdf;a.pdf"],
         ["not-a-uuid", "a.pdf"],
         [other, ""],
         [other, "c.pdf", "extra-field"],
         [other, "empty.txt;fake.pdf;broken.pdf"]],
        {"a.pdf": pdf("a"), "b.png": b"\x89PNG\r\n\x1a\n....", "empty.txt": b"", "fake.pdf": b"GIF89a not a pdf",
         "broken.pdf": pdf("broken") * 50, "c.pdf": pdf("c")},
        corrupt=["broken.pdf"],
    )
    parsed = parse(data)
    assert [r.line_no for r in parsed.rows] == [2, 3, 4, 5, 6]
    first, bad_case, no_files, wrong_width, last = parsed.rows
    assert [(f.name, f.error_code) for f in first.files] == [
        ("a.pdf", None), ("b.png", None), ("missing.pdf", "S3_NOT_FOUND"), ("evil.exe", "INVALID_FORMAT"),
        ("../escape.pdf", "INVALID_FORMAT"), ("a.pdf", "INVALID_FORMAT")]
    assert first.files[0].sha256 and first.files[0].size == len(pdf("a"))
    assert (bad_case.error_code, bad_case.error_message) == ("INVALID_FORMAT", "case_id is not a UUID")
    assert (no_files.error_code, no_files.error_message) == ("INVALID_FORMAT", "no evidence files named")
    assert wrong_width.error_code == "INVALID_FORMAT" and "fields" in (wrong_width.error_message or "")
    assert [(f.name, f.error_code) for f in last.files] == [
        ("empty.txt", "CORRUPTED_FILE"), ("fake.pdf", "CORRUPTED_FILE"), ("broken.pdf", "CORRUPTED_FILE")]
    assert parsed.error_counts() == {"CORRUPTED_FILE": 3, "INVALID_FORMAT": 6, "S3_NOT_FOUND": 1}


@pytest.mark.parametrize(("data", "code", "says"), [
    (b"this is not a zip at all", "CORRUPTED_FILE", "not a readable ZIP"),
    (make_zip([], {"other.pdf": pdf("x")}, manifest=b"")[:-30], "CORRUPTED_FILE", "not a readable ZIP"),
    (make_zip([], {}, manifest=b"\xff\xfe\x00bad"), "INVALID_FORMAT", "not UTF-8"),
    (make_zip([], {}, manifest=b"case,files\n1,2\n"), "INVALID_FORMAT", "needs the columns"),
    (make_zip([], {}, manifest=b""), "INVALID_FORMAT", "is empty"),
])
def test_unreadable_archive_is_one_clear_error(data: bytes, code: str, says: str) -> None:
    """An archive that cannot be read at all raises ArchiveRejected with a code and a plain message."""
    with pytest.raises(policy.ArchiveRejected) as caught:
        parse(data)
    assert caught.value.code == code and says in caught.value.message


def test_zip_bomb_and_oversized_files_are_refused() -> None:
    """Uncompressed size is checked before reading; a file over the limit is INVALID_FORMAT."""
    case = case_uuid("p", 3)
    data = make_zip([[case, "big.pdf"]], {"big.pdf": pdf("x") + b"0" * 50_000})
    assert parse(data, max_file=1000).rows[0].files[0].error_code == "INVALID_FORMAT"
    with pytest.raises(policy.ArchiveRejected, match="expands to more than"):
        parse(data, max_archive=10_000)


def test_ids_derive_from_natural_keys_only() -> None:
    """The same ZIP version gives the same job, row, artifact and event ids; another ETag another job."""
    job = policy.file_job_id("b", "inbox/x.zip", '"abc"')
    assert job == policy.file_job_id("b", "inbox/x.zip", "abc") != policy.file_job_id("b", "inbox/x.zip", "abd")
    row = policy.row_id(job, 2)
    assert policy.artifact_id(row, 0, "a.pdf") == policy.artifact_id(row, 0, "a.pdf") != policy.artifact_id(row, 1, "a.pdf")
    assert policy.retry_event_id(row, 1) != policy.retry_event_id(row, 2) != policy.initial_event_id(row)
    assert policy.partition_of(policy.row_entity(job, row)) == str(job)
    assert policy.split_row_entity(policy.row_entity(job, row)) == (job, row)


# ------------------------------------------------------------------------------------------ rollups


@pytest.mark.parametrize(("counts", "valid", "status"), [
    (policy.RowCounts(3, 3, 0, 0), True, "COMPLETED"),
    (policy.RowCounts(3, 0, 3, 1), True, "FAILED"),
    (policy.RowCounts(3, 1, 2, 0), True, "PARTIALLY_FAILED"),
    (policy.RowCounts(3, 1, 1, 2), True, "PARTIALLY_FAILED"),
    (policy.RowCounts(3, 1, 0, 2), True, "PENDING"),
    (policy.RowCounts(0, 0, 0, 0), False, "FAILED"),
])
def test_row_status_follows_artifact_facts(counts, valid, status) -> None:
    """004 §1.2: all attached → COMPLETED, all failed → FAILED, some failed → PARTIALLY_FAILED."""
    assert policy.row_evidence_status(counts, row_valid=valid) == status


# ---------------------------------------------------------------------------------- attempt plans


def art(**kw) -> ArtifactState:
    base = dict(id=uuid.uuid4(), file_job_id=uuid.uuid4(), file_job_row_id=uuid.uuid4(), case_id=uuid.uuid4(),
                file_name="a.pdf", s3_key="s3://b/k", content_sha256="x", attachment_status="PENDING",
                attachment_error_code=None, attempt_count=0, retry_count=0, retry_status="PENDING",
                next_retry_at=None, attempt_started_at=None)
    return ArtifactState(**{**base, **kw})


def test_plan_skips_attached_final_and_not_yet_due() -> None:
    """Rule 0: ATTACHED and PERMANENT_FAILED are skipped; a sibling not yet due keeps its own backoff."""
    fresh = art()
    attached = art(attachment_status="ATTACHED", attempt_count=1)
    final = art(attachment_status="FAILED", attempt_count=1, retry_status="PERMANENT_FAILED",
                attachment_error_code="CASE_NOT_FOUND")
    due = art(attachment_status="FAILED", attempt_count=1, retry_status="RETRY_FAILED", attachment_error_code="503",
              next_retry_at=NOW - timedelta(seconds=1))
    later = art(attachment_status="FAILED", attempt_count=1, retry_status="RETRY_FAILED", attachment_error_code="503",
                next_retry_at=NOW + timedelta(minutes=5))
    scheduled = art(attachment_status="FAILED", attempt_count=2, retry_count=1, retry_status="RETRY_SCHEDULED",
                    attachment_error_code="500", next_retry_at=NOW + timedelta(minutes=1))
    in_doubt = art(attempt_started_at=NOW - timedelta(minutes=1))
    stranger = art()
    every = [fresh, attached, final, due, later, scheduled, in_doubt, stranger]
    plan = policy.plan_attempts(every, named={a.id for a in every} - {stranger.id}, mode="retry", now=NOW,
                                max_attempts=3)
    assert [(p.artifact.id, p.attempt, p.lookup_first) for p in plan] == [
        (fresh.id, 1, False), (due.id, 2, True), (scheduled.id, 3, True), (in_doubt.id, 1, True)]


def test_replay_reopens_only_operational_final_failures() -> None:
    """An operator's replay retries CASE_NOT_FOUND/UNAUTHORIZED/exhausted ones, never DATA ones."""
    case_gone = art(attachment_status="FAILED", attempt_count=1, retry_status="PERMANENT_FAILED",
                    attachment_error_code="CASE_NOT_FOUND")
    exhausted = art(attachment_status="FAILED", attempt_count=3, retry_count=2, retry_status="PERMANENT_FAILED",
                    attachment_error_code="503")
    corrupted = art(attachment_status="FAILED", retry_status="PERMANENT_FAILED", attachment_error_code="CORRUPTED_FILE")
    plan = policy.plan_attempts([case_gone, exhausted, corrupted], named={case_gone.id, exhausted.id, corrupted.id},
                                mode="replay", now=NOW, max_attempts=3)
    assert [(p.artifact.id, p.attempt) for p in plan] == [(case_gone.id, 2), (exhausted.id, 4)]


def failure(core: Code, retry_after: float | None = None) -> Failure:
    return EVIDENCE.apply(Failure.of(core, retry_after=retry_after))


def test_outcomes_follow_004s_backoff_and_budget() -> None:
    """5 min then 10 min (±20 %), at most 3 attempts; a permanent code stops at once; success clears errors."""
    a = art()
    rng = random.Random(1)
    first = policy.decide_write(PlannedAttempt(a, 1, False), AttemptOutcome(failure=failure(Code.UPSTREAM_UNAVAILABLE)),
                                now=NOW, rng=rng, time_scale=1.0, max_attempts=3)
    assert (first.attachment_status, first.attachment_error_code, first.retry_status) == ("FAILED", "503", "RETRY_FAILED")
    assert (first.attempt_count, first.retry_count, first.last_retry_at) == (1, 0, None)
    assert timedelta(minutes=4) <= first.next_retry_at - NOW <= timedelta(minutes=6)
    second = policy.decide_write(PlannedAttempt(a, 2, True), AttemptOutcome(failure=failure(Code.UPSTREAM_INTERNAL)),
                                 now=NOW, rng=rng, time_scale=1.0, max_attempts=3)
    assert (second.attachment_error_code, second.retry_status, second.retry_count) == ("500", "RETRY_FAILED", 1)
    assert timedelta(minutes=8) <= second.next_retry_at - NOW <= timedelta(minutes=12)
    third = policy.decide_write(PlannedAttempt(a, 3, True), AttemptOutcome(failure=failure(Code.NETWORK_TIMEOUT)),
                                now=NOW, rng=rng, time_scale=1.0, max_attempts=3)
    assert (third.retry_status, third.next_retry_at, third.final, third.reason) == ("PERMANENT_FAILED", None, True, "exhausted")
    gone = policy.decide_write(PlannedAttempt(a, 1, False), AttemptOutcome(failure=failure(Code.NOT_FOUND)),
                               now=NOW, rng=rng, time_scale=1.0, max_attempts=3)
    assert (gone.attachment_error_code, gone.retry_status, gone.final) == ("CASE_NOT_FOUND", "PERMANENT_FAILED", True)
    ok = policy.decide_write(PlannedAttempt(a, 2, True), AttemptOutcome("att_1", recovered_by_lookup=True),
                             now=NOW, rng=rng, time_scale=1.0, max_attempts=3)
    assert (ok.attachment_status, ok.attachment_error_code, ok.retry_status, ok.case_attachment_id, ok.reason) == (
        "ATTACHED", None, "RETRY_SUCCESS", "att_1", "recovered_by_lookup")


def test_time_scale_shrinks_the_wait_and_retry_after_is_capped_at_60_minutes() -> None:
    """`time_scale` multiplies the wait; a server's Retry-After lengthens it up to the 60 min cap only."""
    a = art()
    scaled = policy.decide_write(PlannedAttempt(a, 1, False), AttemptOutcome(failure=failure(Code.RATE_LIMITED)),
                                 now=NOW, rng=random.Random(2), time_scale=0.001, max_attempts=3)
    assert scaled.next_retry_at - NOW <= timedelta(seconds=0.37)
    told = policy.decide_write(PlannedAttempt(a, 1, False),
                               AttemptOutcome(failure=failure(Code.UPSTREAM_UNAVAILABLE, retry_after=86_400)),
                               now=NOW, rng=random.Random(2), time_scale=1.0, max_attempts=3)
    assert told.next_retry_at - NOW == timedelta(minutes=60)


@given(st.sampled_from(list(Code)), st.integers(min_value=1, max_value=3))
def test_core_decision_agrees_with_the_generated_is_retryable(core: Code, attempt: int) -> None:
    """A retry is scheduled exactly when 004's is_retryable (category, retry_count < 2) stays true."""
    w = policy.decide_write(PlannedAttempt(art(), attempt, attempt > 1), AttemptOutcome(failure=failure(core)),
                            now=NOW, rng=random.Random(0), time_scale=1.0, max_attempts=3)
    sql_is_retryable = evidence_category(w.attachment_error_code) in ("NETWORK", "SYSTEM") and w.retry_count < 2
    assert (w.retry_status == "RETRY_FAILED") == sql_is_retryable


# ------------------------------------------------------------------------------------ notifications


def facts(**kw) -> policy.JobFacts:
    base = dict(file_job_id=uuid.UUID(int=7), status="INGESTED", source_name="upload.zip", total=4,
                attempted_or_final=4, attached=2, in_flight=1, recovered_by_retry=0, invalid_rows=1, failed=())
    return policy.JobFacts(**{**base, **kw})


def test_gates() -> None:
    """N1 once every artifact had its attempt; N2 once N1 is out and nothing retryable is in flight."""
    assert not policy.n1_due(facts(attempted_or_final=3))
    assert policy.n1_due(facts())
    assert not policy.n1_due(facts(n1_requested=True))
    assert not policy.n1_due(facts(status="RECEIVED"))
    assert policy.n1_due(facts(status="INGEST_FAILED", total=0, attempted_or_final=0))
    assert not policy.n2_due(facts(in_flight=0), n1_requested=False)
    assert not policy.n2_due(facts(in_flight=1), n1_requested=True)
    assert policy.n2_due(facts(in_flight=0), n1_requested=True)
    assert not policy.n2_due(facts(in_flight=0, n2_requested=True), n1_requested=True)
    day = timedelta(hours=24)
    assert not policy.n2_forced_due(NOW, False, NOW + day - timedelta(seconds=1), day)
    assert policy.n2_forced_due(NOW, False, NOW + day, day)
    assert not policy.n2_forced_due(NOW, True, NOW + 2 * day, day)
    assert not policy.n2_forced_due(None, False, NOW + 2 * day, day)


def test_n2_lists_permanent_failures_as_cannot_retry() -> None:
    """N2 names each final failure with its code under "Cannot Retry"; N1 promises the retries."""
    failed = (policy.FailedArtifact(uuid.UUID(int=1), "case-9", "c/x.pdf", "CASE_NOT_FOUND", True),
              policy.FailedArtifact(uuid.UUID(int=2), "case-3", "bad.exe", "INVALID_FORMAT", True),
              policy.FailedArtifact(uuid.UUID(int=3), "case-3", "slow.pdf", "503", False))
    subject, text = policy.render_n1(facts(failed=failed))
    assert "2 of 4" in subject and "retry the 1 files" in text and "503: 1" in text
    subject, text = policy.render_n2(facts(failed=failed[:2], in_flight=0), forced=False)
    assert "final result" in subject
    cannot = text.split("Cannot Retry")[1]
    assert "case case-3: bad.exe: INVALID_FORMAT" in cannot and "case case-9: c/x.pdf: CASE_NOT_FOUND" in cannot
    summary = policy.summary_of(facts(failed=failed))
    assert summary["permanent_failed"] == 2 and summary["by_error_code"] == {"503": 1, "CASE_NOT_FOUND": 1,
                                                                             "INVALID_FORMAT": 1}
    assert [c["error_category"] for c in summary["cannot_retry"]] == ["DATA", "AUTH"]
    _, forced = policy.render_n2(facts(failed=failed), forced=True, forced_closed=1)
    assert "retry deadline" in forced


def test_row_dead_letter_code_ignores_data_failures() -> None:
    """Only failures an operator can act on dead-letter a row; the most frequent one names it."""
    assert policy.row_final_code(["INVALID_FORMAT", "CORRUPTED_FILE", "S3_NOT_FOUND"]) is None
    assert policy.row_final_code(["503", "CASE_NOT_FOUND", "CASE_NOT_FOUND", "INVALID_FORMAT"]) == ("CASE_NOT_FOUND", 2)
    assert policy.row_final_code(["UNAUTHORIZED", "503"]) == ("503", 1)


# ------------------------------------------------------------------------------------------- alerts


def test_alert_fires_once_per_episode_after_sustain() -> None:
    """Queue depth alerts only after 10 minutes above the threshold, once, and again only after clearing."""
    check = policy.AlertCheck("retry_queue_depth", True, "deep", sustain_seconds=600)
    s1 = policy.step_alert(None, check, NOW)
    assert not s1.fire and s1.state.condition_since == NOW
    s2 = policy.step_alert(s1.state, check, NOW + timedelta(minutes=9))
    assert not s2.fire
    s3 = policy.step_alert(s2.state, check, NOW + timedelta(minutes=10))
    assert s3.fire and s3.state.episode == 1
    assert not policy.step_alert(s3.state, check, NOW + timedelta(minutes=20)).fire
    cleared = policy.step_alert(s3.state, policy.AlertCheck("retry_queue_depth", False, ""), NOW + timedelta(minutes=21))
    assert not cleared.state.firing and cleared.state.condition_since is None
    again = policy.step_alert(cleared.state, policy.AlertCheck("retry_queue_depth", True, "", 0), NOW + timedelta(hours=1))
    assert again.fire and again.state.episode == 2


def test_alert_checks_match_004_thresholds() -> None:
    """>10 % permanent (with a minimum sample), >500 queued, >6 h N2 average, >15 min without a tick."""
    t = policy.Thresholds(0.10, 20, 500, 600, 6 * 3600, 900)
    quiet = policy.MetricsView(finished=100, permanent_failed=10, queue_depth_artifacts=500,
                               n2_latency_avg_seconds=6 * 3600, heartbeat_age_seconds=900, active_file_jobs=1)
    assert [c.condition for c in policy.alert_checks(quiet, t)] == [False, False, False, False]
    loud = policy.MetricsView(finished=100, permanent_failed=11, queue_depth_artifacts=501,
                              n2_latency_avg_seconds=6 * 3600 + 1, heartbeat_age_seconds=901, active_file_jobs=1,
                              permanent_by_code={"CASE_NOT_FOUND": 11})
    checks = policy.alert_checks(loud, t)
    assert [c.condition for c in checks] == [True, True, True, True]
    assert "CASE_NOT_FOUND×11" in checks[0].summary and checks[1].sustain_seconds == 600
    few = policy.MetricsView(finished=5, permanent_failed=5, queue_depth_artifacts=0, n2_latency_avg_seconds=None,
                             heartbeat_age_seconds=None, active_file_jobs=0)
    assert [c.condition for c in policy.alert_checks(few, t)] == [False, False, False, False]
