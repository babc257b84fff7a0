"""Send-and-mark (§6.4) and the failure matrix (§8.2, §8.3) against the sandbox's mail provider."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import sqlalchemy as sa

from assets.review_notifications import api, policy, repository
from assets.review_notifications.delivery import Deliverer
from redrive.failures import PermanentError
from redrive.schema import alerts, dead_letters
from redrive.settings import PROJECT_ROOT
from resources.review_notifications import MailProvider
from tests.review_notifications.conftest import RECIPIENTS, make_job, notifications, rows
from tests.review_notifications.crash_worker import CRASHED


def one_per_recipient(sandbox, version: int = 3, recipients=RECIPIENTS) -> None:
    sent = [(e["to"], e["idempotency_token"]) for e in notifications(sandbox)]
    expected = [(r, policy.provider_token("CL-1", r, version)) for r in recipients]
    assert sorted(sent) == sorted(expected)


def mail_calls(sandbox) -> list[str]:
    calls = sorted(sandbox.requests("mail.send") + sandbox.requests("mail.lookup"), key=lambda r: r["seq"])
    return [f"{r['method']} {r['status']}" for r in calls]


def slack_texts(sandbox) -> list[str]:
    return [e["payload"]["text"] for e in sandbox.effects("slack.message")]


def test_each_recipient_is_sent_and_marked_once(engine, sandbox, deliverer, clock) -> None:
    """Happy path: one send per row, then notification_id, notified_at and `sent`; a second pass sends nothing."""
    job = make_job(engine)
    report = deliverer.deliver(job)
    assert (report.sent, report.failed, report.retries, report.transient) == (3, 0, 0, None)
    one_per_recipient(sandbox)
    ids = {e["to"]: e["message_id"] for e in notifications(sandbox)}
    for row in rows(engine, job.id):
        assert (row.status, row.notification_id, row.notified_at, row.attempts) == (
            "sent", ids[row.recipient], clock.now(), 1)

    posts = len(sandbox.requests("mail.send"))
    again = deliverer.deliver(job)
    assert (again.sent, again.verified) == (0, 3)  # reconciled against the provider, nothing sent
    assert len(sandbox.requests("mail.send")) == posts
    one_per_recipient(sandbox)


def test_crash_after_provider_accepted_then_retry_sends_one_email_per_recipient(engine, db_url, sandbox,
                                                                               deliverer) -> None:
    """§8.2 row 1: a process dies between the provider's 202 and the mark write; the retry backfills by lookup."""
    job = make_job(engine)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    crashed = subprocess.run([sys.executable, "-m", "tests.review_notifications.crash_worker", db_url, job.key, "2"],
                             cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert crashed.returncode == CRASHED, crashed.stderr[-2000:]
    first, second, third = rows(engine, job.id)
    assert first.status == "sent"
    assert (second.status, second.notification_id, second.notified_at) == ("sending", None, None)  # the window
    assert third.status == "pending"
    assert len(notifications(sandbox)) == 2  # the provider did send the second one

    report = deliverer.deliver(job)
    assert (report.backfilled, report.sent) == (1, 1)
    one_per_recipient(sandbox)
    token = policy.provider_token("CL-1", second.recipient, 3)
    posts = [r for r in sandbox.requests("mail.send")]
    assert len(posts) == 3  # the crashed row was looked up, never posted again
    second = rows(engine, job.id)[1]
    assert second.status == "sent"
    assert second.notification_id == next(e["message_id"] for e in notifications(sandbox)
                                          if e["idempotency_token"] == token)


class FailMarkOnce:
    """The provider accepted; the write of notified_at then fails (a connection lost mid-write)."""

    def __init__(self) -> None:
        self.armed = True

    def after_provider_accept(self, delivery_id: int, message_id: str) -> None:
        if self.armed:
            self.armed = False
            raise sa.exc.OperationalError("UPDATE review_deliveries", {}, ConnectionError("server closed the connection"))


def test_failed_mark_write_is_retried_by_lookup_not_resend(engine, sandbox, mail, runtime, clock) -> None:
    """§8.2 row 1 in process: DB_TRANSIENT after the send → the retry re-reads, looks up, backfills."""
    job = make_job(engine, recipients=RECIPIENTS[:1])
    report = Deliverer(engine, mail, runtime, sleep=clock.sleep, hooks=FailMarkOnce()).deliver(job)
    assert (report.sent, report.backfilled, report.retries) == (0, 1, 1)
    one_per_recipient(sandbox, recipients=RECIPIENTS[:1])
    assert [r["method"] for r in sandbox.requests("mail.send")] == ["POST"]
    assert rows(engine, job.id)[0].status == "sent"


def test_lost_provider_response_is_recovered_by_lookup(engine, sandbox, deliverer) -> None:
    """The provider sends, then answers 500 (response lost): the retry finds the message, never posts again."""
    job = make_job(engine, recipients=RECIPIENTS[:1])
    sandbox.script("mail.send", {"kind": "effect_then_error", "status": 500})
    report = deliverer.deliver(job)
    assert (report.sent, report.backfilled, report.retries) == (0, 1, 1)
    one_per_recipient(sandbox, recipients=RECIPIENTS[:1])
    assert len(sandbox.requests("mail.send")) == 1
    assert [r["route"] for r in sandbox.requests("mail.lookup")] == ["mail.lookup"]


def test_partial_row_with_id_but_no_notified_at_is_looked_up_before_resend(engine, sandbox, deliverer) -> None:
    """§6.4: notification_id without notified_at → provider-id lookup: found → backfilled; unknown → sent once."""
    job = make_job(engine, recipients=RECIPIENTS[:2])
    known, unknown = rows(engine, job.id)
    deliverer.mail.send(repository_mail(job, known))  # a send happened before the crash…
    accepted = notifications(sandbox)[0]["message_id"]
    table = repository.review_deliveries
    with engine.begin() as conn:  # …and only the id made it to the row (an older, two-write code path)
        conn.execute(sa.update(table).where(table.c.id == known.id).values(notification_id=accepted, attempts=1))
        conn.execute(sa.update(table).where(table.c.id == unknown.id).values(notification_id="msg_unknown",
                                                                             attempts=1))
    report = deliverer.deliver(job)
    assert (report.backfilled, report.sent) == (1, 1)
    one_per_recipient(sandbox, recipients=RECIPIENTS[:2])
    assert [(r.status, r.notification_id) for r in rows(engine, job.id)] == [
        ("sent", accepted), ("sent", notifications(sandbox)[1]["message_id"])]


def repository_mail(job: repository.Job, row: repository.Delivery):
    from resources.review_notifications import OutgoingMail

    subject, text = policy.render(job.changelist_id, job.review_version, job.summary)
    return OutgoingMail(to=row.recipient, subject=subject, text=text, idempotency_token=row.provider_token)


def force_marked_sent(engine, delivery_id: int, notification_id: str | None = "msg_never_sent") -> None:
    table = repository.review_deliveries
    with engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.id == delivery_id)
                     .values(status="sent", notified_at=sa.func.now(), notification_id=notification_id))


