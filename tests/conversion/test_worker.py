"""003 §5 integration tests: the worker against the sandbox's PDF gateway and real PostgreSQL, time frozen."""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest
import sqlalchemy as sa

from assets.conversion import repository as repo
from redrive import logs
from assets.conversion.worker import Shutdown, ShutdownNow
from redrive.backoff import ExponentialPlusJitter
from redrive.clock import FrozenClock
from redrive.schema import dead_letters
from tests.conversion.conftest import events, job


def test_gateway_400_is_gw_4xx_and_never_retried(engine, sandbox, submit, make_worker) -> None:
    """A 400 from the gateway fails the job for good as GW_4XX after one call: dead letter, mark and one alert."""
    job_id = submit()
    sandbox.script("pdf.convert", {"status": 400, "error_code": "INVALID_MAPPING"})
    worker = make_worker()
    assert worker.step() == "processed"

    done = job(engine, job_id)
    assert (done.status, done.error_code, done.attempt_count, done.dead_letter) == ("failed", "GW_4XX", 1, True)
    assert done.retry_after is None and done.leased_by is None
    assert "400" in (done.error_message or "") and "/" not in (done.error_message or "")
    assert len(sandbox.requests("pdf.convert")) == 1
    assert worker.step() == "idle"  # nothing requeued: no retry for GW_4XX
    with engine.connect() as conn:
        letters = conn.execute(sa.select(dead_letters)).all()
    assert [(d.pipeline, d.entity_ref, d.error_class, d.attempts) for d in letters] == [
        ("conversion", job_id, "GW_4XX", 1)]
    assert sandbox.count("slack.message") == 1
    assert events(engine, job_id) == ["queued", "processing", "failed"]


def test_502_and_timeout_are_retried_with_the_formula_spacing(engine, sandbox, submit, make_worker, clock,
                                                              reliability, conv_settings) -> None:
    """502 then a gateway timeout: each retry is queued at 5000 ms·2^k + random(0–5000 ms) and the third call succeeds."""
    job_id = submit()
    sandbox.script("pdf.convert", {"status": 502}, {"kind": "timeout", "seconds": 1}, {"kind": "ok"})
    # the sandbox holds the timed-out call 1 s; GATEWAY_TIMEOUT_MS=300 fires first
    worker = make_worker(settings=conv_settings.model_copy(update={"gateway_timeout_ms": 300}))

    for attempt, code in ((1, "GW_5XX"), (2, "GW_TIMEOUT")):
        started = clock.now()
        assert worker.step() == "processed"
        row = job(engine, job_id)
        assert (row.status, row.error_code, row.attempt_count) == ("queued", code, attempt)
        assert row.leased_by is None and row.lease_expires_at is None
        delay = (row.retry_after - started).total_seconds()
        rng = reliability.rng_for(f"conversion:{job_id}:convert:{attempt}")
        assert abs(delay - ExponentialPlusJitter().delay(attempt, rng)) < 1e-5  # the core's 003 policy, reproducible
        low = 5.0 * 2 ** (attempt - 1)
        assert low <= delay <= low + 5.0
        assert worker.step() == "idle"  # not due yet: the claim skips it
        clock.advance(delay)

    assert worker.step() == "processed"
    done = job(engine, job_id)
    assert (done.status, done.attempt_count, done.error_code) == ("succeeded", 3, None)
    assert [r["step"] for r in sandbox.requests("pdf.convert")] == ["status:502", "timeout", "ok"]
    assert events(engine, job_id) == ["queued", "processing", "retry", "processing", "retry", "processing", "complete"]


def test_retryable_failures_stop_after_three_attempts(engine, sandbox, submit, make_worker, clock) -> None:
    """Three 503s: the third attempt is the last (RETRY_MAX_ATTEMPTS=3), the job fails GW_5XX and is dead-lettered once."""
    job_id = submit()
    sandbox.script("pdf.convert", {"status": 503}, {"status": 503}, {"status": 503})
    worker = make_worker()
    for _ in range(3):
        assert worker.step() == "processed"
        clock.advance(60)
    done = job(engine, job_id)
    assert (done.status, done.error_code, done.attempt_count, done.dead_letter) == ("failed", "GW_5XX", 3, True)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar() == 1


def test_claim_skips_a_future_retry_after_and_takes_a_due_job(engine, submit, make_worker, clock) -> None:
    """An older job scheduled for later is skipped; the due one is claimed; once due, the older one is next."""
    older = submit()
    clock.advance(1)
    newer = submit()
    with engine.begin() as conn:
        conn.execute(sa.update(repo.conversion_jobs).where(repo.conversion_jobs.c.id == older)
                     .values(retry_after=clock.now() + timedelta(seconds=30)))
    worker = make_worker()
    first = worker.claim()
    assert first is not None and first.job_id == newer
    assert worker.claim() is None  # only the future one is left
    clock.advance(30)
    second = worker.claim()
    assert second is not None and second.job_id == older


