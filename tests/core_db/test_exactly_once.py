"""Two workers recording the same final failure at the same instant leave one dead letter and one alert."""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime

import sqlalchemy as sa

from redrive.clock import FrozenClock
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from redrive.reliability import Reliability
from resources.notify import NotifierResource, SlackWebhookResource


def test_concurrent_final_failures_make_one_letter(engine, sandbox) -> None:
    """Eight threads race on one entity: one row, occurrences 8, one Slack message."""
    clock = FrozenClock(datetime(2026, 5, 1, tzinfo=UTC))
    channels = NotifierResource(slack=SlackWebhookResource(url=f"{os.environ['SANDBOX_URL']}/slack/webhook/ops")).channels()
    rt = Reliability(engine=engine, channels=channels, clock=clock)
    barrier = threading.Barrier(8)
    created = []

    def worker() -> None:
        barrier.wait()
        recorded = rt.fail_for_good(FinalFailure(pipeline="conversion", stage="convert", entity_ref="job-1",
                                                 failure=Failure.of(Code.BAD_REQUEST), attempts=1, at=clock.now()))
        created.append(recorded.created)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT occurrences FROM dead_letters")).all()
    assert created.count(True) == 1
    assert rows == [(8,)]
    assert sandbox.count("slack.message") == 1


def test_final_failure_inside_callers_transaction_rolls_back_with_it(engine, sandbox) -> None:
    """With `conn=`, the dead letter and its alert commit or roll back with the entity's own write."""
    import pytest

    clock = FrozenClock(datetime(2026, 5, 1, tzinfo=UTC))
    channels = NotifierResource(slack=SlackWebhookResource(url=f"{os.environ['SANDBOX_URL']}/slack/webhook/ops")).channels()
    rt = Reliability(engine=engine, channels=channels, clock=clock)
    final = FinalFailure(pipeline="conversion", stage="convert", entity_ref="job-2",
                         failure=Failure.of(Code.BAD_REQUEST), attempts=1, at=clock.now())
    with pytest.raises(RuntimeError), engine.begin() as conn:
        rt.fail_for_good(final, conn=conn)
        raise RuntimeError("crash before the entity's failed-status write committed")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM dead_letters")).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM alerts")).scalar() == 0
    with engine.begin() as conn:
        rt.fail_for_good(final, conn=conn)
    assert sandbox.count("slack.message") == 0  # nothing is sent inside the caller's transaction
    rt.try_dispatch()
    assert sandbox.count("slack.message") == 1