def test_marked_sent_without_provider_evidence_is_reconciled_resent_once_and_alerted_once(
        engine, sandbox, deliverer) -> None:
    """§8.2 row 2 / §8.3: the forced row is reconciled before any send, resent once, one Slack alert."""
    job = make_job(engine)
    victim = rows(engine, job.id)[1]
    force_marked_sent(engine, victim.id)

    report = deliverer.deliver(job)
    assert (report.reconciled, report.sent) == (1, 3)
    one_per_recipient(sandbox)
    row = rows(engine, job.id)[1]
    assert row.status == "sent" and row.reconciliations == 1 and row.notification_id != "msg_never_sent"
    calls = mail_calls(sandbox)
    # lookups by id and by token come first; then only sends (3 notifications + the alert's email channel)
    assert calls[:2] == ["GET 404", "GET 404"] and calls[2:] == ["POST 202"] * 4
    alerted = [t for t in slack_texts(sandbox) if policy.ORDERING_VIOLATION in t]
    assert len(alerted) == 1 and f"CL-1:v3:d{victim.id}" in alerted[0] and "episode 1" in alerted[0]

    again = deliverer.deliver(job)  # a rerun verifies; no second alert, no second email
    assert (again.reconciled, again.sent, again.verified) == (0, 0, 3)
    one_per_recipient(sandbox)
    assert len([t for t in slack_texts(sandbox) if policy.ORDERING_VIOLATION in t]) == 1


def test_a_second_violation_of_the_same_row_is_a_new_episode_with_its_own_alert(engine, sandbox, deliverer) -> None:
    """The dedupe key names the row and its episode: a repeat is alerted, a re-detection of one episode is not."""
    job = make_job(engine, recipients=RECIPIENTS[:1])
    row = rows(engine, job.id)[0]
    force_marked_sent(engine, row.id, notification_id=None)
    deliverer.deliver(job)
    sandbox.reset()  # the provider forgets everything (a restored provider account)…
    deliverer.deliver(job)  # …so the row, marked sent, has no evidence again: episode 2
    one_per_recipient(sandbox, recipients=RECIPIENTS[:1])
    with engine.connect() as conn:
        keys = conn.execute(sa.select(alerts.c.dedupe_key).where(alerts.c.kind == "ordering_violation")
                            .order_by(alerts.c.id)).scalars().all()
    assert keys == [f"review_notifications:ordering_violation:{row.id}:1",
                    f"review_notifications:ordering_violation:{row.id}:2"]


