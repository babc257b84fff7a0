"""Drain runs at volume, through the production topology, against the same work done directly.

    python -m bench scale                         # 10,000 entities per pipeline (make bench runs it)
    BENCH_SCALE_ENTITIES=1000 python -m bench scale

For each drained pipeline (criticizer, review notifications, evidence attach) it loads N entities,
then lets the deployment work them: `dagster-daemon` (QueuedRunCoordinator, DefaultRunLauncher)
ticking the sensors, a gRPC code server (`dagster api grpc`) launching the run workers, PostgreSQL run
storage — the processes `make serve` runs (`devstack.topology`). The sandbox answers at once, with 20 %
of calls failing transiently (503, 429 with Retry-After, resets), so retries fall due and are worked too.
It waits until no entity of the pipeline is open, then reports:
- entities per second end to end (from the first enqueue to the last settled row);
- Dagster runs launched;
- CPU-seconds per entity over every process (the topology's processes and every child they reaped:
  run workers, the code server, the daemon; and PostgreSQL's server processes);
- the same N entities worked **directly**: the pipeline's drain handler and its PostgreSQL writes,
  called in this one process with no Dagster, in the same session on the same servers — and the ratio.
Lost entities (open, never settled) and duplicate external effects (counted at the sandbox's effect log)
are reported and fail the benchmark.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import psutil
import sqlalchemy as sa

from bench._support import machine_cpu
from bench._workload import (RunWorkers, cpu_of, deployment, drop_evidence_zips,
                             migrated_database, open_count, postgres_pids, total_count, wait_drained)
from devstack.sandbox import SandboxClient
from redrive.db import engine_for
from redrive.drain import Drain, Handler
from redrive.reliability import Reliability
from redrive.settings import Settings

# 20 % of calls fail transiently: 503s, 429s with Retry-After (× the time scale) and connection resets
TRANSIENT_RATES = {"503": 0.08, "429": 0.06, "reset": 0.06}


@dataclass
class Load:
    """One pipeline's part of the benchmark: how to submit N entities and how to work them directly."""

    pipeline: str
    job: str
    routes: tuple[str, ...]  # sandbox routes that get the transient faults
    submit: Callable[[sa.Engine, SandboxClient, str, int], None]
    handler: Callable[[Reliability, Any], tuple[dict[str, Any], Handler]]  # (policies, handle) from resources
    effects: Callable[[SandboxClient], tuple[int, int]]  # (effects, distinct effects) at the sandbox
    submit_direct: Callable[[sa.Engine, SandboxClient, str, int], None] | None = None  # when unlike `submit`


def _criticizer_submit(engine: sa.Engine, sandbox: SandboxClient, session: str, n: int) -> None:
    from assets.criticizer import api

    sandbox.put_store(f"bench/scale/{session}.txt", b"def f():\n    return 1\n" * 50, "text/plain")
    for i in range(n):
        api.submit(engine, {"request_id": f"scale-{session}-{i}",
                            "artifact_url": f"{sandbox.base_url}/store/bench/scale/{session}.txt",
                            "rubric": "Is it fine?",
                            "webhook_url": f"{sandbox.base_url}/slack/webhook/bench-scale/{session}-{i}"},
                   allowed_artifact_prefixes=())


def _criticizer_handler(runtime: Reliability, resources: Any) -> tuple[dict[str, Any], Handler]:
    from assets.criticizer import pipeline

    return dict(pipeline.POLICIES), pipeline.handler(runtime, resources["criticizer_http"], resources["llm"])


def _webhook_effects(sandbox: SandboxClient) -> tuple[int, int]:
    posts = [e for e in sandbox.effects("slack.message") if str(e.get("path", "")).startswith("bench-scale/")]
    return len(posts), len({e["path"] for e in posts})


def _review_submit(engine: sa.Engine, sandbox: SandboxClient, session: str, n: int) -> None:
    """n review jobs of one recipient each (a job is the drained entity; its recipient the effect)."""
    from assets.review_notifications import api

    for i in range(n):
        api.submit(engine, {"idempotency_key": f"scale-{session}-{i}", "changelist_id": f"CL-{session}-{i}",
                            "review_version": 1, "recipients": [f"reviewer-{i}@example.com"],
                            "summary": "bench"})


def _review_handler(runtime: Reliability, resources: Any) -> tuple[dict[str, Any], Handler]:
    from assets.review_notifications import pipeline
    from assets.review_notifications.settings import ReviewNotificationSettings

    knobs = ReviewNotificationSettings()
    mail = _HELD.enter_context(resources["review_mail"].provider())
    return (pipeline.stage_policies(knobs.job_attempts),
            pipeline.ReviewJobHandler(runtime, mail, row_attempts=knobs.row_attempts))


# Clients the direct half holds open for the benchmark's process lifetime. A bare `cm.__enter__()` is
# not enough: the context manager is garbage the moment it returns, and collecting a generator-based
# one runs its exit, which closes the HTTP client under the handler (every call then fails).
_HELD = ExitStack()

EVIDENCE_ROWS_PER_JOB = 200


