"""`make demo`: the local stack, every pipeline end to end with injected faults, and what happened.

Runs on the embedded defaults: PostgreSQL in .data/pg, moto, the sandbox, and a
Dagster instance in .dagster_home/dev whose run storage is that PostgreSQL (so the
runs are there when `make dev` opens the UI). Each pipeline contributes a `run_demo(ctx)`
that scripts its faults and checks its outcome; the demo exits non-zero if any check fails.

Two contexts run the same `run_demo`: `DemoContext` (`make demo`) evaluates sensor ticks
and executes runs in this process, the way the daemon would; `DaemonDemoContext`
(`python -m orchestration.demo --daemon [PIPELINE …]`) starts the deployed topology
(`dagster api grpc`, `dagster-daemon`, the webserver: devstack.topology) and only submits
work: the daemon ticks the sensors, the run queue starts the runs. A pipeline's demo
declares `THROUGH_DAEMON = True` once it is written for that (faults scripted for its own
entities before the work exists, outcomes read from the database, `ctx.settle`); the
others are listed as not yet driven through the daemon (issue 16 §1).
"""

from __future__ import annotations

import importlib
import re
import sys
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import sqlalchemy as sa

from devstack.sandbox import SandboxClient
from devstack.stack import local_stack
from orchestration.definitions import build_definitions
from orchestration.registry import PIPELINES
from redrive.db import engine_for
from redrive.settings import Settings

# Dagster's console logger prints every failed step with its stack trace; the demo fails runs on purpose,
# so runs log nothing to the console and `DemoContext.run` prints each failure as one line instead.
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}

@dataclass(frozen=True)
class SensorTick:
    run_requests: list[dg.RunRequest]
    cursor: str | None


def evaluate_sensor_tick(defs: dg.Definitions, instance: dg.DagsterInstance, sensor_name: str,
                         cursor: str | None = None) -> SensorTick:
    """Evaluate one tick as the daemon does: with the repository, the instance's dynamic partitions and the
    sensor's cursor, adding the partitions the tick asks for. The caller launches the runs and keeps the cursor."""
    sensor = defs.resolve_sensor_def(sensor_name)
    with dg.partition_loading_context(dynamic_partitions_store=instance), \
            dg.build_sensor_context(instance=instance, resources=defs.resources, sensor_name=sensor_name,
                                    repository_def=defs.get_repository_def(), cursor=cursor,
                                    instance_ref=instance.get_ref()) as context:
        data = sensor.evaluate_tick(context)
    for partitions_request in data.dynamic_partitions_requests or []:
        if isinstance(partitions_request, dg.AddDynamicPartitionsRequest):
            instance.add_dynamic_partitions(partitions_request.partitions_def_name,
                                            list(partitions_request.partition_keys))
    return SensorTick(list(data.run_requests or []), data.cursor if data.cursor is not None else cursor)


def evaluate_sensor(defs: dg.Definitions, instance: dg.DagsterInstance, sensor_name: str) -> list[dg.RunRequest]:
    """The run requests of one tick of a cursor-less sensor."""
    return evaluate_sensor_tick(defs, instance, sensor_name).run_requests


def failure_line(job_name: str, result: dg.ExecuteInProcessResult) -> str:
    """A failed run as one line: the job and its first step failure's first line (already redacted by the core)."""
    errors = [event.step_failure_data.error for event in result.get_step_failure_events()
              if event.step_failure_data.error is not None]
    first = (errors[0].message if errors else "the run failed").strip().splitlines()[0]
    if errors:  # "dagster._core.definitions.events.Failure: ask attempt …" → "Failure: ask attempt …"
        first = re.sub(rf"^[\w.]*\.({re.escape(errors[0].cls_name or '')}): ", r"\1: ", first)
    return f"    ✗ {job_name}: {first[:200]}"


