"""003 §3.7 metrics for Prometheus, read from PostgreSQL at scrape time.

Workers run in many processes (Dagster runs, plain processes), so in-process counters would each
see a slice. Every job event counts itself as it is written: a trigger on the events table (migration
0620) adds each statement's events to the core's counters (`redrive.counters`, name
``conversion_job_events``) and its completions and retries, with their gateway durations, to the
core's stage observations, in the same transaction. A scrape reads those few rows, so it costs the
same however many events the table holds, and the pruner deleting old events lowers no counter.
The worker's hot path stays one statement per turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime

import sqlalchemy as sa
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from assets.conversion import repository as repo
from assets.conversion.settings import BREAKER
from redrive import breaker, counters
from redrive.clock import Clock
from redrive.metrics import BreakerCollector, PipelineSource


class ConversionCollector(Collector):
    def __init__(self, engine: sa.Engine, clock: Clock) -> None:
        self.engine, self.clock = engine, clock

    def collect(self) -> Iterator[Metric]:
        now = self.clock.now()
        with self.engine.connect() as conn:
            counts = event_counts(conn)
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

        yield CounterMetricFamily("redrive_conversion_jobs_created", "Conversion jobs uploaded (their `queued` "
                                  "event with reason upload).", value=counts.get(("queued", "upload"), 0))
        yield CounterMetricFamily("redrive_conversion_jobs_completed", "Conversion jobs that succeeded (`complete` "
                                  "events).", value=total("complete"))
        yield by_label("failed", "redrive_conversion_jobs_failed", "Jobs failed for good (`failed` events), by "
                       "canonical code.", "code")
        yield by_label("retry", "redrive_conversion_retries_scheduled", "Automatic retries scheduled (`retry` "
                       "events), by code.", "code")
        yield CounterMetricFamily("redrive_conversion_leases_reclaimed", "Expired leases requeued by the reclaim "
                                  "step (`expired` events).", value=total("expired"))
        yield by_label("fenced", "redrive_conversion_fenced_writes",
                       "Late writes of workers that had lost their lease, refused (`fenced` events).", "write")
        yield by_label("queued", "redrive_conversion_requeues", "Jobs put in the queue (`queued` events), by reason: "
                       "upload, manual retry, shutdown requeue.", "reason")
        queue = GaugeMetricFamily("redrive_conversion_queue_depth", "Jobs waiting (queued) or in progress "
                                  "(processing), now.", labels=["state"])
        for name, n in depth.items():
            queue.add_metric([name], n)
        yield queue
        latency = GaugeMetricFamily("redrive_conversion_gateway_latency_p95_seconds",
                                    "p95 of the last 1000 gateway call durations, in seconds.")
        latency.add_metric([], (p95 or 0.0) / 1000)
        yield latency


def event_counts(conn: sa.Connection) -> dict[tuple[str, str], int]:
    """Events by (event, error code or reason or refused write), as counted when they were written."""
    rows = counters.read(conn, [EVENTS_COUNTER]).get(EVENTS_COUNTER, {})
    out: dict[tuple[str, str], int] = {}
    for labels, n in rows.items():
        named = dict(labels)
        out[(named.get("event", ""), named.get("label", ""))] = int(n)
    return out


EVENTS_COUNTER = "conversion_job_events"  # written by the trigger of migration 0620


def due_work(conn: sa.Connection, now: datetime) -> tuple[int, datetime | None]:
    """Queued jobs whose time has come, and when the oldest of them became due."""
    return repo.due_and_oldest(conn, now)


SOURCE = PipelineSource(due_work=due_work)
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
