"""003 §3.7 metrics for Prometheus, read from PostgreSQL at scrape time.

Workers run in many processes (Dagster runs, plain processes), so in-process counters would each
see a slice. The job events table and the breaker's tables are the one record every worker writes;
counting them at scrape time gives counters that agree across processes and survive restarts.
"""

from __future__ import annotations

from collections.abc import Iterator

import sqlalchemy as sa
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from assets.conversion import repository as repo
from assets.conversion.settings import BREAKER
from redrive import breaker
from redrive.clock import Clock


class ConversionCollector(Collector):
    def __init__(self, engine: sa.Engine, clock: Clock) -> None:
        self.engine, self.clock = engine, clock

    def collect(self) -> Iterator[Metric]:
        now = self.clock.now()
        with self.engine.connect() as conn:
            counts = repo.event_counts(conn)
            depth = repo.queue_depth(conn, now)
            state = breaker.get_state(conn, BREAKER)
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
        yield _gauge("redrive_circuit_breaker_open", "1 while the breaker holds the queue.", state.is_open)
        open_time = CounterMetricFamily("redrive_circuit_breaker_open_seconds", "Time spent open, in seconds.",
                                        labels=["breaker"])
        open_time.add_metric([BREAKER], state.open_seconds(now))
        yield open_time


def _gauge(name: str, doc: str, is_open: bool) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["breaker"])
    family.add_metric([BREAKER], 1.0 if is_open else 0.0)
    return family


def registry_for(engine: sa.Engine, clock: Clock) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ConversionCollector(engine, clock))
    return registry
