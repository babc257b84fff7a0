"""Every counter means what its help says: a scripted scenario, scraped through the real endpoint, against the
events recorded in the database and the sandbox's log (issue 27 "Not true", issue 28 §3)."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from prometheus_client import start_http_server
from prometheus_client.parser import text_string_to_metric_families

from orchestration.metrics import build_registry
from redrive import observations
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@contextmanager
def metrics_endpoint(engine, clock) -> Iterator[str]:
    """`redrive metrics serve`'s HTTP server and registry (orchestration.metrics.serve, without its signal wait)."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=build_registry(engine, clock))
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        thread.join(timeout=5)


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_evidence_503_that_was_retried_is_a_retry_not_an_ok_attempt(engine, clock, runtime, seed_job, drain,
                                                                     sandbox) -> None:
    """A row pass whose case-API call answered 503 and was retried is a retry of that class, then ok, then done."""
    job, _, _ = seed_job("m503", rows=1, per_row=2)
    sandbox.script("case.attach", {"status": 503})  # the first artifact's first call
    assert drain(job).retried == 1
    clock.advance(3600)
    assert drain(job).done == 1
    with engine.connect() as conn:
        retry_events = conn.execute(sa.text(
            "SELECT count(*) FROM evidence_outbox WHERE event_type = 'EVIDENCE_ATTACH_RETRY'")).scalar_one()
    assert [r["status"] for r in sandbox.requests("case.attach")].count(503) == 1
    with metrics_endpoint(engine, clock) as url:
        samples = scrape(url)
    at = {"pipeline": "evidence", "stage": "attach"}
    assert value(samples, "redrive_retries_scheduled_total", error_class="503", **at) == retry_events == 1
    assert value(samples, "redrive_stage_attempts_total", outcome="retry", **at) == 1
    assert value(samples, "redrive_stage_attempts_total", outcome="ok", **at) == 1  # the second pass only
    assert value(samples, "redrive_items_done_total", pipeline="evidence") == 1


def test_alert_burst_is_one_message_and_a_rerun_failure_is_one_more_attempt(engine, clock, runtime,
                                                                            sandbox) -> None:
    """Four dead letters of one class: two Slack messages (one, then "×3"), counted 2; the same failure
    again in a rerun is one more failed attempt of the stage, not one more dead-lettered entity."""
    sandbox.clear_effects()

    def fail(entity: str, run_id: str) -> None:
        runtime.fail_for_good(FinalFailure(
            pipeline="matchmaking", stage="write", entity_ref=entity, attempts=3, at=clock.now(), run_id=run_id,
            failure=Failure.of(Code.UPSTREAM_UNAVAILABLE, message="profile store down")))

    for n in range(4):
        fail(f"2026-03-02|u{n}", f"run-{n}")
        clock.advance(10)
    clock.advance(300)  # the burst window ends: the three held alerts go out folded
    runtime.try_dispatch()
    fail("2026-03-02|u0", "rerun-of-run-0")  # a rerun of the first partition fails the same way
    runtime.try_dispatch()
    slack = [e for e in sandbox.effects("slack.message")]
    assert len(slack) == 2 and "×3" in slack[1]["payload"]["text"]
    with engine.connect() as conn:
        letters, occurrences = conn.execute(sa.text(
            "SELECT count(*), sum(occurrences) FROM dead_letters WHERE pipeline = 'matchmaking'")).one()
        deliveries = conn.execute(sa.text("SELECT count(*) FROM alert_deliveries WHERE status = 'sent' "
                                  "AND channel = 'slack'")).scalar_one()
    assert (letters, occurrences, deliveries) == (4, 5, 4)
    with metrics_endpoint(engine, clock) as url:
        samples = scrape(url)
    assert value(samples, "redrive_alerts_sent_total", pipeline="matchmaking", channel="slack") == len(slack)
    assert value(samples, "redrive_items_failed_total", pipeline="matchmaking",
                 error_class="UPSTREAM_UNAVAILABLE") == letters
    assert value(samples, "redrive_stage_attempts_total", pipeline="matchmaking", stage="write",
                 outcome="failed") == occurrences


def test_conversion_counters_match_its_events_whatever_path_wrote_them(engine, clock, submit, make_worker,
                                                                        sandbox) -> None:
    """Uploads, the worker's one statement per turn, a retry and a final failure: each event counted once."""
    for _ in range(3):
        submit()
    sandbox.script("pdf.convert", {"status": 502}, {"status": 400})
    make_worker().run(until_idle=0.0)
    with engine.connect() as conn:
        events = dict(conn.execute(sa.text(
            "SELECT event || ':' || COALESCE(meta->>'error_code', meta->>'reason', ''), count(*) "
            "FROM conversion_job_events GROUP BY 1")).all())
        timed = conn.execute(sa.text(
            "SELECT count(*) FROM conversion_job_events WHERE event = 'complete' AND meta ? 'duration_ms'"
        )).scalar_one()
    assert events["queued:upload"] == 3 and events["complete:"] == 1
    with metrics_endpoint(engine, clock) as url:
        samples = scrape(url)
    assert value(samples, "redrive_conversion_jobs_created_total") == events["queued:upload"]
    assert value(samples, "redrive_conversion_jobs_completed_total") == events["complete:"]
    assert value(samples, "redrive_conversion_retries_scheduled_total", code="GW_5XX") == events["retry:GW_5XX"]
    assert value(samples, "redrive_conversion_jobs_failed_total", code="GW_4XX") == events["failed:GW_4XX"]
    at = {"pipeline": "conversion", "stage": "convert"}
    assert value(samples, "redrive_stage_attempts_total", outcome="ok", **at) == events["complete:"]
    assert value(samples, "redrive_stage_attempts_total", outcome="retry", **at) == events["retry:GW_5XX"]
    assert value(samples, "redrive_stage_attempts_total", outcome="failed", **at) == events["failed:GW_4XX"]
    assert value(samples, "redrive_items_done_total", pipeline="conversion") == events["complete:"]
    assert value(samples, "redrive_stage_latency_seconds_count", **at) == events["complete:"] + events["retry:GW_5XX"]
    assert timed == 1


def test_the_sql_bucketing_is_the_code_s(engine) -> None:
    """`redrive_observe` (SQL, also used by triggers) puts each duration in the bucket `bucket_of` names."""
    probes = sorted({0.0, 1e-9, *observations.BUCKETS, *(b * 1.0001 for b in observations.BUCKETS), 1e6})
    with engine.begin() as conn:
        for n, seconds in enumerate(probes):
            observations.observe(conn, "probe", f"s{n}", observations.OK, seconds=seconds)
        rows = {o.stage: o.buckets for o in observations.read_all(conn) if o.pipeline == "probe"}
    for n, seconds in enumerate(probes):
        expected = [0] * (len(observations.BUCKETS) + 1)
        expected[observations.bucket_of(seconds)] = 1
        assert list(rows[f"s{n}"]) == expected, seconds