@dataclass
class DemoReport:
    pipeline: str
    done: int = 0
    retried: int = 0
    dead_lettered: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class DemoContext:
    defs: dg.Definitions
    instance: dg.DagsterInstance
    settings: Settings
    sandbox: SandboxClient
    engine: sa.Engine
    session: str  # unique per demo run, so a second `make demo` adds fresh entities
    cursors: dict[str, str | None] = field(default_factory=dict)  # per sensor, as the daemon keeps them

    def run(self, job_name: str, *, run_config: Mapping[str, Any] | None = None, tags: Mapping[str, str] | None = None,
            partition_key: str | None = None) -> dg.ExecuteInProcessResult:
        job = self.defs.resolve_job_def(job_name)
        result = job.execute_in_process(run_config={**QUIET, **(run_config or {})}, instance=self.instance,
                                        tags=dict(tags or {}), partition_key=partition_key, raise_on_error=False)
        if not result.success:
            print(failure_line(job_name, result), flush=True)
        return result

    def tick(self, sensor_name: str) -> list[dg.ExecuteInProcessResult]:
        """One daemon tick of a sensor: evaluate it, launch what it requests (honouring run keys)."""
        results = []
        tick = evaluate_sensor_tick(self.defs, self.instance, sensor_name, self.cursors.get(sensor_name))
        self.cursors[sensor_name] = tick.cursor
        for request in tick.run_requests:
            if request.run_key and self.instance.get_runs(
                    filters=dg.RunsFilter(tags={"dagster/run_key": request.run_key})):
                continue  # the daemon skips a run key it has launched before
            tags = {**(request.tags or {}), **({"dagster/run_key": request.run_key} if request.run_key else {})}
            job_name = request.job_name or self.defs.resolve_sensor_def(sensor_name).job_name
            results.append(self.run(job_name, run_config=request.run_config, tags=tags,
                                    partition_key=request.partition_key))
        return results

    def settle(self, sensor_name: str, pipeline: str, refs: list[str], timeout: float = 900.0) -> list[Any]:
        """Tick the sensor until none of these entities has work due or leased, as the daemon keeps ticking it
        (a retry is the entity's row falling due again); the runs it took."""
        from redrive import work

        runs: list[Any] = []
        deadline = time.monotonic() + timeout
        while True:
            runs += self.tick(sensor_name)
            with self.engine.connect() as conn:
                states = [work.state(conn, pipeline, ref) for ref in refs]
            if not any(s is not None and s.status in work.OPEN_STATUSES for s in states):
                return runs
            assert time.monotonic() < deadline, f"{pipeline}: {refs} still open after {timeout:.0f}s"
            time.sleep(0.2)  # a retry not yet due: the next tick takes it

    def retries_in(self, result: dg.ExecuteInProcessResult | RunOutcome) -> int:
        return len(self.instance.get_records_for_run(result.run_id,
                                                     of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY).records)


@dataclass(frozen=True)
class RunOutcome:
    """A run the deployment ran (launched by the demo, or by the daemon's tick of a sensor), as a demo checks it."""

    run_id: str
    success: bool
    dagster_run: dg.DagsterRun


@dataclass
class DaemonDemoContext(DemoContext):
    """The demo against the deployed topology (`make serve`'s processes): `run` puts a run on the run queue,
    which the daemon dequeues and the code server starts; `tick` waits for the daemon's own ticks of a sensor
    and the runs they started. Nothing is evaluated or executed in this process."""

    api: Any = None  # devstack.dagster_api.DagsterApi
    since: dict[str, float] = field(default_factory=dict)  # per sensor: the newest tick already accounted for
    started_at: float = field(default_factory=time.time)

    def run(self, job_name: str, *, run_config: Mapping[str, Any] | None = None, tags: Mapping[str, str] | None = None,
            partition_key: str | None = None) -> RunOutcome:
        return self.outcome(self.api.launch(job_name, {**QUIET, **(run_config or {})}, tags, partition_key))

    def outcome(self, run_id: str) -> RunOutcome:
        status = self.api.wait_run(run_id)
        run = self.instance.get_run_by_id(run_id)
        assert run is not None, run_id
        if status != "SUCCESS":
            first = (self.api.failures(run_id) or [f"the run ended {status}"])[0]
            print(f"    ✗ {run.job_name}: {first[:200]}", flush=True)
        return RunOutcome(run_id, status == "SUCCESS", run)

    def tick(self, sensor_name: str) -> list[RunOutcome]:  # type: ignore[override]
        """The runs of the daemon's ticks of the sensor since the last call, up to its first tick that began
        after now (so it has seen what the demo just did), each once finished."""
        now = time.time()
        self.api.next_tick(sensor_name, after=now)
        since = self.since.get(sensor_name, self.started_at)
        ticks = [t for t in self.api.ticks(sensor_name, limit=25) if t.timestamp > since]
        self.since[sensor_name] = max([since, *(t.timestamp for t in ticks)])
        return [self.outcome(run_id) for t in reversed(ticks) for run_id in t.run_ids]


# What the deployed processes need for the demo's pace: every wait × 0.01, a 3 s alert burst window, sensors that
# pick up new work within seconds (the replay and inbox sensors keep their own 15 s / 30 s).
DAEMON_ENV = {"REDRIVE_TIME_SCALE": "0.01", "ALERT_BURST_WINDOW_SECONDS": "3", "CRITICIZER_SENSOR_INTERVAL_SECONDS": "5",
              "REVIEW_NOTIFICATIONS_SENSOR_INTERVAL_SECONDS": "5", "MATCHING_SENSOR_INTERVAL_SECONDS": "5",
              "EVIDENCE_SCHEDULER_INTERVAL_SECONDS": "5", "EVIDENCE_MONITOR_INTERVAL_SECONDS": "30"}
ALERT_SENSOR = "redrive_alert_delivery"


def through_daemon(module: Any) -> bool:
    """Whether a pipeline's demo is written for the daemon's ticks (DaemonDemoContext), not only for ticks by hand."""
    return bool(getattr(module, "THROUGH_DAEMON", False))


