"""003 §3.7 metrics for Prometheus, read from PostgreSQL at scrape time.

Workers run in many processes (Dagster runs, plain processes), so in-process counters would each
see a slice. The job events table and the breaker's tables are the one record every worker writes;
counting them at scrape time gives counters that agree across processes and survive restarts.

The same events feed the core's per-pipeline series (`redrive.metrics`) through :data:`SOURCE`:
the worker's hot path writes its events in one statement per turn and adds no row of its own
for metrics; completions, retries and their gateway durations are bucketed here, at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import sqlalchemy as sa
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from assets.conversion import repository as repo
from assets.conversion.settings import BREAKER, PIPELINE
from assets.conversion.worker import STAGE
from redrive import breaker, observations
from redrive.clock import Clock
from redrive.metrics import BreakerCollector, PipelineSource


class ConversionCollector(Collector):
    def __init__(self, engine: sa.Engine, clock: Clock) -> None:
        self.engine, self.clock = engine, clock

    def collect(self) -> Iterator[Metric]:
        now = self.clock.now()
        with self.engine.connect() as conn:
            counts = repo.event_counts(conn)
            depth = repo.queue_depth(conn, now)
            p95 = breaker.latency_quantile(conn, BREAKER, 0.95)

        def total(event: str) -> int:
            return sum(n for (e, _), n in counts.items() if e == event)

        def by_label(event: str, name: str, doc: str, label: str) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=[label])
            for (e, value), n in sorted(counts.items()):
                if e == event:
                    family.add_metric([value or "-"], n)
            return family

        yield CounterMetricFamily("redrive_conversion_jobs_created", "Conversion jobs uploaded.",
                                  value=counts.get(("queued", "upload"), 0))
        yield CounterMetricFamily("redrive_conversion_jobs_completed", "Conversion jobs that succeeded.",
                                  value=total("complete"))
        yield by_label("failed", "redrive_conversion_jobs_failed", "Jobs failed for good, by canonical code.", "code")
        yield by_label("retry", "redrive_conversion_retries_scheduled", "Automatic retries scheduled, by code.", "code")
        yield CounterMetricFamily("redrive_conversion_leases_reclaimed", "Expired leases requeued by the reclaim step.",
                                  value=total("expired"))
        yield by_label("fenced", "redrive_conversion_fenced_writes",
                       "Late writes of workers that had lost their lease, refused.", "write")
        yield by_label("queued", "redrive_conversion_requeues", "Jobs put back in the queue, by reason.", "reason")
        queue = GaugeMetricFamily("redrive_conversion_queue_depth", "Jobs waiting or in progress.", labels=["state"])
        for name, n in depth.items():
            queue.add_metric([name], n)
        yield queue
        latency = GaugeMetricFamily("redrive_conversion_gateway_latency_p95_seconds",
                                    "p95 of the last 1000 gateway call durations.")
        latency.add_metric([], (p95 or 0.0) / 1000)
        yield latency


def observed(conn: sa.Connection) -> list[observations.Observation]:
    """Completions (ok, done) and scheduled retries from the job events, their durations bucketed here."""
    rows = repo.timed_event_buckets(conn, observations.BUCKETS)
    merged: dict[tuple[str, str], tuple[list[int], float, int]] = {}
    for event, code, bucket, n, total in rows:
        outcome = observations.OK if event == "complete" else observations.RETRY
        buckets, seconds, count = merged.get((outcome, code), ([0] * (len(observations.BUCKETS) + 1), 0.0, 0))
        if bucket is not None:  # width_bucket: bucket i holds bounds[i-1] <= d < bounds[i]; None when untimed
            buckets[min(bucket, len(observations.BUCKETS))] += n
        merged[(outcome, code)] = (buckets, seconds + total, count + n)
    out = [observations.Observation(PIPELINE, STAGE, outcome, code, count, tuple(buckets), seconds)
           for (outcome, code), (buckets, seconds, count) in sorted(merged.items())]
    done = sum(o.count for o in out if o.outcome == observations.OK)
    if done:
        out.append(observations.Observation(PIPELINE, STAGE, observations.DONE, "", done,
                                            (0,) * (len(observations.BUCKETS) + 1), 0.0))
    return out


def due_work(conn: sa.Connection, now: datetime) -> tuple[int, datetime | None]:
    """Queued jobs whose time has come, and when the oldest of them became due."""
    return repo.due_and_oldest(conn, now)


SOURCE = PipelineSource(observations=observed, due_work=due_work)
BREAKERS = (BREAKER,)  # reported closed before its first call


def collectors(engine: sa.Engine, clock: Clock) -> list[Collector]:
    """What the one metrics endpoint adds for conversion (003 §3.7's own series)."""
    return [ConversionCollector(engine, clock)]


def registry_for(engine: sa.Engine, clock: Clock) -> CollectorRegistry:
    """The conversion API's /metrics: 003 §3.7's series and its breaker's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ConversionCollector(engine, clock))
    registry.register(BreakerCollector(engine, clock, known=[BREAKER]))
    return registry
