"""§6 alerts through the monitor on real tables: retry queue depth sustained, N2 latency, scheduler heartbeat."""

from __future__ import annotations

import uuid
from datetime import timedelta

import sqlalchemy as sa

from assets.evidence import policy, service
from assets.evidence import repository as repo
from bench.evidence import populate

THRESHOLDS = policy.Thresholds(permanent_rate=0.10, permanent_min_sample=20, queue_depth=500,
                               queue_depth_sustain_seconds=600, n2_avg_latency_seconds=6 * 3600,
                               heartbeat_seconds=900)


def kinds(sandbox) -> list[str]:
    return [m["payload"]["text"].split("\n")[0] for m in sandbox.effects("slack.message")]


def test_deep_retry_queue_alerts_after_ten_minutes_once(runtime, clock, engine, sandbox) -> None:
    """601 artifacts waiting for a retry: no alert at first sight, one after 10 minutes, none after that."""
    with engine.begin() as conn:
        populate(conn, tag="q", artifacts=601, due=601, per_row=10, now=clock.now())
    first = service.monitor(runtime, thresholds=THRESHOLDS, window=timedelta(hours=1))
    assert first.metrics["evidence.retry.queue.depth.artifacts"] == 601
    assert "retry_queue_depth" not in [a.kind for a in first.alerts]
    clock.advance(600)
    assert "retry_queue_depth" in [a.kind for a in service.monitor(runtime, thresholds=THRESHOLDS,
                                                                    window=timedelta(hours=1)).alerts]
    clock.advance(600)
    assert "retry_queue_depth" not in [a.kind for a in service.monitor(runtime, thresholds=THRESHOLDS,
                                                                        window=timedelta(hours=1)).alerts]
    assert sum("retry queue depth" in k for k in kinds(sandbox)) == 1


def test_slow_n2_and_a_silent_scheduler_alert(runtime, clock, engine, sandbox) -> None:
    """N1→N2 over 6 h on average in the last day alerts; so does a scheduler whose last tick is 16 min old."""
    now = clock.now()
    with engine.begin() as conn:
        for hours in (5, 9):
            conn.execute(sa.insert(repo.file_job).values(
                id=uuid.uuid4(), source_bucket="b", source_key=f"k{hours}", source_etag="e", notify_to="m@example.com",
                status="INGESTED", n1_sent_at=now - timedelta(hours=hours + 1), n2_sent_at=now - timedelta(hours=1)))
        conn.execute(sa.insert(repo.file_job).values(id=uuid.uuid4(), source_bucket="b", source_key="open",
                                                     source_etag="e", notify_to="m@example.com", status="INGESTED"))
        repo.record_tick(conn, started_at=now - timedelta(minutes=16), duration_ms=3.0, rows=0, artifacts=0,
                         n2_forced=0, batch_limit=200)
    report = service.monitor(runtime, thresholds=THRESHOLDS, window=timedelta(hours=1))
    assert report.metrics["evidence.n2.latency.seconds.avg"] == 7 * 3600
    assert report.metrics["scheduler.heartbeat.age.seconds"] == 16 * 60
    assert {"n2_latency", "scheduler_heartbeat"} <= {a.kind for a in report.alerts}
    with engine.connect() as conn:
        stored = conn.execute(sa.select(repo.evidence_metrics.c.metrics)).scalar_one()
    assert stored["evidence.file_jobs.active"] == 1 and stored["evidence.n2.sent_last_day"] == 2