def test_alert_survives_a_crash_between_alert_and_repair(engine, sandbox, deliverer, runtime) -> None:
    """Alert first, then clear: found again in the same episode, the row alerts once and is repaired once."""
    job = make_job(engine, recipients=RECIPIENTS[:1])
    row = rows(engine, job.id)[0]
    force_marked_sent(engine, row.id)
    with engine.connect() as conn:
        stale = repository.get_delivery(conn, row.id)
    deliverer._ordering_violation(job, stale)  # as if the process died right after this call's alert…
    with engine.begin() as conn:  # …undo the repair so the next pass meets the same episode
        conn.execute(sa.update(repository.review_deliveries).where(repository.review_deliveries.c.id == row.id)
                     .values(status="sent", notified_at=sa.func.now(), notification_id="msg_never_sent",
                             reconciliations=0))
    deliverer.deliver(job)
    assert len([t for t in slack_texts(sandbox) if policy.ORDERING_VIOLATION in t]) == 1
    assert rows(engine, job.id)[0].reconciliations == 1
    one_per_recipient(sandbox, recipients=RECIPIENTS[:1])


def test_transient_failures_retry_with_backoff_honouring_retry_after(engine, sandbox, deliverer, clock) -> None:
    """429 (Retry-After 3) and 503 are retried in process; the waits come from the policy, slept on the clock."""
    job = make_job(engine, recipients=RECIPIENTS[:1])
    sandbox.script("mail.send", {"status": 429, "headers": {"Retry-After": "3"}}, {"status": 503})
    report = deliverer.deliver(job)
    assert (report.sent, report.retries) == (1, 2)
    assert clock.sleeps[0] == 3.0 and 0 <= clock.sleeps[1] <= policy.ROW_BACKOFF.max_delay
    one_per_recipient(sandbox, recipients=RECIPIENTS[:1])


def test_transient_failure_past_the_budget_stops_the_pass_for_the_job_level_retry(engine, sandbox,
                                                                                deliverer) -> None:
    """A provider that keeps failing: no row fails for good; the rows wait, the pass reports the failure."""
    job = make_job(engine)
    sandbox.script("mail.send", *[{"status": 503}] * policy.ROW_MAX_ATTEMPTS)
    report = deliverer.deliver(job)
    assert report.transient is not None and report.transient.code == "PROVIDER_UNAVAILABLE"
    assert (report.sent, report.failed, report.waiting) == (0, 0, 3)
    assert len(sandbox.requests("mail.send")) == policy.ROW_MAX_ATTEMPTS  # it stopped: later rows untouched
    assert [r.status for r in rows(engine, job.id)] == ["sending", "pending", "pending"]
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar() == 0

    later = deliverer.deliver(job)  # the job-level retry: the first row is looked up, then sent
    assert (later.sent, later.transient) == (3, None)
    one_per_recipient(sandbox)


def test_an_in_process_retry_over_the_mail_budget_is_not_sent_and_leaves_the_job_to_the_drain(
        engine, sandbox, deliverer, clock) -> None:
    """Issue 26 §4: a row's in-process retry is a retry to the mail provider. With the budget spent (room for one
    failing retry in 10 s, taken by another entity), bo's retry after its 503 is held back before anything is
    sent: the pass raises RetryDeferred (the drain makes the job due later, no attempt spent), bo stays
    `sending` and is looked up first on the next pass, which sends each recipient once."""
    import httpx

    from redrive import upstreams as up

    job = make_job(engine)
    budget = up.Upstreams(engine, {"mail": up.UpstreamLimits(retry_share=0.0, retry_floor_per_second=0.1,
                                                             retry_window_seconds=10)}, clock=clock, sleep=clock.sleep)

    def down() -> None:
        raise httpx.ConnectError("the provider is down")

    sandbox.script("mail.send", {"kind": "ok"}, {"status": 503})
    up.install(budget)
    try:
        with up.retrying(), pytest.raises(httpx.ConnectError):
            budget.call("mail", down)
        with pytest.raises(up.RetryDeferred):
            deliverer.deliver(job)
        assert len(sandbox.requests("mail.send")) == 2  # ana, bo's 503; bo's retry not sent
        assert [r.status for r in rows(engine, job.id)] == ["sent", "sending", "pending"]
        clock.advance(11)  # the window has room again
        later = deliverer.deliver(job)
    finally:
        up.install(None)
    assert (later.sent, later.backfilled, later.transient) == (2, 0, None)
    one_per_recipient(sandbox)


