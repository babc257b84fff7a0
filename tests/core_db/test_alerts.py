"""Alerts go through a table: an outage loses none, a burst becomes one message, a repeat sends nothing."""

from __future__ import annotations

import os
from datetime import UTC, datetime

import sqlalchemy as sa

from redrive import alerts
from redrive.alerts import Alert
from redrive.clock import FrozenClock
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from redrive.reliability import Reliability
from redrive.schema import alert_deliveries
from resources.notify import NotifierResource, SlackApiResource, SlackWebhookResource

START = datetime(2026, 3, 8, 6, 0, tzinfo=UTC)


def runtime(engine: sa.Engine, clock: FrozenClock, **kw) -> Reliability:
    channels = NotifierResource(slack=SlackWebhookResource(url=f"{os.environ['SANDBOX_URL']}/slack/webhook/ops"),
                                **kw).channels()
    return Reliability(engine=engine, channels=channels, clock=clock, burst_window=300)


def final(entity: str, clock: FrozenClock, code: Code = Code.AUTH_DENIED) -> FinalFailure:
    return FinalFailure(pipeline="evidence", stage="attach", entity_ref=entity, failure=Failure.of(code),
                        attempts=3, at=clock.now(), tenant="acme")


def test_slack_outage_keeps_alert_pending_then_delivers(engine, sandbox) -> None:
    """Slack answers 503: the alert stays pending with a retry time; the next dispatch sends it once."""
    clock = FrozenClock(START)
    rt = runtime(engine, clock)
    sandbox.script("slack", {"status": 503})
    rt.fail_for_good(final("art-1", clock))
    assert sandbox.count("slack.message") == 0
    with engine.connect() as conn:
        row = conn.execute(sa.select(alert_deliveries)).one()
    assert (row.status, row.attempts) == ("pending", 1) and row.next_attempt_at > clock.now()
    assert "503" in row.last_error

    assert rt.try_dispatch().sent_messages == 0  # not due yet: no hammering a down notifier
    clock.advance(alerts.retry_delay(1))
    assert rt.try_dispatch().sent_messages == 1
    assert sandbox.count("slack.message") == 1
    assert rt.try_dispatch().sent_messages == 0


def test_burst_of_same_error_class_becomes_one_message_with_count(engine, sandbox) -> None:
    """Ten entities fail with one error class within the window: one message at once, one with ×9 later."""
    clock = FrozenClock(START)
    rt = runtime(engine, clock)
    for i in range(10):
        rt.fail_for_good(final(f"art-{i}", clock))
        clock.advance(5)
    texts = [e["payload"]["text"] for e in sandbox.effects("slack.message")]
    assert len(texts) == 1 and "art-0" in texts[0]
    clock.advance(300)
    rt.try_dispatch()
    texts = [e["payload"]["text"] for e in sandbox.effects("slack.message")]
    assert len(texts) == 2
    assert "×9" in texts[1] and "art-1" in texts[1] and "and 4 more" in texts[1]


def test_different_error_classes_are_not_folded_together(engine, sandbox) -> None:
    """The burst window is per pipeline and error class: another class is told at once."""
    clock = FrozenClock(START)
    rt = runtime(engine, clock)
    rt.fail_for_good(final("art-1", clock, Code.AUTH_DENIED))
    rt.fail_for_good(final("art-2", clock, Code.NOT_FOUND))
    assert sandbox.count("slack.message") == 2


def test_same_final_failure_reported_twice_alerts_once(engine, sandbox) -> None:
    """A re-executed op reporting the same final failure adds an occurrence, not a dead letter or message."""
    clock = FrozenClock(START)
    rt = runtime(engine, clock)
    first = rt.fail_for_good(final("art-1", clock))
    second = rt.fail_for_good(final("art-1", clock))
    assert first.created and not second.created
    assert second.dead_letter.id == first.dead_letter.id and second.dead_letter.occurrences == 2
    assert sandbox.count("slack.message") == 1


def test_email_channel_sends_beside_slack(engine, sandbox) -> None:
    """With recipients configured, the same alert goes by email too, each channel once."""
    clock = FrozenClock(START)
    rt = runtime(engine, clock, email_to="ops@example.com,lead@example.com",
                 mail_api_url=f"{os.environ['SANDBOX_URL']}/mail/v1")
    rt.fail_for_good(final("art-1", clock))
    mails = sandbox.effects("mail.send")
    assert sorted(m["to"] for m in mails) == ["lead@example.com", "ops@example.com"]
    assert sandbox.count("slack.message") == 1


def test_no_channel_configured_keeps_alerts_for_later(engine) -> None:
    """Without channels nothing is sent and nothing is lost: deliveries wait for a channel."""
    clock = FrozenClock(START)
    rt = Reliability(engine=engine, channels={}, clock=clock)
    rt.alert(Alert(pipeline="p", kind="stuck", dedupe_key="stuck:1", summary="stuck"))
    with engine.connect() as conn:
        assert alerts.pending_count(conn) == 0  # no channel at enqueue time: no delivery rows
        assert conn.execute(sa.text("SELECT count(*) FROM alerts")).scalar() == 1


def test_render_carries_entity_tenant_error_attempts_and_link() -> None:
    """The message says what an operator needs: entity, tenant, error, attempts and where to look."""
    _, text = alerts.render([{"pipeline": "matching", "kind": "dead_letter", "error_class": "AUTH_DENIED",
                              "summary": "llm dead-lettered", "entity_ref": "doc-7", "tenant": "acme",
                              "attempts": 3, "link": "http://dagster/runs/abc"}])
    for part in ("doc-7", "acme", "AUTH_DENIED", "attempts: 3", "http://dagster/runs/abc"):
        assert part in text


def test_slack_web_api_channel_posts_through_dagster_slack(engine, sandbox) -> None:
    """With a bot token, alerts go through dagster-slack's resource (with a base URL) to chat.postMessage."""
    clock = FrozenClock(START)
    channels = NotifierResource(slack=SlackApiResource(token="xoxb-test-token", channel="#ops",
                                                       base_url=f"{os.environ['SANDBOX_URL']}/slack/api/")).channels()
    Reliability(engine=engine, channels=channels, clock=clock).fail_for_good(final("art-9", clock))
    [message] = sandbox.effects("slack.message")
    assert message["channel"] == "#ops" and "art-9" in message["payload"]["text"]
    assert "xoxb-test-token" not in str(message)
