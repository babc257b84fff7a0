"""Issue 13 item 1 through real sinks: card, IBAN, SSN, phone and name/value secrets reach neither the
dead letter in PostgreSQL nor the alert at the sandbox's Slack and mail providers."""

from __future__ import annotations

import os
import re
from datetime import UTC, datetime

import sqlalchemy as sa

from redrive.clock import FrozenClock
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from redrive.reliability import Reliability
from resources.notify import NotifierResource, SlackWebhookResource

START = datetime(2026, 3, 8, 6, 0, tzinfo=UTC)
CANARIES = {
    "card": "4111 1111 1111 1111",
    "card_dashed": "5555-5555-5555-4444",
    "iban": "DE89370400440532013000",
    "ssn": "078-05-1120",
    "phone": "4155550132",
    "api_key": "k3y-canary-0c7f",
}
TEXT = (f"charge of card {CANARIES['card']} (backup {CANARIES['card_dashed']}) to IBAN {CANARIES['iban']} failed "
        f"for SSN {CANARIES['ssn']}; call {CANARIES['phone']}")


def test_pii_never_reaches_the_dead_letter_or_the_alerts(engine, sandbox) -> None:
    """A final failure carrying every new PII shape: the stored row and both messages hold only keyed markers."""
    sandbox_url = os.environ["SANDBOX_URL"]
    channels = NotifierResource(slack=SlackWebhookResource(url=f"{sandbox_url}/slack/webhook/ops"), email_to="ops@example.com",
                                mail_api_url=f"{sandbox_url}/mail/v1").channels()
    clock = FrozenClock(START)
    failure = Failure.of(Code.BAD_REQUEST, message=f"payment refused: {TEXT}", detail=TEXT)
    Reliability(engine=engine, channels=channels, clock=clock).fail_for_good(FinalFailure(
        pipeline="evidence", stage="attach", entity_ref="art-pii", failure=failure, attempts=1, at=clock.now(),
        stack=f"Traceback ...\nValueError: {TEXT}\n",
        context={"headers": [{"name": "X-Api-Key", "value": CANARIES["api_key"]}],
                 "request": f'{{"headers": [{{"name": "X-Api-Key", "value": "{CANARIES["api_key"]}"}}]}}',
                 "customer": {"phone": CANARIES["phone"]}},
    ))

    with engine.connect() as conn:
        stored = conn.execute(sa.text("SELECT row_to_json(d)::text FROM dead_letters d")).scalar_one()
        alert = conn.execute(sa.text("SELECT row_to_json(a)::text FROM alerts a")).scalar_one()
    slack = [e["payload"]["text"] for e in sandbox.effects("slack.message")]
    mail = [e["subject"] for e in sandbox.effects("mail.send")]
    assert len(slack) == 1 and len(mail) == 1
    for where, text in {"dead letter": stored, "alert row": alert, "slack": slack[0]}.items():
        for kind, value in CANARIES.items():
            assert value not in text and value.replace(" ", "") not in text, f"{kind} reached the {where}"
        assert re.search(r"\[REDACTED:card:hmac=[0-9a-f]{12}\]", text), where
    assert re.search(r"\[REDACTED:(?:x_api_key|secret):hmac=[0-9a-f]{12}\]", stored)
