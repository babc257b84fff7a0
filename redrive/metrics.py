"""Prometheus metrics for every pipeline, read from PostgreSQL at scrape time.

Work runs in many processes (run workers, conversion workers), so in-process counters would each
see a slice. Counters are kept in PostgreSQL by increments, in the transaction of the event they
count (stage outcomes and latency buckets in :mod:`redrive.observations`, named counters such as
dead-lettered entities and alert messages in :mod:`redrive.counters`): a scrape reads one row per
series and shard, so it costs the same with ten million historical rows as with ten, and the
pruner deleting history lowers no counter. Gauges (open dead letters, due work, pending alerts)
count open rows only, through the partial indexes that cover them. Every pipeline named gets every
series, zero when it has nothing yet, so a dashboard panel never goes blank for a quiet pipeline.

A pipeline whose due work is not in the core's queue (conversion keeps its own jobs) gives a
:class:`PipelineSource` with its due work, merged into the same series.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from redrive import counters
from redrive import observations as obs
from redrive.breaker import circuit_breakers
from redrive.clock import Clock
from redrive.schema import alert_deliveries, alerts, dead_letters, deferred_attempts, pipeline_progress, work_items
from redrive.work import OPEN_STATUSES


@dataclass(frozen=True)
class PipelineSource:
    """What a pipeline keeps in its own tables: its due work and when the oldest of it fell due."""

    due_work: Callable[[sa.Connection, datetime], tuple[int, datetime | None]] | None = None


# The series this endpoint serves, by name as scraped (a test checks the Grafana dashboard against it).
SERIES = (
    "redrive_items_done_total", "redrive_items_failed_total", "redrive_retries_scheduled_total",
    "redrive_stage_attempts_total", "redrive_stage_latency_seconds_bucket", "redrive_stage_latency_seconds_sum",
    "redrive_stage_latency_seconds_count", "redrive_dead_letters_open", "redrive_dead_letter_oldest_open_seconds",
    "redrive_alerts_sent_total", "redrive_alerts_pending", "redrive_due_work", "redrive_due_work_oldest_seconds",
    "redrive_circuit_breaker_open", "redrive_circuit_breaker_open_seconds_total",
    "redrive_pipeline_seconds_without_progress", "redrive_pipeline_stalled",
    "redrive_upstream_slots_in_use", "redrive_upstream_slots_limit", "redrive_upstream_waiting",
    "redrive_upstream_paused_seconds", "redrive_upstream_pauses_total", "redrive_upstream_retries_denied_total",
    "redrive_upstream_retry_budget_exhausted_total",
)


class PipelineCollector(Collector):
    """Every pipeline's work: done, failed, retried, latency, dead letters, alerts, due work."""

    def __init__(self, engine: sa.Engine, clock: Clock, pipelines: Sequence[str],
                 sources: Mapping[str, PipelineSource] | None = None) -> None:
        self.engine, self.clock, self.pipelines, self.sources = engine, clock, tuple(pipelines), dict(sources or {})

    def collect(self) -> Iterator[Metric]:
        now = self.clock.now()
        with self.engine.connect() as conn:
            rows = obs.read_all(conn)
            counted = counters.read(conn, (counters.ITEMS_FAILED, counters.ALERTS_SENT))
            letters = open_dead_letters(conn)
            pending = conn.execute(  # the partial index of pending deliveries: sent ones are never read
                sa.select(alerts.c.pipeline, alert_deliveries.c.channel, sa.func.count())
                .select_from(alert_deliveries.join(alerts, alerts.c.id == alert_deliveries.c.alert_id))
                .where(alert_deliveries.c.status == "pending")
                .group_by(alerts.c.pipeline, alert_deliveries.c.channel)).all()
            due = due_work(conn, now, self.pipelines, self.sources)
            progress = conn.execute(sa.select(pipeline_progress.c.pipeline, pipeline_progress.c.progressed_at,
                                              pipeline_progress.c.due, pipeline_progress.c.stalled_since)).all()
        yield from self._outcomes(rows, counted.get(counters.ITEMS_FAILED, {}))
        yield from self._stalls(progress, now)
        yield from self._letters(letters, now)
        yield from self._alerts(counted.get(counters.ALERTS_SENT, {}), pending)
        waiting = GaugeMetricFamily("redrive_due_work", "Work due now and not yet done (work-queue rows, durable "
                                    "timers, a pipeline's own queued jobs).", labels=["pipeline"])
        age = GaugeMetricFamily("redrive_due_work_oldest_seconds", "How long the oldest due work has waited since "
                                "it fell due, in seconds (0 when none is due).", labels=["pipeline"])
        for pipeline, (n, oldest) in sorted(due.items()):
            waiting.add_metric([pipeline], n)
            age.add_metric([pipeline], max(0.0, (now - oldest).total_seconds()) if oldest else 0.0)
        yield waiting
        yield age

    def _outcomes(self, rows: Sequence[obs.Observation],
                  failed_by: Mapping[tuple[tuple[str, str], ...], float]) -> Iterator[Metric]:
        done = CounterMetricFamily("redrive_items_done", "Entities that finished all their stages, counted as each "
                                   "one settles done.", labels=["pipeline"])
        failed = CounterMetricFamily("redrive_items_failed", "Entities dead-lettered, by error class: a new dead "
                                     "letter, or a replay that failed again (a repeat of an open letter is not "
                                     "another entity).", labels=["pipeline", "error_class"])
        retries = CounterMetricFamily("redrive_retries_scheduled", "Failed attempts given another attempt later "
                                      "(the entity falls due again), by stage and error class.",
                                      labels=["pipeline", "stage", "error_class"])
        attempts = CounterMetricFamily("redrive_stage_attempts", "Stage attempts as they end: ok; retry (failed, "
                                       "tried again later); failed (failed for good: every such attempt, a rerun's "
                                       "too).", labels=["pipeline", "stage", "outcome"])
        latency = HistogramMetricFamily("redrive_stage_latency_seconds", "Duration of timed stage attempts, "
                                        "whatever their outcome, in seconds.", labels=["pipeline", "stage"])
        done_by: dict[str, int] = dict.fromkeys(self.pipelines, 0)
        retry_by: dict[tuple[str, str, str], int] = defaultdict(int)
        attempts_by: dict[tuple[str, str, str], int] = defaultdict(int)
        hist: dict[tuple[str, str], tuple[list[int], float]] = {}
        for r in rows:
            if r.outcome == obs.DONE:
                done_by[r.pipeline] = done_by.get(r.pipeline, 0) + r.count
                continue
            attempts_by[(r.pipeline, r.stage, r.outcome)] += r.count
            if r.outcome == obs.RETRY:
                retry_by[(r.pipeline, r.stage, r.error_class or "-")] += r.count
            buckets, total = hist.get((r.pipeline, r.stage), ([0] * (len(obs.BUCKETS) + 1), 0.0))
            hist[(r.pipeline, r.stage)] = ([a + b for a, b in zip(buckets, r.buckets, strict=False)],
                                           total + r.sum_seconds)
        for pipeline, n in sorted(done_by.items()):
            done.add_metric([pipeline], n)
        for labels, n in sorted(failed_by.items()):
            named = dict(labels)
            failed.add_metric([named.get("pipeline", "-"), named.get("error_class") or "-"], n)
        for labels, n in sorted(retry_by.items()):
            retries.add_metric(list(labels), n)
        for labels, n in sorted(attempts_by.items()):
            attempts.add_metric(list(labels), n)
        for (pipeline, stage), (buckets, total) in sorted(hist.items()):
            cumulative = obs.cumulative(buckets)
            bounds = [*(str(b) for b in obs.BUCKETS), "+Inf"]
            latency.add_metric([pipeline, stage], list(zip(bounds, cumulative, strict=True)), total)
        yield from (done, failed, retries, attempts, latency)

    def _stalls(self, progress: Sequence[sa.Row], now: datetime) -> Iterator[Metric]:
        """As the stall watch last saw each pipeline (redrive.stalls): how long due work has not moved."""
        quiet = GaugeMetricFamily("redrive_pipeline_seconds_without_progress",
                                  "Seconds since the pipeline last settled anything while work was due (0: nothing "
                                  "due).", labels=["pipeline"])
        stalled = GaugeMetricFamily("redrive_pipeline_stalled", "1 while the stall watch holds the pipeline stalled.",
                                    labels=["pipeline"])
        seen = {r.pipeline: r for r in progress}
        for pipeline in sorted(set(self.pipelines) | set(seen)):
            r = seen.get(pipeline)
            quiet.add_metric([pipeline], max(0.0, (now - r.progressed_at).total_seconds()) if r and r.due else 0.0)
            stalled.add_metric([pipeline], 1.0 if r and r.stalled_since is not None else 0.0)
        yield quiet
        yield stalled

    def _letters(self, letters: Sequence[sa.Row], now: datetime) -> Iterator[Metric]:
        open_ = GaugeMetricFamily("redrive_dead_letters_open", "Dead letters not resolved (open, replaying, "
                                  "escalated), by error class.", labels=["pipeline", "error_class"])
        oldest = GaugeMetricFamily("redrive_dead_letter_oldest_open_seconds", "Seconds since the first failure of "
                                   "the oldest unresolved dead letter (0 when none).", labels=["pipeline"])
        ages: dict[str, float] = dict.fromkeys(self.pipelines, 0.0)
        for pipeline, error_class, n, first in letters:
            open_.add_metric([pipeline, error_class], n)
            ages[pipeline] = max(ages.get(pipeline, 0.0), (now - first).total_seconds())
        for pipeline, age in sorted(ages.items()):
            oldest.add_metric([pipeline], age)
        yield open_
        yield oldest

    def _alerts(self, sent: Mapping[tuple[tuple[str, str], ...], float],
                pending_rows: Sequence[sa.Row]) -> Iterator[Metric]:
        delivered = CounterMetricFamily("redrive_alerts_sent", "Alert messages a channel accepted, by channel; a "
                                        "burst folded into one message (\"×3\") counts once.",
                                        labels=["pipeline", "channel"])
        pending = GaugeMetricFamily("redrive_alerts_pending", "Alert deliveries waiting to be sent (one per alert "
                                    "and channel; a burst may go out as one message).", labels=["pipeline", "channel"])
        for labels, n in sorted(sent.items()):
            named = dict(labels)
            delivered.add_metric([named.get("pipeline", "-"), named.get("channel", "-")], n)
        for pipeline, channel, n in pending_rows:
            pending.add_metric([pipeline, channel], n)
        yield delivered
        yield pending


