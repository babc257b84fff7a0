"""`make demo`'s criticizer part on the test stack: it scripts its faults, checks its outcome, and runs twice."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from orchestration.demos import criticizer as demo
from orchestration.demo import DemoContext
from redrive.db import engine_for

# the same against any PostgreSQL: `make test-ci` (CI's second pass, on DATABASE_URL) leaves it out
pytestmark = pytest.mark.first_pass


def test_demo_runs_twice_with_retries_dead_letters_and_alerts(defs, instance, scaled_settings, sandbox, db_url) -> None:
    """Two sessions in a row: each finishes 4 requests, retries, dead-letters 2, and alerts (its own checks pass)."""
    for session in ("s1", "s2"):
        ctx = DemoContext(defs, instance, scaled_settings, sandbox, engine_for(db_url), session)
        report = demo.run_demo(ctx)
        assert (report.pipeline, report.done, report.dead_lettered) == ("criticizer", 4, 2)
        assert report.retried >= 8  # 4 in flaky, 4 in exhausted
    with engine_for(db_url).connect() as conn:
        kinds = conn.execute(sa.text("SELECT kind, count(*) FROM alerts WHERE pipeline = 'criticizer' GROUP BY kind"))
        assert dict(kinds.all()) == {"dead_letter": 4, "escalation": 2}
    sent = [e["payload"]["text"] for e in sandbox.effects("slack.message") if e["path"] == "redrive-alerts"]
    assert any("dead-lettered" in t for t in sent) and any("escalated" in t for t in sent)  # later ones: burst-held
    faults = sandbox.faults()  # every fault it scripted (for its own requests) was met
    assert all(faults[r]["pending"] == [] and faults[r]["matched"] == {} for r in ("store", "llm", "slack"))
