"""The matchmaking demo, as `make demo` runs it, on the test stack — twice in a row."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

# the same against any PostgreSQL: `make test-ci` (CI's second pass, on DATABASE_URL) leaves it out
pytestmark = pytest.mark.first_pass


def test_demo_runs_twice_in_a_row(mm_env, instance, scaled_settings, sandbox, engine, monkeypatch) -> None:
    """Each demo run scripts its faults, checks its outcome (retries, dead letters, replay) and succeeds again."""
    from orchestration.definitions import build_definitions
    from orchestration.demos.matchmaking import DEPLOYMENT_ENV, run_demo
    from orchestration.demo import DemoContext

    for key, value in DEPLOYMENT_ENV.items():  # the weights path, as `make demo` configures the code location
        monkeypatch.setenv(key, value)
    defs = build_definitions(scaled_settings)
    for session in ("s1", "s2"):
        ctx = DemoContext(defs, instance, scaled_settings, sandbox, engine, session)
        report = run_demo(ctx)
        assert (report.done, report.retried, report.dead_lettered) == (400, 2, 2)
    with engine.connect() as conn:
        kinds = [k for (k,) in conn.execute(sa.text("SELECT kind FROM alerts WHERE pipeline = 'matchmaking'"))]
    assert kinds == ["dead_letter"] * 4  # one per dead letter; the burst window folds what Slack receives
    assert sandbox.count("slack.message") >= 1