@pytest.mark.parametrize(("step", "error_class"), [
    (None, "INVALID_RECIPIENT"),  # the sandbox refuses the undeliverable domain with 422
    ({"status": 422, "error_code": "content_policy_violation"}, "POLICY_REJECTED"),
])
def test_permanent_rejection_fails_only_that_recipient_with_one_dead_letter_and_alert(
        engine, sandbox, deliverer, step, error_class) -> None:
    """§8.1: the rejected row is failed and dead-lettered (entity = the row); the others are sent; no address leaks."""
    bad = "nobody@invalid.example" if step is None else "ana@example.com"
    job = make_job(engine, recipients=[bad, "bo@example.com"])
    if step is not None:
        sandbox.script("mail.send", step)
    report = deliverer.deliver(job)
    assert (report.failed, report.sent, report.retries) == (1, 1, 0)
    failed, sent = rows(engine, job.id)
    assert failed.status == "failed" and failed.last_error.startswith(error_class)
    assert sent.status == "sent"
    with engine.connect() as conn:
        [letter] = conn.execute(sa.select(dead_letters)).all()
        job_now = api.finalize(conn, job.id, deliverer.runtime.now())
    assert (letter.entity_ref, letter.error_class, letter.stage) == (f"CL-1:v3:d{failed.id}", error_class, "send")
    assert bad not in str(letter._mapping)  # sanitized: no address in the dead letter
    texts = slack_texts(sandbox)
    assert len(texts) == 1 and error_class in texts[0] and bad not in texts[0]
    assert job_now.status == policy.RETRYABLE_FAILED  # §6.5: not every required recipient is notified

    deliverer.deliver(job)  # a rerun does not retry a failed row, nor alert again
    assert len(slack_texts(sandbox)) == 1 and rows(engine, job.id)[0].status == "failed"


@pytest.mark.parametrize(("step", "error_class"), [
    ({"status": 401}, "PROVIDER_AUTH_DENIED"),
    ({"status": 409, "error_code": "IDEMPOTENCY_TOKEN_REUSED"}, "IDEMPOTENCY_TOKEN_REUSED"),
])
def test_job_wide_permanent_failure_is_raised_for_the_job_not_the_recipient(engine, sandbox, deliverer, step,
                                                                            error_class) -> None:
    """Bad credentials or a non-deterministic payload: no recipient is blamed; the job's stage decides."""
    job = make_job(engine)
    sandbox.script("mail.send", step)
    with pytest.raises(PermanentError) as raised:
        deliverer.deliver(job)
    assert raised.value.failure.code == error_class
    assert [r.status for r in rows(engine, job.id)] == ["sending", "pending", "pending"]
    assert notifications(sandbox) == []


def test_one_deliverer_per_job(engine, sandbox, deliverer) -> None:
    """While one pass holds the job, a second one backs off without touching the outbox."""
    job = make_job(engine)
    with repository.job_lock(engine, job.id) as held:
        assert held
        report = deliverer.deliver(job)
    assert report.busy and report.sent == 0 and sandbox.requests("mail.send") == []


@pytest.mark.parametrize("step", [
    {"kind": "timeout", "seconds": 1},  # no answer within our client timeout
    {"kind": "reset"},  # the connection drops mid-response
    {"kind": "malformed"},  # a 2xx whose body does not parse
])
def test_transport_faults_are_retried_and_end_in_one_email(engine, sandbox, runtime, clock, step) -> None:
    """Timeouts, dropped connections and garbled answers are transient; the retry looks up first, then sends once."""
    job = make_job(engine, recipients=RECIPIENTS[:1])
    sandbox.script("mail.send", step)
    with MailProvider(f"{os.environ['SANDBOX_URL']}/mail/v1", "sandbox-token", timeout_seconds=0.3) as quick:
        report = Deliverer(engine, quick, runtime, sleep=clock.sleep).deliver(job)
    assert (report.sent + report.backfilled, report.retries, report.transient) == (1, 1, None)
    one_per_recipient(sandbox, recipients=RECIPIENTS[:1])
    assert rows(engine, job.id)[0].status == "sent"
