"""Issue 13 item 4: alert deliveries are keyed by a global identity, and core email uses the configured token."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from devstack.postgres import create_database, drop_database, with_database
from devstack.sandbox.launcher import SandboxProcess
from redrive.alerts import delivery_token
from redrive.clock import FrozenClock
from redrive.db import engine_for
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from redrive.reliability import Reliability
from redrive.schema import alert_deliveries, alerts
from redrive.settings import Settings
from resources.factory import notifier_from
from resources.notify import NotifierResource

START = datetime(2026, 3, 8, 6, 0, tzinfo=UTC)
OPS = "ops@example.com"


def _final(clock: FrozenClock) -> FinalFailure:
    return FinalFailure(pipeline="evidence", stage="attach", entity_ref="art-1", failure=Failure.of(Code.AUTH_DENIED),
                        attempts=3, at=clock.now(), tenant="acme")


@pytest.fixture
def second_db(admin_url: str, template_db: str) -> Iterator[str]:
    """Another fresh database from the same template: what a recreated or restored database looks like."""
    name = f"redrive_t_{os.getpid()}_second"
    drop_database(admin_url, name)
    create_database(admin_url, name, template=template_db)
    url = with_database(admin_url, name)
    yield url
    engine_for(url).dispose()
    drop_database(admin_url, name)


def test_two_fresh_databases_deliver_the_same_alert_twice(db_url: str, second_db: str, sandbox) -> None:
    """Same alert content from two databases whose serial ids coincide: the mail provider accepts both as new."""
    email = NotifierResource(email_to=OPS, mail_api_url=f"{os.environ['SANDBOX_URL']}/mail/v1").channels()
    message_ids = []
    for url in (db_url, second_db):
        engine = engine_for(url)
        clock = FrozenClock(START)
        Reliability(engine=engine, channels=email, clock=clock).fail_for_good(_final(clock))
        with engine.connect() as conn:
            row = conn.execute(sa.select(alert_deliveries.c.status, alert_deliveries.c.message_id,
                                         alerts.c.id).join(alerts)).one()
        assert row.status == "sent" and row.id == 1  # the same serial id in both databases
        message_ids.append(row.message_id)
    sent = sandbox.effects("mail.send")
    assert len(sent) == 2, "the second database's alert was taken for a resend of the first"
    assert message_ids[0] != message_ids[1]
    assert len({e["idempotency_token"] for e in sent}) == 2


def test_delivery_token_is_stable_per_group_and_never_a_serial_id() -> None:
    """One alert's token is its uid; a folded group's token is the same whatever the order of its uids."""
    a, b = "7d0e4a52-1111-4f0e-9d7e-000000000001", "7d0e4a52-1111-4f0e-9d7e-000000000002"
    assert delivery_token("email", [a]) == f"alerts:email:{a}"
    assert delivery_token("email", [a, b]) == delivery_token("email", [b, a])
    assert delivery_token("email", [a, b]) not in (delivery_token("email", [a]), delivery_token("slack", [a, b]))


def test_core_email_alerts_use_the_configured_mail_token(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mail provider that only takes its own token accepts the core's alert email when MAIL_API_TOKEN is set."""
    provider = SandboxProcess.start(extra_args=("--log-level", "warning", "--no-access-log",
                                                "--mail-token", "tok-not-the-default"))
    try:
        monkeypatch.setenv("MAIL_API_TOKEN", "tok-not-the-default")
        settings = Settings(mail_api_url=f"{provider.url}/mail/v1", alert_email_to=OPS)
        channels = {"email": notifier_from(settings).channels()["email"]}
        clock = FrozenClock(START)
        Reliability(engine=engine, channels=channels, clock=clock).fail_for_good(_final(clock))
        with engine.connect() as conn:
            row = conn.execute(sa.select(alert_deliveries.c.status, alert_deliveries.c.last_error)).one()
        assert row.status == "sent", row.last_error
        with provider.client() as client:
            assert client.count("mail.send") == 1
    finally:
        provider.stop()


def test_the_sandbox_refuses_a_wrong_mail_token(engine) -> None:
    """The check above can fail: the default token is refused by a provider configured with another one."""
    provider = SandboxProcess.start(extra_args=("--log-level", "warning", "--no-access-log",
                                                "--mail-token", "tok-not-the-default"))
    try:
        channels = NotifierResource(email_to=OPS, mail_api_url=f"{provider.url}/mail/v1").channels()
        clock = FrozenClock(START)
        Reliability(engine=engine, channels=channels, clock=clock).fail_for_good(_final(clock))
        with engine.connect() as conn:
            row = conn.execute(sa.select(alert_deliveries.c.status, alert_deliveries.c.last_error)).one()
        assert row.status == "pending" and "401" in row.last_error
    finally:
        provider.stop()
