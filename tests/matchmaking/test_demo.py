"""The matchmaking demo, as `make demo` runs it, on the test stack — twice in a row."""

from __future__ import annotations

import sqlalchemy as sa


def test_demo_runs_twice_in_a_row(mm_defs, instance, scaled_settings, sandbox, engine) -> None:
    """Each demo run scripts its faults, checks its outcome (retries, dead letters, replay) and succeeds again."""
    from orchestration.demos.matchmaking import run_demo
    from orchestration.demo import DemoContext

    for session in ("s1", "s2"):
        ctx = DemoContext(mm_defs, instance, scaled_settings, sandbox, engine, session)
        report = run_demo(ctx)
        assert (report.done, report.retried, report.dead_lettered) == (400, 2, 2)
    with engine.connect() as conn:
        kinds = [k for (k,) in conn.execute(sa.text("SELECT kind FROM alerts WHERE pipeline = 'matchmaking'"))]
    assert kinds == ["dead_letter"] * 4  # one per dead letter; the burst window folds what Slack receives
    assert sandbox.count("slack.message") >= 1
