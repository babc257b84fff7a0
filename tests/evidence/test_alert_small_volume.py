"""Issue 13 item 12: 004 §6's "> 10 % permanent failures in 1 h" alert on small volumes, with the settings'
defaults, through the monitor on PostgreSQL and the core's alerts (the sandbox's Slack)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import sqlalchemy as sa

from assets.evidence import repository as repo
from assets.evidence import service
from assets.evidence.settings import EvidenceOptions, EvidenceSettings


def finish(engine, clock, job_id, *, permanent: int, attached: int) -> None:
    """Mark the job's artifacts finished now: `permanent` PERMANENT_FAILED (CORRUPTED_FILE), `attached` ATTACHED."""
    a = repo.file_job_artifact
    with engine.begin() as conn:
        ids = conn.execute(sa.select(a.c.id).where(a.c.file_job_id == job_id).order_by(a.c.id)).scalars().all()
        assert len(ids) >= permanent + attached
        conn.execute(sa.update(a).where(a.c.id.in_(ids[:permanent])).values(
            attachment_status="FAILED", retry_status="PERMANENT_FAILED", attachment_error_code="CORRUPTED_FILE",
            attempt_count=1, updated_at=clock.now()))
        conn.execute(sa.update(a).where(a.c.id.in_(ids[permanent:permanent + attached])).values(
            attachment_status="ATTACHED", attached_at=clock.now(), attempt_count=1, updated_at=clock.now()))


def rate_alerts(sandbox) -> list[str]:
    return [m["payload"]["text"] for m in sandbox.effects("slack.message") if "failed for good" in m["payload"]["text"]]


def test_the_minimum_sample_is_a_small_documented_default() -> None:
    """EVIDENCE_ALERT_PERMANENT_MIN_SAMPLE defaults to 5 and says why in its description."""
    field = EvidenceSettings.model_fields["alert_permanent_min_sample"]
    assert field.default == 5 and "3 of 5" in (field.description or "")
    assert EvidenceOptions(bucket="b").alert_permanent_min_sample == 5


@pytest.mark.parametrize("permanent, attached, fires", [(3, 2, True), (1, 4, True), (0, 5, False), (3, 1, False)],
                         ids=["3-of-5", "1-of-5", "0-of-5", "3-of-4-below-sample"])
def test_permanent_failure_rate_alerts_on_a_small_file_job(seed_job, runtime, clock, engine, sandbox, permanent,
                                                           attached, fires) -> None:
    """With the default settings, 3 (or 1) of 5 evidence files failing for good in the hour alerts once, through
    Slack; none failing does not; fewer finished than the minimum sample does not."""
    job_id, _, _ = seed_job("small", rows=1, per_row=5)
    finish(engine, clock, job_id, permanent=permanent, attached=attached)
    thresholds = EvidenceOptions(bucket="b").alert_thresholds()
    report = service.monitor(runtime, thresholds=thresholds, window=timedelta(hours=1))
    assert report.metrics["evidence.attach.finished"] == permanent + attached
    assert ("permanent_failure_rate" in [a.kind for a in report.alerts]) is fires
    assert len(rate_alerts(sandbox)) == int(fires)
    if fires:
        assert f"{permanent / (permanent + attached):.0%} of {permanent + attached}" in rate_alerts(sandbox)[0]
        clock.advance(300)  # the next monitor tick in the same episode does not alert again
        service.monitor(runtime, thresholds=thresholds, window=timedelta(hours=1))
        assert len(rate_alerts(sandbox)) == 1
