"""`make demo`'s matching part on the test stack, in process: the queue sensor ticked by hand drains until settled."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from orchestration.demo import DemoContext
from orchestration.demos import matching as demo
from redrive.db import engine_for

# the same against any PostgreSQL: `make test-ci` (CI's second pass, on DATABASE_URL) leaves it out
pytestmark = pytest.mark.first_pass


def test_demo_settles_its_documents_with_retries_dead_letters_and_one_stuck_alert(
        instance, scaled_settings, sandbox, db_url, monkeypatch) -> None:
    """The drains the queue sensor starts ride out a 429 and a 503, fail a 401 at once and a document whose three
    deliveries all meet 503s (its message in the DLQ); a crashed worker's document is alerted once and re-queued;
    the 401's replay resolves it. Every LLM fault it scripted was met by its own tenant's prompts."""
    from orchestration.definitions import build_definitions

    for key, value in demo.DEPLOYMENT_ENV.items():  # the 1 s / 2 s visibility steps, as `make demo` configures them
        monkeypatch.setenv(key, value)
    defs = build_definitions(scaled_settings)
    engine = engine_for(db_url)

    report = demo.run_demo(DemoContext(defs, instance, scaled_settings, sandbox, engine, "t1"))

    assert (report.pipeline, report.done, report.retried, report.dead_lettered) == ("matching", 5, 10, 2)
    assert sandbox.faults()["llm"]["matched"] == {}
    with engine.connect() as conn:
        stuck = conn.execute(sa.text("SELECT count(*) FROM alerts WHERE pipeline = 'matching' "
                                     "AND kind = 'stuck_in_progress' AND entity_ref = 'demo-t1-inv-5005'")).scalar()
    assert stuck == 1