def open_dead_letters(conn: sa.Connection) -> list[sa.Row]:
    """(pipeline, error class, count, oldest first failure) of the dead letters not resolved."""
    return conn.execute(
        sa.select(dead_letters.c.pipeline, dead_letters.c.error_class, sa.func.count(),
                  sa.func.min(dead_letters.c.first_failure_at))
        .where(dead_letters.c.status != "resolved")
        .group_by(dead_letters.c.pipeline, dead_letters.c.error_class)).all()


def due_work(conn: sa.Connection, now: datetime, pipelines: Sequence[str],
             sources: Mapping[str, PipelineSource]) -> dict[str, list]:
    """Per pipeline, [work due now, when the oldest of it fell due]: queue rows, durable timers, own queues."""
    due: dict[str, list] = {p: [0, None] for p in pipelines}
    for table, open_ in ((work_items, work_items.c.status.in_(OPEN_STATUSES)),
                         (deferred_attempts, deferred_attempts.c.status == "waiting")):
        for pipeline, n, oldest in conn.execute(
                sa.select(table.c.pipeline, sa.func.count(), sa.func.min(table.c.due_at))
                .where(open_, table.c.due_at <= now).group_by(table.c.pipeline)):
            _add_due(due, pipeline, n, oldest)
    for pipeline, source in sources.items():
        if source.due_work is not None:
            _add_due(due, pipeline, *source.due_work(conn, now))
    return due