def test_claims_oldest_first_and_each_claim_bumps_the_fencing_epoch(engine, submit, make_worker, clock) -> None:
    """Claims go by age; every claim of a job hands out a higher lease epoch than the one before."""
    a = submit()
    clock.advance(1)
    b = submit()
    worker = make_worker()
    lease_a = worker.claim()
    assert lease_a is not None and lease_a.job_id == a and lease_a.epoch == 1
    clock.advance(5)  # lease TTL 2 s: expired
    assert [r.job_id for r in worker.reclaim()] == [a]
    again = worker.claim()
    assert again is not None and again.job_id == a and again.epoch == 2  # the oldest again, with a new token
    assert worker.claim().job_id == b  # type: ignore[union-attr]


def test_source_deleted_before_conversion_fails_with_expired_without_calling_the_gateway(
        engine, sandbox, submit, make_worker, files) -> None:
    """A job whose PDF was removed fails EXPIRED at once: no gateway call, no retry, no breaker call."""
    job_id = submit()
    files.delete_source(job(engine, job_id).source_location)
    assert make_worker().step() == "processed"
    done = job(engine, job_id)
    assert (done.status, done.error_code, done.attempt_count) == ("failed", "EXPIRED", 1)
    assert sandbox.requests("pdf.convert") == []


def test_malformed_xml_from_the_gateway_is_gw_4xx(engine, sandbox, submit, make_worker) -> None:
    """A 200 whose body is not the expected XML document is the gateway's fault in 003's words: GW_4XX, no retry."""
    a, b = submit(), submit()
    sandbox.script("pdf.convert", {"kind": "malformed"}, {"kind": "schema_invalid"})
    worker = make_worker()
    worker.step(), worker.step()
    assert [(job(engine, j).status, job(engine, j).error_code) for j in (a, b)] == [("failed", "GW_4XX")] * 2


def test_jitter_is_spread_across_jobs(reliability) -> None:
    """Two jobs failing at the same moment draw different jitter (no thundering herd of retries)."""
    delays = {ExponentialPlusJitter().delay(1, reliability.rng_for(f"conversion:{i}:convert:1")) for i in range(20)}
    assert len(delays) == 20
    assert all(5.0 <= d <= 10.0 for d in delays)


def test_every_worker_action_is_one_json_line_with_the_fields_of_003(engine, sandbox, submit, make_worker, clock,
                                                                     caplog) -> None:
    """003 §3.7: event, job_id, status, attempt, duration_ms, gateway_status, error_code and breaker state."""
    import logging

    caplog.set_level(logging.INFO, logger="redrive.conversion.worker")
    job_id = submit()
    sandbox.script("pdf.convert", {"status": 502}, {"kind": "ok"})
    worker = make_worker()
    worker.step()
    clock.advance(60)
    worker.step()
    lines = [{"event": r.getMessage(), **logs.record_fields(r)} for r in caplog.records
             if r.name == "redrive.conversion.worker"]
    by_event = {line["event"]: line for line in lines}
    retry, done = by_event["job_retry_scheduled"], by_event["job_completed"]
    for line in (retry, done):
        assert {"event", "job_id", "status", "attempt", "duration_ms", "gateway_status", "breaker",
                "worker", "pipeline", "entity", "stage"} <= set(line)
        assert line["job_id"] == job_id and line["breaker"] == "closed"
    assert (retry["status"], retry["attempt"], retry["gateway_status"], retry["error_code"]) == ("queued", 1, 502,
                                                                                                "GW_5XX")
    assert (done["status"], done["attempt"], done["gateway_status"]) == ("succeeded", 2, 200)
    assert [line["event"] for line in lines].count("job_claimed") == 2