def main(argv: list[str] | None = None) -> int:
    """`make demo`; `python -m orchestration.demo --daemon [PIPELINE …]` drives the deployed topology instead."""
    args = list(sys.argv[1:] if argv is None else argv)
    daemon = "--daemon" in args
    names = [a for a in args if not a.startswith("-")] or None
    started = time.monotonic()
    for category in (dg.BetaWarning, dg.PreviewWarning, DeprecationWarning):  # library notices, not demo output
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", message=".*deprecated", module="orchestration.demos")  # e.g. starlette's
    print("redrive demo: starting embedded PostgreSQL, moto (S3, SQS) and the sandbox …", flush=True)
    with local_stack("dev") as stack:
        # every backoff wait × 0.01, and a 3 s alert burst window, so the demo takes seconds, not hours
        settings = Settings(redrive_time_scale=0.01, alert_burst_window_seconds=3)
        instance = dg.DagsterInstance.get()
        defs = build_definitions(settings)
        sandbox = SandboxClient(stack.env.get("SANDBOX_URL") or settings.sandbox_url or "")
        sandbox.reset()
        engine = engine_for(stack.database_url)
        session = uuid.uuid4().hex[:6]
        print(f"  started: {', '.join(stack.started) or 'nothing (all configured)'}; "
              f"Dagster storage: {type(instance.run_storage).__name__}")
        if not daemon:
            ok = _run_all(DemoContext(defs, instance, settings, sandbox, engine, session), names, started)
        else:
            from devstack.stack import dagster_home
            from devstack.topology import Topology

            print("  starting the deployed topology: code server, daemon, webserver …", flush=True)
            with Topology(home=dagster_home("demo"), env={**stack.env, **DAEMON_ENV},
                          only=["code-server", "daemon", "webserver"]) as topology:
                api = topology.api()
                api.set_sensor(ALERT_SENSOR, running=False)  # alerts go out at the end, after the scripted faults
                try:
                    ctx = DaemonDemoContext(defs, instance, settings, sandbox, engine, session, api=api)
                    ok = _run_all(ctx, names, started)
                finally:
                    api.set_sensor(ALERT_SENSOR, running=True)
    print("demo: stopped everything it started." + ("" if ok else " FAILED"))
    return 0 if ok else 1


def _run_all(ctx: DemoContext, names: list[str] | None, started: float) -> bool:
    """Every selected pipeline's demo, the alerts, the summary; whether every check passed."""
    daemon = isinstance(ctx, DaemonDemoContext)
    health = ctx.run("stack_healthcheck_job")
    print(f"  healthcheck: {'ok' if health.success else 'FAILED'} (PostgreSQL, S3, SQS, LLM endpoint)")
    reports, failed, skipped = [], [], []
    for pipeline in PIPELINES if names is None else [p for p in PIPELINES if p.name in names]:
        name, module = pipeline.name, importlib.import_module(pipeline.demo)
        if daemon and not through_daemon(module):
            skipped.append(name)
            continue
        try:
            reports.append(module.run_demo(ctx))
        except Exception as exc:  # noqa: BLE001 - report every pipeline, then fail the demo
            failed.append(name)
            where = exc.__traceback__
            while where is not None and where.tb_next is not None:
                where = where.tb_next
            at = f" ({where.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{where.tb_lineno})" if where else ""
            print(f"  {name}: demo check FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                  f"{at}", file=sys.stderr)
    if daemon:  # the daemon's alert sensor sends them: started again, it is waited for
        ctx.api.set_sensor(ALERT_SENSOR, running=True)
        ctx.tick(ALERT_SENSOR)
    else:
        ctx.defs.resources["reliability"].runtime().try_dispatch()  # what the alert sensor does every 30 s
    # alerts only: the alert webhook path, and the alert mails (pipelines also post results and send emails)
    slack = sum(1 for e in ctx.sandbox.effects("slack.message") if e.get("path") == "redrive-alerts")
    email = sum(1 for e in ctx.sandbox.effects("mail.send") if e.get("to") == "oncall@example.com")
    print("\nWhat happened" + (" (runs launched by the daemon's sensor ticks and the run queue)" if daemon else ""))
    print(f"  {'pipeline':<22}{'done':>6}{'retried':>9}{'dead-lettered':>15}")
    for r in reports:
        print(f"  {r.pipeline:<22}{r.done:>6}{r.retried:>9}{r.dead_lettered:>15}")
        for note in r.notes:
            print(f"      · {note}")
    if skipped:
        print(f"  not yet driven through the daemon (`make demo` runs them in process): {', '.join(skipped)}")
    print(f"  alerts sent: {slack} to Slack (sandbox webhook), {email} emails (sandbox mail provider)")
    print("  runs are in PostgreSQL run storage; `make dev` shows them at http://localhost:3000")
    print(f"  dead letters: `redrive dlq list`; took {time.monotonic() - started:.1f}s")
    if failed or not health.success:
        print(f"  FAILED: {', '.join(failed) or 'healthcheck'}", file=sys.stderr)
    return health.success and not failed


if __name__ == "__main__":
    sys.exit(main())
