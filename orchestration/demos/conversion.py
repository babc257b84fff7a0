"""Conversion demo: uploads through the HTTP API, worker runs with sandbox faults, retries, dead letters,
a manual retry, and the circuit breaker opening under a gateway outage and closing on its own.

Under the deployed topology the uploads go to the conversion API process over HTTP and the conversion worker
processes (and the worker runs the daemon's sensor starts) convert them on their own: the demo waits for the
outcomes in the database. In process it serves the API app itself and converts with one worker run per step.
Either way each fault is scripted for its own file (its text is in the body the gateway receives).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
import sqlalchemy as sa

from assets.conversion import pipeline
from assets.conversion import repository as repo
from assets.conversion.api import BANNER, create_app
from assets.conversion.settings import BREAKER, PIPELINE, settings_of
from redrive import breaker as breakers
from redrive import logs
from redrive.schema import dead_letters

THROUGH_DAEMON = True  # under the topology: the conversion API and worker processes, outcomes from the database
# The deployed processes' knobs for the demo's pace: a gateway timeout the scripted 3 s hold exceeds, and
# workers that look for due jobs every 0.2 s.
DEPLOYMENT_ENV = {"GATEWAY_TIMEOUT_MS": "2000", "WORKER_IDLE_SLEEP_SEC": "0.2"}
HOLD = {"kind": "timeout", "seconds": 3}  # longer than GATEWAY_TIMEOUT_MS: GW_TIMEOUT
SETTLE_SECONDS = 300
FINAL = frozenset({"succeeded", "failed"})


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
    deployed = ctx.service_url("conversion-api")
    if deployed:
        api: Any = httpx.Client(base_url=deployed, timeout=30)
    else:  # the app served in this process (imported only then: starlette warns about its httpx use)
        from starlette.testclient import TestClient

        api = TestClient(create_app(ctx.engine, settings), raise_server_exceptions=False)
    # in process: a worker run that ends soon after the queue is drained, with the deployment's gateway timeout
    quick = pipeline.worker_run_config(until_idle_sec=0.5, idle_sleep_sec=0.05,
                                       gateway_timeout_ms=int(DEPLOYMENT_ENV["GATEWAY_TIMEOUT_MS"]))
    owners = {who: f"{who}-{ctx.session}" for who in ("alice", "bob")}
    with ctx.engine.begin() as conn:
        tokens = {who: repo.create_token(conn, owner, "demo") for who, owner in owners.items()}

    def headers(who: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {tokens[who]}"}

    def text(name: str) -> str:
        return f"{name} {ctx.session}"  # in the PDF, so in the body the gateway receives

    def script(name: str, *steps: dict[str, Any]) -> None:
        ctx.sandbox.script("pdf.convert", *steps, match=f"({text(name)})")

    def upload(name: str, body: bytes | None = None, who: str = "alice") -> Any:
        return api.post("/api/jobs", content=body if body is not None else _pdf(text(name)),
                        headers={**headers(who), "X-Filename": name})

    def counts(ids: list[str]) -> dict[str, int]:
        with ctx.engine.connect() as conn:
            return repo.status_counts(conn, ids)

    def settle(ids: list[str], settled: Callable[[], bool] | None = None) -> None:
        """Until these jobs are final (or `settled`): deployed, the worker processes work on their own; in
        process, one worker run."""
        settled = settled or (lambda: set(counts(ids)) <= FINAL)
        if not deployed:
            assert ctx.run("conversion_worker_job", run_config=quick, tags=pipeline.TAGS).success, \
                "conversion worker run failed"
            return
        _wait(settled, f"conversion jobs {[i[:8] for i in ids]}")

    def status(job_id: str) -> repo.Job:
        with ctx.engine.connect() as conn:
            found = repo.get(conn, job_id)
        assert found is not None
        return found

    ensure_breaker_closed(ctx, runtime, resource, deployed=bool(deployed))
    try:
        # 1. a clean conversion and a file the gateway rejects (400 → GW_4XX: no retry, dead letter + alert)
        refused = upload("photo.pdf", b"\x89PNG\r\n\x1a\n not a pdf")
        assert refused.status_code == 415 and refused.json()["error"] == "NOT_PDF", refused.text
        script("mapping.pdf", {"status": 400, "error_code": "INVALID_MAPPING"})
        clean, rejected = upload("contract.pdf").json()["id"], upload("mapping.pdf").json()["id"]
        settle([clean, rejected])
        assert status(clean).status == "succeeded"
        assert (status(rejected).status, status(rejected).error_code) == ("failed", "GW_4XX")
        report.notes.append(f"{clean[:8]}: converted; {rejected[:8]}: gateway 400 → GW_4XX, no retry, "
                            "dead letter + alert")

        # 2. 502, then a timeout, then success: retried at 5 s·2^k + jitter (× the demo's time scale)
        script("flaky.pdf", {"status": 502}, HOLD, {"kind": "ok"})
        # 3. three 503s: RETRY_MAX_ATTEMPTS=3 spent → failed GW_5XX for good
        script("doomed.pdf", {"status": 503}, {"status": 503}, {"status": 503})
        flaky, doomed = upload("flaky.pdf").json()["id"], upload("doomed.pdf").json()["id"]
        settle([flaky, doomed])
        assert (status(flaky).status, status(flaky).attempt_count) == ("succeeded", 3)
        report.notes.append(f"{flaky[:8]}: 502 → GW_5XX, timeout → GW_TIMEOUT, retried twice, then converted")
        assert (status(doomed).status, status(doomed).error_code) == ("failed", "GW_5XX")
        report.notes.append(f"{doomed[:8]}: 503 × 3 → attempts spent → GW_5XX, dead letter + alert")

        # 4. the owner's Retry (003 §3.6) after the mapping was fixed; another user gets 404
        assert api.post(f"/api/jobs/{rejected}/retry", headers=headers("bob")).status_code == 404
        retried = api.post(f"/api/jobs/{rejected}/retry", headers=headers("alice"))
        assert retried.status_code == 200 and retried.json()["status"] == "queued", retried.text
        settle([rejected])
        assert status(rejected).status == "succeeded"
        with ctx.engine.connect() as conn:
            letter = conn.execute(sa.select(dead_letters.c.status).where(
                dead_letters.c.pipeline == PIPELINE, dead_letters.c.entity_ref == rejected)).scalar()
        assert letter == "resolved"
        report.notes.append(f"{rejected[:8]}: owner's Retry → requeued → converted; dead letter resolved "
                            "(another user's retry: 404)")

        # 5. the gateway goes down: >= 50 % of the calls fail, the breaker opens and holds the queue
        ctx.sandbox.random_faults("pdf.convert", seed=7, rates={"503": 1.0})
        ctx.sandbox.random_faults("pdf.health", seed=7, rates={"503": 1.0})
        batch = [upload(f"batch-{i}.pdf").json()["id"] for i in range(12)]
        settle(batch, lambda: _state(ctx).is_open and counts(batch) == {"queued": 12})
        assert _state(ctx).is_open, "the breaker did not open"
        assert api.get("/api/status", headers=headers("alice")).json()["banner"] == BANNER
        held_counts = counts(batch)
        assert held_counts == {"queued": 12}, held_counts
        failed_calls = _retries(ctx, batch)
        report.notes.append(f"gateway outage (503 on every call): breaker opened at >= 50 % failures of its window "
                            f"({failed_calls} failed call(s) in this phase), alert sent; 12 jobs held `queued`, "
                            "banner shown")

        # … the sandbox recovers: a health probe closes the breaker (the worker's own, or the sensor's probe run
        # in process), and the workers drain the queue
        ctx.sandbox.stop_random_faults("pdf.convert")
        ctx.sandbox.stop_random_faults("pdf.health")
        if deployed:
            _wait(lambda: not _state(ctx).is_open, "the breaker to close")
            closer = "the worker's health probe closed the breaker"
        else:
            closer = f"{_tick_until_probe(ctx, runtime, resource)} probe run(s) closed the breaker"
        assert not _state(ctx).is_open, "the health probe did not close the breaker"
        for _ in range(1 if deployed else 5):
            settle(batch, lambda: counts(batch) == {"succeeded": 12})
            if counts(batch) == {"succeeded": 12}:
                break
        assert counts(batch) == {"succeeded": 12}, counts(batch)
        report.notes.append(f"gateway back: {closer}; the 12 held jobs converted")
    finally:
        ctx.sandbox.stop_random_faults("pdf.convert")
        ctx.sandbox.stop_random_faults("pdf.health")
        api.close()

    ids = [clean, rejected, flaky, doomed, *batch]
    with ctx.engine.connect() as conn:
        report.done = repo.status_counts(conn, ids).get("succeeded", 0)
        report.dead_lettered = conn.execute(sa.select(sa.func.count()).select_from(dead_letters).where(
            dead_letters.c.pipeline == PIPELINE, dead_letters.c.entity_ref.in_(ids))).scalar()
    report.retried = _retries(ctx, ids)
    assert report.done == 15 and report.dead_lettered == 2
    return report


def _retries(ctx, ids: list[str]) -> int:
    with ctx.engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(repo.conversion_job_events).where(
            repo.conversion_job_events.c.job_id.in_(ids), repo.conversion_job_events.c.event == "retry")).scalar()


def _wait(done: Callable[[], bool], what: str) -> None:
    """Poll the database until the deployed workers have done it."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while not done():
        assert time.monotonic() < deadline, f"conversion: waited {SETTLE_SECONDS}s for {what}"
        time.sleep(0.3)


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


def ensure_breaker_closed(ctx, runtime, resource, deployed: bool = False) -> None:
    """A demo interrupted mid-outage may have left the breaker open: probe it closed before starting (deployed,
    the worker processes probe it themselves)."""
    if _state(ctx).is_open:
        ctx.sandbox.stop_random_faults("pdf.convert")
        ctx.sandbox.stop_random_faults("pdf.health")
        if deployed:
            _wait(lambda: not _state(ctx).is_open, "the breaker to close")
        else:
            _tick_until_probe(ctx, runtime, resource)
