"""The attach worker against real Postgres and the sandbox case API: outcomes, backoff, permanent codes,
the lookup that closes the "attached but not recorded" race, and the row lock. Retries and dead
letters go through the core's drain (`drain` fixture): a retry is the row's work item falling due."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import sqlalchemy as sa

from assets.evidence import policy
from assets.evidence import repository as repo
from assets.evidence.worker import AttachWorker, WorkerHooks
from redrive.clock import FrozenClock

A = repo.file_job_artifact


def artifacts(engine: sa.Engine, job) -> list:
    with engine.connect() as conn:
        return conn.execute(sa.select(A).where(A.c.file_job_id == job).order_by(A.c.file_name)).all()


def retry_events(engine, job) -> list:
    with engine.connect() as conn:
        return conn.execute(sa.select(repo.evidence_outbox).where(
            repo.evidence_outbox.c.file_job_id == job, repo.evidence_outbox.c.event_type == "EVIDENCE_ATTACH_RETRY")
            .order_by(repo.evidence_outbox.c.seq)).all()


def attach_statuses(sandbox) -> list[int | None]:
    return [r["status"] for r in sandbox.requests("case.attach")]


def test_first_pass_attaches_everything_and_opens_both_gates(runtime, case_api, seed_job, engine, sandbox) -> None:
    """All attached on the first try: the event is consumed, the row COMPLETED, N1 and N2 requested."""
    job, [event], [row] = seed_job(per_row=3)
    result = AttachWorker(runtime, case_api, max_attempts=3).process_event(event)
    assert [r.status for r in result.results] == ["ATTACHED"] * 3 and result.settled
    assert [(a.attachment_status, a.attempt_count, a.retry_status, a.attempt_started_at) for a in artifacts(engine, job)] == [
        ("ATTACHED", 1, "PENDING", None)] * 3
    assert sandbox.count("case.attach") == 3 and attach_statuses(sandbox) == [201] * 3
    assert {e["idempotency_key"] for e in sandbox.effects("case.attach")} == {str(a.id) for a in artifacts(engine, job)}
    with engine.connect() as conn:
        assert repo.get_event(conn, event).status == "CONSUMED"
        assert conn.execute(sa.select(repo.file_job_row.c.evidence_status)).scalar() == "COMPLETED"
        assert [e.payload["kind"] for e in repo.notification_events(conn, job)] == ["N1", "N2"]
    again = AttachWorker(runtime, case_api, max_attempts=3).process_event(event)
    assert again.skipped == "event already consumed" and sandbox.count("case.attach") == 3


def test_transient_failure_waits_its_backoff_then_the_scheduler_requeues(runtime, clock: FrozenClock, drain,
                                                                         seed_job, engine, sandbox) -> None:
    """A 503 is RETRY_FAILED with next_retry_at ≈ 5 min and the row's retry event is written; not due,
    nothing is worked; once due the row's pass attaches it (looking it up first): RETRY_SUCCESS."""
    job, [event], [row] = seed_job(per_row=2)
    sandbox.script("case.attach", {"status": 503})
    assert drain(job).retried == 1
    failed = next(a for a in artifacts(engine, job) if a.attachment_status == "FAILED")
    assert (failed.attachment_error_code, failed.error_category, failed.retry_status, failed.is_retryable) == (
        "503", "NETWORK", "RETRY_FAILED", True)
    wait = failed.next_retry_at - clock.now()
    assert timedelta(minutes=4) <= wait <= timedelta(minutes=6)
    with engine.connect() as conn:
        assert conn.execute(sa.select(repo.file_job_row.c.evidence_status)).scalar() == "PARTIALLY_FAILED"
        assert [e.payload["kind"] for e in repo.notification_events(conn, job)] == ["N1"]  # N2 waits for the retry

    [retry] = retry_events(engine, job)
    assert retry.payload["retry_round"] == 1 and retry.status == "PENDING"
    assert len(retry.payload["artifacts"]) == 2  # Option A: every artifact of the row
    assert drain(job).claimed == 0  # not due yet
    clock.advance(wait.total_seconds())
    assert drain(job).done == 1
    assert [(a.id, a.attempt_count) for a in artifacts(engine, job) if a.attempt_count > 1] == [(failed.id, 2)]
    assert retry_events(engine, job)[0].status == "CONSUMED"
    done = next(a for a in artifacts(engine, job) if a.id == failed.id)
    assert (done.attachment_status, done.retry_status, done.retry_count, done.attachment_error_code) == (
        "ATTACHED", "RETRY_SUCCESS", 1, None)
    assert len(sandbox.requests("case.lookup")) == 1 and sandbox.count("case.attach") == 2
    with engine.connect() as conn:
        assert [e.payload["kind"] for e in repo.notification_events(conn, job)] == ["N1", "N2"]


