"""Every pipeline's series from PostgreSQL at scrape time: outcomes, latency histograms, dead letters, due work."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from redrive import breaker, metrics, observations, work
from redrive.clock import FrozenClock
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from redrive.reliability import Reliability
from resources.notify import NotifierResource, SlackWebhookResource

START = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)


def scrape(registry) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}, parsed the way Prometheus parses the page."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_observations_are_counted_across_writers_and_bucketed_cumulatively(engine) -> None:
    """Two writers' upserts add up in one row; the histogram's buckets are cumulative and +Inf is the count."""
    with engine.begin() as conn:
        for seconds in (0.003, 0.2, 0.2, 7.0, 500.0):
            observations.observe(conn, "criticizer", "fetch", observations.OK, seconds=seconds)
        observations.observe(conn, "criticizer", "fetch", observations.RETRY, error_class="RATE_LIMITED",
                             seconds=0.04)
        observations.observe(conn, "criticizer", "deliver", observations.DONE, count=3)
    with engine.begin() as conn:  # a second writer (another process) adds to the same rows
        observations.observe(conn, "criticizer", "deliver", observations.DONE)
    samples = scrape(metrics.registry(engine, FrozenClock(START), ["criticizer", "matching"]))
    buckets = {dict(k[1])["le"]: v for k, v in samples.items()
               if k[0] == "redrive_stage_latency_seconds_bucket" and ("stage", "fetch") in k[1]}
    assert (buckets["0.005"], buckets["0.05"], buckets["0.25"], buckets["10.0"], buckets["120.0"], buckets["+Inf"]) \
        == (1, 2, 4, 5, 5, 6)
    fetch = (("pipeline", "criticizer"), ("stage", "fetch"))
    assert samples[("redrive_stage_latency_seconds_count", fetch)] == 6
    assert abs(samples[("redrive_stage_latency_seconds_sum", fetch)] - 507.443) < 1e-6
    assert samples[("redrive_items_done_total", (("pipeline", "criticizer"),))] == 4
    assert samples[("redrive_items_done_total", (("pipeline", "matching"),))] == 0  # a quiet pipeline still has it
    assert samples[("redrive_retries_scheduled_total", (("error_class", "RATE_LIMITED"), *fetch))] == 1
    assert samples[("redrive_stage_attempts_total", (("outcome", "ok"), *fetch))] == 5


def test_many_timed_observations_in_one_upsert_count_as_each_one_alone(engine) -> None:
    """observe_many (a batch's outcomes in one statement) leaves the row that one observe per outcome leaves."""
    seconds = [0.003, 0.2, 0.2, 7.0, 500.0, -1.0]  # a negative duration is counted, not timed
    with engine.begin() as conn:
        for s in seconds:
            observations.observe(conn, "matching", "one", observations.OK, seconds=s)
        observations.observe_many(conn, "matching", "many", observations.OK, seconds[:2])
    with engine.begin() as conn:  # and onto an existing row
        observations.observe_many(conn, "matching", "many", observations.OK, seconds[2:])
        observations.observe_many(conn, "matching", "many", observations.OK, [])
    with engine.connect() as conn:
        rows = {o.stage: o for o in observations.read_all(conn) if o.pipeline == "matching"}
    one, many = rows["one"], rows["many"]
    assert (many.count, many.buckets) == (one.count, one.buckets) == (6, one.buckets)
    assert sum(one.buckets) == 5 and one.buckets[0] == 1 and one.buckets[-1] == 1
    assert abs(many.sum_seconds - one.sum_seconds) < 1e-9 and abs(one.sum_seconds - 507.403) < 1e-9


def test_final_failures_dead_letters_alerts_due_work_and_breakers(engine, sandbox) -> None:
    """A final failure is counted once by class (a repeat is an occurrence); open letters, alerts, due rows, breakers."""
    clock = FrozenClock(START)
    channels = NotifierResource(slack=SlackWebhookResource(url=f"{os.environ['SANDBOX_URL']}/slack/webhook/ops")
                                ).channels()
    rt = Reliability(engine=engine, channels=channels, clock=clock, burst_window=300)
    final = FinalFailure(pipeline="evidence", stage="attach", entity_ref="art-1", failure=Failure.of(Code.AUTH_DENIED),
                         attempts=3, at=clock.now())
    rt.fail_for_good(final)
    rt.fail_for_good(final)  # the same failure again (a re-executed op): one dead letter, counted once
    with engine.begin() as conn:
        work.enqueue(conn, "evidence", "art-2", now=START - timedelta(minutes=10))
        work.enqueue(conn, "evidence", "art-3", now=START + timedelta(minutes=10))  # not due yet
    gateway = breaker.CircuitBreaker(engine, "pdf-gateway", breaker.BreakerPolicy(), clock)
    for _ in range(10):
        gateway.record(ok=False)
    clock.advance(60)
    samples = scrape(metrics.registry(engine, clock, ["evidence", "conversion"], breakers=["other"]))
    evidence = (("pipeline", "evidence"),)
    assert samples[("redrive_items_failed_total", (("error_class", "AUTH_DENIED"), *evidence))] == 1
    assert samples[("redrive_dead_letters_open", (("error_class", "AUTH_DENIED"), *evidence))] == 1
    assert samples[("redrive_dead_letter_oldest_open_seconds", evidence)] == 60
    assert samples[("redrive_alerts_sent_total", (("channel", "slack"), *evidence))] == 1
    assert samples[("redrive_due_work", evidence)] == 1
    assert samples[("redrive_due_work_oldest_seconds", evidence)] == 11 * 60
    assert samples[("redrive_due_work", (("pipeline", "conversion"),))] == 0
    assert samples[("redrive_circuit_breaker_open", (("breaker", "pdf-gateway"),))] == 1
    assert samples[("redrive_circuit_breaker_open_seconds_total", (("breaker", "pdf-gateway"),))] == 60
    assert samples[("redrive_circuit_breaker_open", (("breaker", "other"),))] == 0  # known before its first call
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM stage_observations")).scalar() == 1


def test_every_series_the_endpoint_names_is_served(engine) -> None:
    """`metrics.SERIES` (what dashboards may query) is what the registry exposes, even on an empty database."""
    text = generate_latest(metrics.registry(engine, FrozenClock(START), ["rehearsal"])).decode()
    served = {s.name for f in text_string_to_metric_families(text) for s in f.samples} | {
        f"{f.name}{suffix}" for f in text_string_to_metric_families(text)
        for suffix in ({"counter": "_total", "histogram": "_bucket"}.get(f.type, ""),)}
    served |= {"redrive_stage_latency_seconds_sum", "redrive_stage_latency_seconds_count"} \
        if "redrive_stage_latency_seconds_bucket" in served else set()
    assert set(metrics.SERIES) <= served