def _add_due(due: dict[str, list], pipeline: str, n: int, oldest: datetime | None) -> None:
    entry = due.setdefault(pipeline, [0, None])
    entry[0] += n
    if oldest is not None and (entry[1] is None or oldest < entry[1]):
        entry[1] = oldest


class BreakerCollector(Collector):
    """Every circuit breaker's state and time spent open (003 §3.7)."""

    def __init__(self, engine: sa.Engine, clock: Clock, known: Sequence[str] = ()) -> None:
        self.engine, self.clock, self.known = engine, clock, tuple(known)  # known: reported even before first use

    def collect(self) -> Iterator[Metric]:
        from redrive.breaker import get_state

        now = self.clock.now()
        with self.engine.connect() as conn:
            names = set(conn.execute(sa.select(circuit_breakers.c.name)).scalars()) | set(self.known)
            states = [get_state(conn, name) for name in sorted(names)]
        is_open = GaugeMetricFamily("redrive_circuit_breaker_open", "1 while the breaker holds the queue, else 0.",
                                    labels=["breaker"])
        open_time = CounterMetricFamily("redrive_circuit_breaker_open_seconds", "Seconds the breaker has spent open, "
                                        "its current opening included.", labels=["breaker"])
        for state in states:
            is_open.add_metric([state.name], 1.0 if state.is_open else 0.0)
            open_time.add_metric([state.name], state.open_seconds(now))
        yield is_open
        yield open_time


