"""Review notifications' fixtures: a core runtime on a frozen clock, the mail provider (the sandbox), jobs."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from assets.review_notifications import api, policy, repository
from assets.review_notifications.delivery import Deliverer
from redrive.clock import FrozenClock
from redrive.reliability import Reliability
from redrive.settings import Settings
from resources.factory import notifier_from
from resources.review_notifications import MailProvider

RECIPIENTS = ("ana@example.com", "bo@example.com", "cy@example.com")


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock()


@pytest.fixture
def runtime(engine: sa.Engine, settings: Settings, clock: FrozenClock) -> Reliability:
    """The core as the op gets it: alerts to the sandbox's Slack webhook and mail, time frozen."""
    return Reliability(engine=engine, channels=notifier_from(settings).channels(), clock=clock, time_scale=1.0,
                       burst_window=0.0)


@pytest.fixture
def mail(stack) -> Iterator[MailProvider]:
    with MailProvider(f"{os.environ['SANDBOX_URL']}/mail/v1", "sandbox-token") as provider:
        yield provider


@pytest.fixture
def deliverer(engine: sa.Engine, mail: MailProvider, runtime: Reliability, clock: FrozenClock) -> Deliverer:
    """Sleeps on the frozen clock: backoff waits are recorded in `clock.sleeps`, never slept."""
    return Deliverer(engine, mail, runtime, sleep=clock.sleep)


def make_job(engine: sa.Engine, *, key: str = "req-1", changelist: str = "CL-1", version: int = 3,
             recipients: Sequence[str] = RECIPIENTS, summary: str = "Looks good") -> repository.Job:
    submission = api.submit(engine, {"idempotency_key": key, "changelist_id": changelist,
                                     "review_version": version, "recipients": list(recipients),
                                     "summary": summary})
    return submission.job


def notifications(sandbox: Any) -> list[dict[str, Any]]:
    """The sandbox's `mail.send` effects of review notifications (alert emails use other tokens)."""
    return [e for e in sandbox.effects("mail.send") if e["idempotency_token"].startswith(policy.TOKEN_PREFIX)]


def rows(engine: sa.Engine, job_id: int) -> list[repository.Delivery]:
    with engine.connect() as conn:
        return repository.deliveries_of(conn, job_id)


def tick(defs: Any, instance: Any, sensor_name: str) -> list[Any]:
    """One sensor tick as the daemon evaluates it (the shared helper: repository and dynamic partitions)."""
    from tests.dagster_helpers import tick as shared_tick

    return shared_tick(defs, instance, sensor_name)