def _evidence_zips(session: str, n: int) -> list[tuple[str, bytes]]:
    """n rows in file jobs of 200, or in `BENCH_EVIDENCE_FILE_JOBS` file jobs whatever n (`bench upstreams --part
    cpu` holds their number across sizes, so a file job's run cost and a row's cost come apart)."""
    from tests.evidence.helpers import standard_job  # the test suite's ZIP maker: manifest + one PDF per row

    jobs = max(1, int(os.environ.get("BENCH_EVIDENCE_FILE_JOBS") or n // EVIDENCE_ROWS_PER_JOB))
    return [(f"scale-{session}-{j}.zip", standard_job(f"scale-{session}-{j}", n // jobs, 1)[0]) for j in range(jobs)]


def _evidence_submit(engine: sa.Engine, sandbox: SandboxClient, session: str, n: int) -> None:
    """Drop n/200 file-job ZIPs of 200 rows in the S3 inbox: the inbox sensor takes it from there."""
    drop_evidence_zips(_defs(), _evidence_zips(session, n))


def _evidence_direct(engine: sa.Engine, sandbox: SandboxClient, session: str, n: int) -> None:
    """The same file jobs ingested in this process (the ingest stage and its writes), no sensor, no run."""
    from assets.evidence import policy, worker
    from assets.evidence import repository as repo

    defs = _defs()
    client, options = defs.resources["s3"].get_client(), defs.resources["evidence_options"]
    runtime = defs.resources["reliability"].runtime()
    from resources.aws import ensure_bucket

    ensure_bucket(client, options.bucket)
    for name, data in _evidence_zips(session, n):
        key = f"bench-direct/{name}"
        client.put_object(Bucket=options.bucket, Key=key, Body=data)
        etag = str(client.head_object(Bucket=options.bucket, Key=key)["ETag"]).strip('"')
        job_id = policy.file_job_id(options.bucket, key, etag)
        with runtime.engine.begin() as conn:
            job = repo.upsert_file_job(conn, job_id, bucket=options.bucket, key=key, etag=etag,
                                       notify_to="merchant@example.com", now=runtime.now())
        worker.ingest(runtime, client, options, job)


def _evidence_handler(runtime: Reliability, resources: Any) -> tuple[dict[str, Any], Handler]:
    from assets.evidence import pipeline, worker

    api = _HELD.enter_context(resources["case_api"].session())
    return dict(pipeline.ROW_POLICIES), worker.row_handler(runtime, api,
                                                           max_attempts=resources["evidence_options"].max_attempts)


def _attach_effects(sandbox: SandboxClient) -> tuple[int, int]:
    attaches = sandbox.effects("case.attach")
    return len(attaches), len({e.get("idempotency_key") for e in attaches})


_DEFS: list[Any] = []


def _defs() -> Any:
    """The code location's resources on this benchmark's settings (built once per pipeline's database)."""
    return _DEFS[-1]


def _mail_effects(sandbox: SandboxClient) -> tuple[int, int]:
    sends = [e for e in sandbox.effects("mail.send") if str(e.get("to", "")).startswith("reviewer-")]
    return len(sends), len({(e.get("to"), e.get("idempotency_token")) for e in sends})


LOADS: dict[str, Load] = {
    "evidence": Load("evidence", "evidence_file_job", ("case.attach",), _evidence_submit, _evidence_handler,
                     _attach_effects, _evidence_direct),
    "review_notifications": Load("review_notifications", "review_notifications_job", ("mail.send",), _review_submit,
                                 _review_handler, _mail_effects),
    "criticizer": Load("criticizer", "criticizer_job", ("store", "llm", "slack"), _criticizer_submit,
                       _criticizer_handler, _webhook_effects),
}


@dataclass
class Outcome:
    entities: int
    seconds: float
    cpu_seconds: float
    runs: int
    open_left: int
    effects: int
    distinct_effects: int
    machine_cpu_seconds: float | None = None  # every process on the machine (the sandbox too), when measured
    run_worker_busy: float | None = None  # the busiest run worker's share of its core over its life

    @property
    def per_second(self) -> float:
        return self.entities / self.seconds if self.seconds else 0.0


CRITIQUE = {"verdict": "approve", "score": 8, "summary": "Fine.", "findings": []}


def _faults(sandbox: SandboxClient, routes: tuple[str, ...], seed: int) -> None:
    sandbox.set_default("llm", content=json.dumps(CRITIQUE))
    for route in routes:
        sandbox.random_faults(route, seed=seed, rates=TRANSIENT_RATES, retry_after="1")


def run_direct(load: Load, settings: Settings, n: int, session: str, pg_pids: list[int]) -> Outcome:
    """The same work with no Dagster: the drain handler and its writes, in this process."""
    from orchestration.definitions import build_definitions

    sandbox = SandboxClient(os.environ["SANDBOX_URL"])
    sandbox.reset()
    _faults(sandbox, load.routes, seed=7)
    engine = engine_for(settings.database_url or "")
    defs = _DEFS[-1] if _DEFS else build_definitions(settings)
    runtime = defs.resources["reliability"].runtime()
    policies, handle = load.handler(runtime, defs.resources)
    me = psutil.Process()
    cpu0, pg0, started = sum(me.cpu_times()[:2]), cpu_of(pg_pids), time.perf_counter()
    (load.submit_direct or load.submit)(engine, sandbox, session, n)
    drain = Drain(reliability=runtime, pipeline=load.pipeline, policies=policies, owner="bench-direct",
                  concurrency=8, batch_size=50, linger_seconds=5.0, max_seconds=3600)
    while open_count(engine, load.pipeline):
        drain.run(handle)
    seconds = time.perf_counter() - started
    cpu = sum(me.cpu_times()[:2]) - cpu0 + cpu_of(pg_pids) - pg0
    effects, distinct = load.effects(sandbox)
    return Outcome(n, seconds, cpu, 0, open_count(engine, load.pipeline), effects, distinct)


def run_deployed(load: Load, settings: Settings, n: int, session: str, pg_pids: list[int],
                 timeout: float, *, upstreams: Callable[[SandboxClient], None] | None = None,
                 env: dict[str, str] | None = None) -> Outcome:
    """The work as production does it: the daemon ticks the sensor, runs are queued, launched, drained.
    `upstreams` scripts the sandbox (default: this benchmark's transient faults); `env` adds settings."""
    import dagster as dg

    sandbox = SandboxClient(os.environ["SANDBOX_URL"])
    sandbox.reset()
    (upstreams or (lambda box: _faults(box, load.routes, seed=11)))(sandbox)
    engine = engine_for(settings.database_url or "")
    home = settings.redrive_data_dir / "bench-scale" / session
    with deployment(settings, home, env=env) as topology:
        instance = dg.DagsterInstance.from_config(str(home))
        runs0 = instance.get_runs_count(dg.RunsFilter(job_name=load.job))
        pids = [p.proc.pid for p in topology.processes.values()]
        cpu0, pg0, machine0 = cpu_of(pids), cpu_of(pg_pids), machine_cpu()
        started, before = time.perf_counter(), total_count(engine, load.pipeline)
        with RunWorkers(pids) as workers:
            load.submit(engine, sandbox, session, n)
            left = wait_drained(engine, load.pipeline, before + n, timeout)
        seconds = time.perf_counter() - started
        cpu = cpu_of(pids) - cpu0 + cpu_of(pg_pids) - pg0
        machine = machine_cpu() - machine0
        runs = instance.get_runs_count(dg.RunsFilter(job_name=load.job)) - runs0
    effects, distinct = load.effects(sandbox)
    return Outcome(n, seconds, cpu, runs, left, effects, distinct, machine, workers.busiest())


def main(n: int | None = None) -> int:
    n = n or int(os.environ.get("BENCH_SCALE_ENTITIES", "10000"))
    names = [p for p in os.environ.get("BENCH_SCALE_PIPELINES", ",".join(LOADS)).split(",") if p]
    timeout = float(os.environ.get("BENCH_SCALE_TIMEOUT_SECONDS", "3600"))
    status = 0
    rows = []
    for name in names:
        load = LOADS[name]
        session = uuid.uuid4().hex[:6]
        with migrated_database(f"bench_scale_{name}_{session}") as url:
            settings = Settings(database_url=url, redrive_time_scale=0.01)
            from orchestration.definitions import build_definitions

            _DEFS.append(build_definitions(settings))
            pg_pids = postgres_pids(url)
            deployed = run_deployed(load, settings, n, f"{session}d", pg_pids, timeout)
            direct = run_direct(load, settings, n, f"{session}b", pg_pids)
        ratio = deployed.per_second / direct.per_second if direct.per_second else 0.0
        lost = deployed.open_left + direct.open_left
        dupes = (deployed.effects - deployed.distinct_effects) + (direct.effects - direct.distinct_effects)
        rows.append((name, deployed, direct, ratio))
        if lost or dupes:
            status = 1
        print(json.dumps({"pipeline": name, "entities": n,
                          "deployed": {"per_second": round(deployed.per_second, 1), "runs": deployed.runs,
                                       "cpu_per_entity_ms": round(1000 * deployed.cpu_seconds / n, 2),
                                       "seconds": round(deployed.seconds, 1)},
                          "direct": {"per_second": round(direct.per_second, 1),
                                     "cpu_per_entity_ms": round(1000 * direct.cpu_seconds / n, 2),
                                     "seconds": round(direct.seconds, 1)},
                          "ratio": round(ratio, 2), "lost": lost, "duplicate_effects": dupes}), flush=True)
    print(f"scale: {n} entities per pipeline, 20 % transient faults, time scale 0.01")
    print(f"  {'pipeline':<22}{'deployed/s':>11}{'runs':>7}{'CPU ms/entity':>15}{'direct/s':>10}"
          f"{'CPU ms/entity':>15}{'ratio':>7}")
    for name, d, b, ratio in rows:
        print(f"  {name:<22}{d.per_second:>11.1f}{d.runs:>7}{1000 * d.cpu_seconds / d.entities:>15.2f}"
              f"{b.per_second:>10.1f}{1000 * b.cpu_seconds / b.entities:>15.2f}{ratio:>7.2f}")
    return status