class UpstreamCollector(Collector):
    """The limits every process shares per upstream (`redrive.upstreams`): slots in use, entities waiting,
    pauses a provider's Retry-After imposed, retries the budget held back."""

    def __init__(self, engine: sa.Engine, clock: Clock) -> None:
        self.engine, self.clock = engine, clock

    def collect(self) -> Iterator[Metric]:
        from redrive.upstreams import states

        with self.engine.connect() as conn:
            found = states(conn, self.clock.now())
        labels = ["upstream"]
        in_use = GaugeMetricFamily("redrive_upstream_slots_in_use", "Concurrency slots held (lease running).",
                                   labels=labels)
        limit = GaugeMetricFamily("redrive_upstream_slots_limit", "Concurrency slots configured.", labels=labels)
        waiting = GaugeMetricFamily("redrive_upstream_waiting", "Calls waiting for a slot, a rate grant or a pause.",
                                    labels=labels)
        paused = GaugeMetricFamily("redrive_upstream_paused_seconds", "Seconds left of a Retry-After pause.",
                                   labels=labels)
        pauses = CounterMetricFamily("redrive_upstream_pauses", "429 answers that paused the upstream.", labels=labels)
        denied = CounterMetricFamily("redrive_upstream_retries_denied", "Retries deferred by the retry budget.",
                                     labels=labels)
        episodes = CounterMetricFamily("redrive_upstream_retry_budget_exhausted",
                                       "Times the retry budget ran out (one alert each).", labels=labels)
        for state in found:
            in_use.add_metric([state.name], state.slots_in_use)
            limit.add_metric([state.name], state.max_concurrent or 0)
            waiting.add_metric([state.name], state.waiting)
            paused.add_metric([state.name], state.paused_seconds_left)
            pauses.add_metric([state.name], state.pauses)
            denied.add_metric([state.name], state.retries_denied)
            episodes.add_metric([state.name], state.budget_episodes)
        yield from (in_use, limit, waiting, paused, pauses, denied, episodes)


def registry(engine: sa.Engine, clock: Clock, pipelines: Sequence[str],
             sources: Mapping[str, PipelineSource] | None = None,
             extra: Sequence[Collector] = (), breakers: Sequence[str] = ()) -> CollectorRegistry:
    """One registry for the endpoint: every pipeline's series, the breakers, and pipelines' own collectors."""
    out = CollectorRegistry(auto_describe=False)
    out.register(PipelineCollector(engine, clock, pipelines, sources))
    out.register(BreakerCollector(engine, clock, breakers))
    out.register(UpstreamCollector(engine, clock))
    for collector in extra:
        out.register(collector)
    return out
