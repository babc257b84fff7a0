"""N1 and N2 (004 §5) through the sandbox mail provider: gates, exactly once, send-then-mark, the 24 h deadline."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from assets.evidence import repository as repo
from assets.evidence import service
from assets.evidence.worker import AttachWorker, NotificationSender

A = repo.file_job_artifact


def evidence_mails(sandbox) -> list[dict]:
    return [m for m in sandbox.effects("mail.send") if m["idempotency_token"].startswith("evidence:")]


def tick(runtime, *, timeout_hours: float = 24):
    return service.scheduler_tick(runtime.engine, now=runtime.now(), n2_timeout=timedelta(hours=timeout_hours),
                                  n2_marks_permanent=True, monotonic=runtime.clock.monotonic)


def job_row(engine, job):
    with engine.connect() as conn:
        return repo.get_file_job(conn, job)


def test_n1_after_first_pass_n2_after_retries_each_sent_once(runtime, clock, case_api, mail, seed_job, engine,
                                                            sandbox, drain) -> None:
    """N1 goes when every artifact had its attempt, N2 when the retry settled; sending again sends nothing."""
    job, events, _ = seed_job("n", rows=2, per_row=2)
    sandbox.script("case.attach", {"status": 503})
    worker = AttachWorker(runtime, case_api, max_attempts=3)
    sender = NotificationSender(runtime, mail)
    worker.process_event(events[0])
    assert sender.send_pending(job) == []  # one row still unattempted: no N1 yet
    worker.process_event(events[1])
    [n1] = sender.send_pending(job)
    assert n1.kind == "N1" and not n1.already_sent
    assert sender.send_pending(job) == [] and job_row(engine, job).n1_sent_at is not None

    clock.advance(3600)
    assert drain(job).claimed == 2  # the retry's row, and the attached row settling as done
    [n2] = sender.send_pending(job)
    assert n2.kind == "N2"
    assert sender.send_pending(job) == []
    mails = evidence_mails(sandbox)
    assert [m["idempotency_token"] for m in mails] == [f"evidence:{job}:N1", f"evidence:{job}:N2"]
    assert "3 of 4 files attached" in mails[0]["subject"] and "final result, 4 of 4" in mails[1]["subject"]
    stored = job_row(engine, job)
    assert (stored.n1_message_id, stored.n2_message_id) == (mails[0]["message_id"], mails[1]["message_id"])


def test_lost_mail_response_is_resent_under_the_same_token(runtime, case_api, mail, seed_job, engine, sandbox) -> None:
    """The provider sent N1 but the answer was lost: nothing is marked, the retry resends the stored
    message with the same token and the provider answers with the first message — one e-mail."""
    job, [event], _ = seed_job("lost", per_row=1)
    AttachWorker(runtime, case_api, max_attempts=3).process_event(event)
    sandbox.script("mail.send", {"kind": "effect_then_error", "status": 500})
    sender = NotificationSender(runtime, mail)
    with pytest.raises(Exception) as caught:
        sender.send_pending(job)
    assert "500" in str(caught.value)
    assert job_row(engine, job).n1_sent_at is None
    sent = sender.send_pending(job)
    assert [s.kind for s in sent] == ["N1", "N2"]
    assert len(evidence_mails(sandbox)) == 2  # N1 once (replayed by token), N2 once
    assert [r["status"] for r in sandbox.requests("mail.send")] == [500, 200, 202]


def test_mark_failure_after_send_does_not_send_twice(runtime, case_api, mail, seed_job, engine, sandbox,
                                                     monkeypatch) -> None:
    """Send first, then mark: our write fails after the provider accepted; the resend is a no-op there."""
    job, [event], _ = seed_job("mark", per_row=1)
    AttachWorker(runtime, case_api, max_attempts=3).process_event(event)
    real = repo.mark_notification_sent
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise sa.exc.OperationalError("UPDATE file_job", {}, ConnectionError("gone"))
        return real(*args, **kwargs)

    monkeypatch.setattr(repo, "mark_notification_sent", flaky)
    sender = NotificationSender(runtime, mail)
    with pytest.raises(sa.exc.OperationalError):
        sender.send_pending(job)
    assert [s.kind for s in sender.send_pending(job)] == ["N1", "N2"]
    assert [m["idempotency_token"].rsplit(":", 1)[1] for m in evidence_mails(sandbox)] == ["N1", "N2"]


def test_n2_is_forced_24h_after_n1_and_closes_open_retries(runtime, clock, case_api, mail, seed_job, engine,
                                                           sandbox, drain) -> None:
    """A retry stuck in flight: at the deadline (not before, and not while a worker holds the row) the open
    artifact becomes PERMANENT_FAILED, N2 goes out saying so, and the row is dead-lettered once."""
    job, [event], [row] = seed_job("late", per_row=2)
    sandbox.script("case.attach", {"status": 503})
    drain(job)
    sender = NotificationSender(runtime, mail)
    [n1] = sender.send_pending(job)
    clock.advance(600)  # the retry is due, but its run never happens: the artifact stays in flight
    clock.advance(timedelta(hours=24).total_seconds() - 601)
    assert tick(runtime).forced_n2 == []
    clock.advance(1)
    with engine.connect() as worker_conn, worker_conn.begin():
        repo.lock_row(worker_conn, job, row)  # a worker holds the row: the deadline waits for it
        assert tick(runtime).forced_n2 == []
    assert tick(runtime).forced_n2 == [job]
    with engine.connect() as conn:
        closed = conn.execute(sa.select(A.c.attachment_error_code, A.c.retry_status)
                              .where(A.c.attachment_status != "ATTACHED")).all()
        n2 = next(e for e in repo.notification_events(conn, job) if e.payload["kind"] == "N2")
    assert [tuple(c) for c in closed] == [("503", "PERMANENT_FAILED")]
    assert n2.payload["forced"] is True and n2.payload["closed_rows"] == [str(row)]
    [sent] = sender.send_pending(job)
    assert sent.kind == "N2" and job_row(engine, job).n2_forced
    mail_n2 = evidence_mails(sandbox)[-1]
    assert mail_n2["idempotency_token"] == f"evidence:{job}:N2"
    assert drain(job).dead_lettered == 1  # the forced close made the row due: its pass dead-letters it
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT error_class FROM dead_letters")).scalars().all() == ["503"]
    assert tick(runtime).forced_n2 == []  # never twice
    late = AttachWorker(runtime, case_api, max_attempts=3).process_row(job, row, mode="retry")
    assert late.results == []  # the stale retry finds the artifact closed and attaches nothing
    assert sandbox.count("case.attach") == 1


def test_n2_text_lists_cannot_retry(runtime, case_api, mail, engine, sandbox, seed_job) -> None:
    """Permanent failures (a deleted case, a file the archive lacks) appear in N2 under "Cannot Retry"."""
    from tests.evidence.helpers import case_uuid, make_zip, pdf

    gone, fine = case_uuid("ct", 1), case_uuid("ct", 2)
    data = make_zip([[gone, "a.pdf"], [fine, "b.pdf;missing.pdf"]], {"a.pdf": pdf("a"), "b.pdf": pdf("b")})
    job, events, _ = seed_job("ct", data=data)
    sandbox.mark_cases_missing(gone)
    worker = AttachWorker(runtime, case_api, max_attempts=3)
    for event in events:
        worker.process_event(event)
    NotificationSender(runtime, mail).send_pending(job)
    with engine.connect() as conn:
        n2 = next(e for e in repo.notification_events(conn, job) if e.payload["kind"] == "N2")
    text = n2.payload["text"]
    assert "Cannot Retry" in text
    assert f"case {gone}: a.pdf: CASE_NOT_FOUND" in text and f"case {fine}: missing.pdf: S3_NOT_FOUND" in text
    assert n2.payload["summary"]["permanent_failed"] == 2 and n2.payload["summary"]["attached"] == 1