def test_a_worker_waits_out_a_database_outage_of_minutes_with_capped_backoff(
        engine, admin_url, db_url, submit, make_worker, clock, conv_settings, caplog, tmp_path) -> None:
    """Issue 13 item 13: the real worker against its database refusing connections for ~7 minutes (injected
    sleep, frozen clock): it never exits, every wait is capped, logs and health say `unreachable`, then it drains."""
    import json
    import logging

    from devstack.postgres import with_database

    caplog.set_level(logging.INFO, logger="redrive.conversion.worker")
    job_id = submit()
    name = sa.engine.make_url(db_url).database
    admin = sa.create_engine(with_database(admin_url, "postgres"), isolation_level="AUTOCOMMIT")

    def database(accepting: bool) -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {str(accepting).lower()}'))
            if not accepting:
                conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                     "WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": name})

    health_file = tmp_path / "worker-health.json"
    knobs = conv_settings.model_copy(update={"worker_db_backoff_max_sec": 20.0, "worker_health_file": health_file})
    waits: list[float] = []
    seen_health: list[dict] = []
    outage = 420.0  # seven minutes of frozen time

    def fake_sleep(seconds: float) -> bool:
        waits.append(seconds)
        clock.advance(seconds)
        if health_file.exists():
            seen_health.append(json.loads(health_file.read_text()))
        if sum(waits) >= outage and waits[-1] != 0.05:
            database(True)
        return False

    worker = make_worker(settings=knobs)
    worker.sleep = fake_sleep
    database(False)
    try:
        report = worker.run(until_idle=0.0)
    finally:
        database(True)
        admin.dispose()

    assert report.succeeded == 1 and job(engine, job_id).status == "succeeded"
    outage_waits = [w for w in waits if w != knobs.worker_idle_sleep_sec]
    assert sum(outage_waits) >= outage and len(outage_waits) > 8  # more errors than the old give-up count
    assert max(outage_waits) <= 20.0  # capped: WORKER_DB_BACKOFF_MAX_SEC
    lines = [{"event": r.getMessage(), **logs.record_fields(r)} for r in caplog.records
             if r.name == "redrive.conversion.worker"]
    down = [x for x in lines if x["event"] == "database_unavailable"]
    back = [x for x in lines if x["event"] == "database_recovered"]
    assert down and down[0]["consecutive"] == 1 and len(down) < len(outage_waits)  # said once a minute, not per try
    assert len(back) == 1 and back[0]["outage_sec"] >= outage
    assert any(h["status"] == "degraded" and h["database"] == "unreachable" for h in seen_health)
    assert json.loads(health_file.read_text())["status"] == "ok"


def test_shutdown_grace_is_a_deadline_on_the_clock_and_sigalrm_stays_the_process_s() -> None:
    """Installing the handler takes SIGTERM and SIGINT only; the grace runs out on the (injected) clock, not on an
    alarm, and a second request cuts it short."""
    clock = FrozenClock()
    previous = signal.getsignal(signal.SIGALRM)
    installed = Shutdown(5.0, clock).install()
    try:
        assert signal.getsignal(signal.SIGALRM) is previous
        assert signal.getsignal(signal.SIGTERM) == installed._on_signal
    finally:
        installed.uninstall()
    shutdown = Shutdown(5.0, clock)
    shutdown.check()  # nothing asked: nothing to cut
    assert shutdown.remaining() is None
    shutdown.request()
    assert shutdown.requested and shutdown.remaining() == 5.0
    clock.advance(4.9)
    shutdown.check()
    clock.advance(0.2)
    with pytest.raises(ShutdownNow):
        shutdown.check()
    twice = Shutdown(30.0, clock)
    twice.request()
    assert not twice.expired
    twice.request()
    assert twice.expired and twice.remaining() == 0.0


def test_over_the_gateways_retry_budget_a_retry_is_deferred_unsent_and_spends_no_attempt(
        engine, sandbox, submit, make_worker, clock, reliability) -> None:
    """Issue 26 §4 for the conversion worker: a job whose first attempt met a 503 comes due; the PDF gateway's
    retry budget is spent, so the retry is not sent: the job is `queued` again about a window later with its
    attempt given back, and the breaker's window is untouched. With room in the budget it converts."""
    from redrive import upstreams as up
    from redrive.breaker import window

    job_id = submit()
    sandbox.script("pdf.convert", {"status": 503}, {"kind": "ok"})
    worker = make_worker()
    assert worker.step() == "processed"
    first = job(engine, job_id)
    assert (first.status, first.attempt_count) == ("queued", 1)
    clock.advance((first.retry_after - clock.now()).total_seconds())

    no_room = up.Upstreams(engine, {"pdf_gateway": up.UpstreamLimits(retry_share=0.0, retry_floor_per_second=0.0,
                                                                    retry_window_seconds=10)},
                           clock=clock, sleep=clock.sleep, on_exhausted=reliability.retry_budget_exhausted)
    with engine.connect() as conn:
        calls = window(conn, "pdf-gateway", 0, 100)
    up.install(no_room)
    try:
        assert worker.step() == "processed"
    finally:
        up.install(None)
    held = job(engine, job_id)
    assert (held.status, held.attempt_count, held.leased_by) == ("queued", 1, None)  # the attempt given back
    assert 5 <= (held.retry_after - clock.now()).total_seconds() <= 15
    assert len(sandbox.requests("pdf.convert")) == 1  # nothing sent
    assert worker.report.deferred == 1
    with engine.connect() as conn:
        assert window(conn, "pdf-gateway", 0, 100) == calls == [False]  # the 503 only
    assert worker.step() == "idle"  # not due before its new time

    clock.advance((held.retry_after - clock.now()).total_seconds())
    assert worker.step() == "processed"
    done = job(engine, job_id)
    assert (done.status, done.attempt_count) == ("succeeded", 2)
    assert events(engine, job_id) == ["queued", "processing", "retry", "processing", "queued", "processing",
                                      "complete"]