def test_three_attempts_then_final_with_its_code_and_one_dead_letter(runtime, clock, drain, seed_job, engine,
                                                                     sandbox) -> None:
    """503, 500, timeout-ish 503: after the third attempt the artifact is PERMANENT_FAILED ("503"),
    retry_count 2, not retryable; its row is dead-lettered once and Slack hears once."""
    job, [event], [row] = seed_job(per_row=1)
    sandbox.script("case.attach", {"status": 503}, {"status": 500}, {"status": 503})
    drain(job)
    waits = []
    for _ in range(2):
        [a] = artifacts(engine, job)
        waits.append(a.next_retry_at - clock.now())
        clock.advance(waits[-1].total_seconds())
        assert drain(job).claimed == 1
    [a] = artifacts(engine, job)
    assert (a.attachment_status, a.attachment_error_code, a.retry_status, a.attempt_count, a.retry_count,
            a.is_retryable, a.next_retry_at) == ("FAILED", "503", "PERMANENT_FAILED", 3, 2, False, None)
    assert timedelta(minutes=4) <= waits[0] <= timedelta(minutes=6) and timedelta(minutes=8) <= waits[1] <= timedelta(minutes=12)
    clock.advance(3600)
    assert drain(job).claimed == 0
    with engine.connect() as conn:
        letters = conn.execute(sa.text("SELECT pipeline, stage, entity_ref, error_class, attempts FROM dead_letters")).all()
    assert [tuple(x) for x in letters] == [("evidence", "attach", policy.row_entity(job, row), "503", 3)]
    assert len(sandbox.effects("slack.message")) == 1


@pytest.mark.parametrize(("setup", "code"), [
    (lambda sb, case: sb.mark_cases_missing(case), "CASE_NOT_FOUND"),
    (lambda sb, case: sb.script("case.attach", {"status": 401}), "UNAUTHORIZED"),
    (lambda sb, case: sb.script("case.attach", {"status": 403}), "UNAUTHORIZED"),
])
def test_case_gone_and_auth_errors_are_permanent(runtime, clock, drain, seed_job, engine, sandbox, setup, code) -> None:
    """CASE_NOT_FOUND and auth failures are final at once (AUTH category), never requeued by the scheduler."""
    job, [event], [row] = seed_job(per_row=1)
    with engine.connect() as conn:
        case = str(conn.execute(sa.select(A.c.case_id)).scalar())
    setup(sandbox, case)
    drain(job)
    [a] = artifacts(engine, job)
    assert (a.attachment_error_code, a.error_category, a.retry_status, a.is_retryable) == (
        code, "AUTH", "PERMANENT_FAILED", False)
    clock.advance(7200)
    assert drain(job).claimed == 0
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT error_class FROM dead_letters")).scalar() == code


def test_unreadable_success_is_retried_not_called_corrupted(runtime, clock, case_api, seed_job, engine, sandbox) -> None:
    """A 200 whose body does not parse means "outcome unknown": retryable 500, never CORRUPTED_FILE."""
    job, [event], _ = seed_job(per_row=1)
    sandbox.script("case.attach", {"kind": "malformed"})
    AttachWorker(runtime, case_api, max_attempts=3).process_event(event)
    [a] = artifacts(engine, job)
    assert (a.attachment_error_code, a.retry_status) == ("500", "RETRY_FAILED")


def test_lost_response_is_found_by_lookup_not_attached_twice(runtime, clock, drain, seed_job, engine, sandbox) -> None:
    """effect_then_error: the case API attached it but answered 500. The retry looks it up by the artifact
    id and records ATTACHED without a second attach request."""
    job, [event], _ = seed_job(per_row=1)
    sandbox.script("case.attach", {"kind": "effect_then_error", "status": 500})
    drain(job)
    [a] = artifacts(engine, job)
    assert (a.attachment_status, a.attachment_error_code) == ("FAILED", "500")
    clock.advance((a.next_retry_at - clock.now()).total_seconds())
    assert drain(job).done == 1
    assert len(sandbox.requests("case.lookup")) == 1
    [a] = artifacts(engine, job)
    assert (a.attachment_status, a.retry_status, a.case_attachment_id) == (
        "ATTACHED", "RETRY_SUCCESS", sandbox.effects("case.attach")[0]["attachment_id"])
    assert attach_statuses(sandbox) == [500] and sandbox.count("case.attach") == 1


