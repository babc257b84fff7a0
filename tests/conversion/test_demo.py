"""`make demo`'s conversion part on the test stack: real faults, retries, dead letters, alerts, breaker — twice."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from orchestration.demos import conversion as demo
from orchestration.demo import DemoContext
from redrive.db import engine_for
from redrive.settings import Settings

# the same against any PostgreSQL: `make test-ci` (CI's second pass, on DATABASE_URL) leaves it out
pytestmark = pytest.mark.first_pass


def test_demo_runs_twice_with_retries_dead_letters_alerts_and_the_breaker(monkeypatch, conv_settings, instance,
                                                                           sandbox, db_url) -> None:
    """Two sessions in a row each convert 15 jobs, retry, dead-letter 2 and open then close the breaker once."""
    from orchestration.definitions import build_definitions

    monkeypatch.setenv("UPLOADS_DIR", str(conv_settings.uploads_dir))
    monkeypatch.setenv("RESULTS_DIR", str(conv_settings.results_dir))
    settings = Settings(database_url=db_url, redrive_time_scale=0.01, alert_burst_window_seconds=3)  # as `make demo`
    defs = build_definitions(settings)
    for session in ("s1", "s2"):
        ctx = DemoContext(defs, instance, settings, sandbox, engine_for(db_url), session)
        report = demo.run_demo(ctx)
        assert (report.pipeline, report.done, report.dead_lettered) == ("conversion", 15, 2)
        assert report.retried >= 5
    with engine_for(db_url).connect() as conn:
        kinds = dict(conn.execute(sa.text(
            "SELECT kind, count(*) FROM alerts WHERE pipeline = 'conversion' GROUP BY kind")).all())
        opened = conn.execute(sa.text("SELECT open_count, state FROM circuit_breakers")).one()
    assert kinds == {"dead_letter": 4, "breaker_open": 2}
    assert tuple(opened) == (2, "closed")
    assert sandbox.faults()["pdf.convert"]["pending"] == []
