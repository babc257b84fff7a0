"""`make demo`'s part for review notifications runs on the test stack, checks itself, and can run twice."""

from __future__ import annotations

import pytest

from orchestration.demos import review_notifications as demo
from orchestration.demo import DemoContext

# the same against any PostgreSQL: `make test-ci` (CI's second pass, on DATABASE_URL) leaves it out
pytestmark = pytest.mark.first_pass


def test_demo_runs_twice_and_reports_what_happened(defs, instance, scaled_settings, sandbox, engine) -> None:
    """Faults are injected, retried, dead-lettered and alerted; a second run (new session) works as well."""
    for session in ("s1", "s2"):
        ctx = DemoContext(defs, instance, scaled_settings, sandbox, engine, session)
        report = demo.run_demo(ctx)
        assert (report.done, report.dead_lettered) == (3, 1)
        assert report.retried >= 3  # 503, 429 and the lost 500 at least
        assert any("ORDERING_CONTRACT_VIOLATED" in n for n in report.notes)
