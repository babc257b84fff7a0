"""Conversion demo: uploads through the HTTP API, worker runs with sandbox faults, retries, dead letters,
a manual retry, and the circuit breaker opening under a gateway outage and closing on its own."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import sqlalchemy as sa
from starlette.testclient import TestClient

from assets.conversion import pipeline
from assets.conversion import repository as repo
from assets.conversion.api import BANNER, create_app
from assets.conversion.settings import BREAKER, PIPELINE, settings_of
from redrive import breaker as breakers
from redrive import logs
from redrive.schema import dead_letters


def _pdf(text: str) -> bytes:
    stream = f"BT /F1 12 Tf 72 712 Td ({text}) Tj ET".encode()
    return (b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n4 0 obj << /Length " + str(len(stream)).encode()
            + b" >> stream\n" + stream + b"\nendstream endobj\n%%EOF\n")


def run_demo(ctx):  # -> orchestration.demo.DemoReport
    worker_log = logging.getLogger("redrive.conversion.worker")
    level = worker_log.level
    if not os.environ.get(logs.FORMAT_ENV):  # the summary is the demo's output, unless log lines were asked for
        worker_log.setLevel(logging.CRITICAL)
    try:
        return _run(ctx)
    finally:
        worker_log.setLevel(level)


def _run(ctx):  # -> orchestration.demo.DemoReport
    from orchestration.demo import DemoReport

    report = DemoReport(PIPELINE)
    resource = ctx.defs.resources["conversion"]
    settings = settings_of(resource)
    runtime = ctx.defs.resources["reliability"].runtime()
    api = TestClient(create_app(ctx.engine, settings), raise_server_exceptions=False)
    # a worker run that ends soon after the queue is drained, with a short gateway timeout for the timeout fault
    quick = pipeline.worker_run_config(until_idle_sec=0.5, idle_sleep_sec=0.05, gateway_timeout_ms=500)
    owners = {who: f"{who}-{ctx.session}" for who in ("alice", "bob")}
    with ctx.engine.begin() as conn:
        tokens = {who: repo.create_token(conn, owner, "demo") for who, owner in owners.items()}

    def headers(who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {tokens[who]}"}

    def upload(name: str, body: bytes | None = None, who: str = "alice") -> Any:
        return api.post("/api/jobs", content=body if body is not None else _pdf(f"{name} {ctx.session}"),
                        headers={**headers(who), "X-Filename": name})

    def work() -> dict:
        result = ctx.run("conversion_worker_job", run_config=quick, tags=pipeline.TAGS)
        assert result.success, "conversion worker run failed"
        return result.output_for_node("convert_due_jobs")

    def status(job_id: str) -> repo.Job:
        with ctx.engine.connect() as conn:
            found = repo.get(conn, job_id)
        assert found is not None
        return found

    ensure_breaker_closed(ctx, runtime, resource)
    try:
        # 1. a clean conversion and a file the gateway rejects (400 → GW_4XX: no retry, dead letter + alert)
        refused = upload("photo.pdf", b"\x89PNG\r\n\x1a\n not a pdf")
        assert refused.status_code == 415 and refused.json()["error"] == "NOT_PDF", refused.text
        # one run each: a worker keeps several jobs in flight, so the sandbox's scripted order needs one at a time
        clean = upload("contract.pdf").json()["id"]
        ctx.sandbox.script("pdf.convert", {"kind": "ok"})
        work()
        rejected = upload("mapping.pdf").json()["id"]
        ctx.sandbox.script("pdf.convert", {"status": 400, "error_code": "INVALID_MAPPING"})
        work()
        assert status(clean).status == "succeeded"
        assert (status(rejected).status, status(rejected).error_code) == ("failed", "GW_4XX")
        report.notes.append(f"{clean[:8]}: converted; {rejected[:8]}: gateway 400 → GW_4XX, no retry, "
                            "dead letter + alert")

        # 2. 502, then a timeout, then success: retried at 5 s·2^k + jitter (× the demo's time scale)
        flaky = upload("flaky.pdf").json()["id"]
        ctx.sandbox.script("pdf.convert", {"status": 502}, {"kind": "timeout", "seconds": 1}, {"kind": "ok"})
        work()
        assert (status(flaky).status, status(flaky).attempt_count) == ("succeeded", 3)
        report.notes.append(f"{flaky[:8]}: 502 → GW_5XX, timeout → GW_TIMEOUT, retried twice, then converted")

        # 3. three 503s: RETRY_MAX_ATTEMPTS=3 spent → failed GW_5XX for good
        doomed = upload("doomed.pdf").json()["id"]
        ctx.sandbox.script("pdf.convert", {"status": 503}, {"status": 503}, {"status": 503})
        work()
        assert (status(doomed).status, status(doomed).error_code) == ("failed", "GW_5XX")
        report.notes.append(f"{doomed[:8]}: 503 × 3 → attempts spent → GW_5XX, dead letter + alert")

        # 4. the owner's Retry (003 §3.6) after the mapping was fixed; another user gets 404
        assert api.post(f"/api/jobs/{rejected}/retry", headers=headers("bob")).status_code == 404
        retried = api.post(f"/api/jobs/{rejected}/retry", headers=headers("alice"))
        assert retried.status_code == 200 and retried.json()["status"] == "queued", retried.text
        work()
        assert status(rejected).status == "succeeded"
        with ctx.engine.connect() as conn:
            letter = conn.execute(sa.select(dead_letters.c.status).where(
                dead_letters.c.pipeline == PIPELINE, dead_letters.c.entity_ref == rejected)).scalar()
        assert letter == "resolved"
        report.notes.append(f"{rejected[:8]}: owner's Retry → requeued → converted; dead letter resolved "
                            "(another user's retry: 404)")

        # 5. the gateway goes down: >= 50 % of the calls fail, the breaker opens and holds the queue
        batch = [upload(f"batch-{i}.pdf").json()["id"] for i in range(12)]
        ctx.sandbox.random_faults("pdf.convert", seed=7, rates={"503": 1.0})
        ctx.sandbox.random_faults("pdf.health", seed=7, rates={"503": 1.0})
        held = work()
        state = _state(ctx)
        assert state.is_open, "the breaker did not open"
        assert api.get("/api/status", headers=headers("alice")).json()["banner"] == BANNER
        with ctx.engine.connect() as conn:
            held_counts = repo.status_counts(conn, batch)
        assert held_counts == {"queued": 12}, held_counts
        report.notes.append(f"gateway outage (503 on every call): breaker opened at >= 50 % failures of its window "
                            f"({held['retried']} failed call(s) in this phase), alert sent; 12 jobs held `queued`, "
                            "banner shown")

        # … the sandbox recovers: the sensor's probe run closes the breaker, its worker runs drain the queue
        ctx.sandbox.stop_random_faults("pdf.convert")
        ctx.sandbox.stop_random_faults("pdf.health")
        probes = _tick_until_probe(ctx, runtime, resource)
        assert not _state(ctx).is_open, "the health probe did not close the breaker"
        for _ in range(5):
            work()
            with ctx.engine.connect() as conn:
                if repo.status_counts(conn, batch) == {"succeeded": 12}:
                    break
        with ctx.engine.connect() as conn:
            assert repo.status_counts(conn, batch) == {"succeeded": 12}
        report.notes.append(f"gateway back: {probes} probe run(s) closed the breaker; the 12 held jobs converted")
    finally:
        ctx.sandbox.stop_random_faults("pdf.convert")
        ctx.sandbox.stop_random_faults("pdf.health")

    ids = [clean, rejected, flaky, doomed, *batch]
    with ctx.engine.connect() as conn:
        report.done = repo.status_counts(conn, ids).get("succeeded", 0)
        report.retried = conn.execute(sa.select(sa.func.count()).select_from(repo.conversion_job_events).where(
            repo.conversion_job_events.c.job_id.in_(ids), repo.conversion_job_events.c.event == "retry")).scalar()
        report.dead_lettered = conn.execute(sa.select(sa.func.count()).select_from(dead_letters).where(
            dead_letters.c.pipeline == PIPELINE, dead_letters.c.entity_ref.in_(ids))).scalar()
    assert report.done == 15 and report.dead_lettered == 2
    return report


def _state(ctx) -> breakers.BreakerState:
    with ctx.engine.connect() as conn:
        return breakers.get_state(conn, BREAKER)


def _tick_until_probe(ctx, runtime, resource, attempts: int = 20) -> int:
    """Tick the worker sensor as the daemon would until its probe run has closed the breaker."""
    cooldown = settings_of(resource).breaker_policy(runtime.time_scale).cooldown
    probes = 0
    for _ in range(attempts):
        time.sleep(cooldown)  # the demo runs on the wall clock; the cooldown is scaled like every wait
        results = ctx.tick("conversion_workers")
        probes += sum(1 for r in results if r.dagster_run.job_name == "conversion_breaker_probe_job")
        if not _state(ctx).is_open:
            return probes
    return probes


def ensure_breaker_closed(ctx, runtime, resource) -> None:
    """A demo interrupted mid-outage may have left the breaker open: probe it closed before starting."""
    if _state(ctx).is_open:
        ctx.sandbox.stop_random_faults("pdf.convert")
        ctx.sandbox.stop_random_faults("pdf.health")
        _tick_until_probe(ctx, runtime, resource)