class FailWriteOnce(WorkerHooks):
    """After the case API accepted `victim`, the database write "fails" (once)."""

    def __init__(self, victim_index: int = 0) -> None:
        self.victim_index = victim_index
        self.calls = 0
        self.fired = False

    def after_case_api(self, artifact_id, outcome) -> None:
        self.calls += 1
        if not self.fired and outcome.attached and self.calls == self.victim_index + 1:
            self.fired = True
            raise sa.exc.OperationalError("UPDATE file_job_artifact", {}, ConnectionError("server closed the connection"))


def test_api_accepts_then_db_write_fails_retry_does_not_attach_again(runtime, case_api, seed_job, engine, sandbox) -> None:
    """004 §4's DB-first check misses this race (the artifact is not ATTACHED); the committed claim makes
    the retry look it up at the case API, so it is recorded ATTACHED and never attached a second time."""
    job, [event], _ = seed_job(per_row=3)
    hooks = FailWriteOnce(victim_index=1)
    with pytest.raises(sa.exc.OperationalError):
        AttachWorker(runtime, case_api, max_attempts=3, hooks=hooks).process_event(event)
    before = artifacts(engine, job)
    # nothing of this row's batch was written; every claim stands: all three are "in doubt"
    assert [(a.attachment_status, a.attempt_started_at is not None) for a in before] == [("PENDING", True)] * 3
    assert sandbox.count("case.attach") == 2
    result = AttachWorker(runtime, case_api, max_attempts=3, hooks=hooks).process_event(event)
    assert [(r.status, r.recovered_by_lookup) for r in result.results] == [
        ("ATTACHED", True), ("ATTACHED", True), ("ATTACHED", False)]
    assert all(a.attachment_status == "ATTACHED" for a in artifacts(engine, job))
    keys = [e["idempotency_key"] for e in sandbox.effects("case.attach")]
    assert len(keys) == len(set(keys)) == 3
    assert 200 not in attach_statuses(sandbox)  # no replayed attach: the victim was looked up, not re-sent


def test_last_attempt_with_lost_answer_is_looked_up_before_failing_for_good(runtime, clock, drain, seed_job,
                                                                            engine, sandbox) -> None:
    """503, 503, then accepted-but-answer-lost on the third and last attempt: the worker asks the case API
    before declaring it failed, finds it, and records ATTACHED (N2 must not call it failed)."""
    job, [event], _ = seed_job(per_row=1)
    sandbox.script("case.attach", {"status": 503}, {"status": 503}, {"kind": "effect_then_error", "status": 502})
    drain(job)
    for _ in range(2):
        [a] = artifacts(engine, job)
        clock.advance((a.next_retry_at - clock.now()).total_seconds())
        assert drain(job).claimed == 1
    [a] = artifacts(engine, job)
    assert (a.attachment_status, a.attempt_count, a.retry_status) == ("ATTACHED", 3, "RETRY_SUCCESS")
    assert sandbox.count("case.attach") == 1 and attach_statuses(sandbox) == [503, 503, 502]


def test_two_workers_on_one_row_attach_each_artifact_once(runtime, case_api, settings, seed_job, engine, sandbox) -> None:
    """The same event processed by two workers at once (a duplicate delivery): the row lock serialises them;
    the second finds everything ATTACHED and sends nothing."""
    from resources.evidence import CaseApiResource

    job, [event], _ = seed_job(per_row=5)
    barrier, results, errors = threading.Barrier(2), [], []

    def work() -> None:
        try:
            with CaseApiResource(base_url=settings.case_url, token="t").session() as api:
                barrier.wait()
                results.append(AttachWorker(runtime, api, max_attempts=3).process_event(event))
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert sorted(len(r.results) for r in results) == [0, 5]
    assert sandbox.count("case.attach") == 5 and attach_statuses(sandbox) == [201] * 5


def test_no_secret_from_an_error_body_reaches_the_artifact_or_the_dead_letter(runtime, drain, seed_job, engine,
                                                                               sandbox) -> None:
    """An upstream error echoing a token: the stored message, the dead letter and the alert carry the code,
    never the token."""
    job, [event], _ = seed_job(per_row=1)
    secret = "sk-live-4f9a8b7c6d5e4f3a2b1c"
    sandbox.script("case.attach", {"status": 401, "json": {"error": {"code": "UNAUTHORIZED",
                                                                      "message": f"bad token Bearer {secret}"}}})
    assert drain(job).dead_lettered == 1
    [a] = artifacts(engine, job)
    assert a.attachment_error_code == "UNAUTHORIZED" and secret not in (a.attachment_error_message or "")
    with engine.connect() as conn:
        letter = conn.execute(sa.text("SELECT error_message, last_stack, sanitized_context::text AS ctx "
                                      "FROM dead_letters")).one()
    assert secret not in letter.error_message + letter.last_stack + letter.ctx
    assert all(secret not in str(m["payload"]) for m in sandbox.effects("slack.message"))
