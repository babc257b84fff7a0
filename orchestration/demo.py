"""`make demo`: the local stack, every pipeline end to end with injected faults, and what happened.

Runs on the embedded defaults: PostgreSQL in .data/pg, moto, the sandbox, and a
Dagster instance in .dagster_home/demo whose run storage is that PostgreSQL (so the
runs are there when `make dev` opens the UI). Each pipeline contributes a `run_demo(ctx)`
that scripts its faults and checks its outcome; the demo exits non-zero if any check fails.

`make demo` (`python -m orchestration.demo [PIPELINE …]`) starts the deployed topology of
`make serve` (`dagster api grpc`, `dagster-daemon`, the webserver, the conversion API and
worker: devstack.topology) and only submits work through a `DaemonDemoContext`: the daemon
ticks the sensors, the run queue starts the runs on the code server. The pipelines' demos
run at once, each on a thread with its own copy of the context, each scripting faults for
its own entities only (`sandbox.script(route, …, match=…)`) before the work exists and
reading outcomes from the database and the runs' event logs; a demo declares
`THROUGH_DAEMON = True` once it is written so, and what its deployment must be configured
with in `DEPLOYMENT_ENV`. The same `run_demo` also runs on `DemoContext`, which evaluates
the ticks and executes the runs in the calling process: the pipelines' tests use it.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import dagster as dg
import sqlalchemy as sa

from devstack.sandbox import SandboxClient
from devstack.stack import dagster_home, local_stack
from devstack.topology import Topology
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
    asset_events: int = 0  # check evaluations, observations… the tick reported (the daemon stores them)


def evaluate_sensor_tick(defs: dg.Definitions, instance: dg.DagsterInstance, sensor_name: str,
                         cursor: str | None = None) -> SensorTick:
    """Evaluate one tick as the daemon does: with the repository, the instance's dynamic partitions and the
    sensor's cursor, adding the partitions the tick asks for and storing the asset events it reports (check
    results: the UI shows them). The caller launches the runs and keeps the cursor."""
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
    for event in data.asset_events or []:
        instance.report_runless_asset_event(event)
    return SensorTick(list(data.run_requests or []), data.cursor if data.cursor is not None else cursor,
                      len(data.asset_events or []))


def evaluate_sensor(defs: dg.Definitions, instance: dg.DagsterInstance, sensor_name: str) -> list[dg.RunRequest]:
    """The run requests of one tick of a cursor-less sensor."""
    return evaluate_sensor_tick(defs, instance, sensor_name).run_requests


# an asset's checks have outputs of their own: a materialization or a failure says more than an output
METADATA_EVENTS = (dg.DagsterEventType.ASSET_MATERIALIZATION, dg.DagsterEventType.STEP_FAILURE,
                   dg.DagsterEventType.STEP_OUTPUT)


def event_metadata(event: dg.DagsterEvent) -> Mapping[str, Any]:
    """The metadata entries an event carries: a materialization's, an output's, a failure's user metadata."""
    if event.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION:
        return event.step_materialization_data.materialization.metadata
    if event.event_type == dg.DagsterEventType.STEP_OUTPUT:
        return event.event_specific_data.metadata
    failure = event.step_failure_data.user_failure_data
    return failure.metadata if failure is not None else {}


def step_metadata(instance: dg.DagsterInstance, run_id: str, step: str) -> dict[str, Any]:
    """The step's metadata values from the run's event log, in METADATA_EVENTS' order of preference."""
    for of_type in METADATA_EVENTS:
        for record in instance.get_records_for_run(run_id, of_type=of_type).records:
            event = record.event_log_entry.dagster_event
            if event is not None and event.step_key == step:
                return {k: v.value for k, v in event_metadata(event).items()}
    return {}


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

    def metadata_of(self, result: dg.ExecuteInProcessResult | RunOutcome, step: str) -> dict[str, Any]:
        """What a run's step reported, read from the run's event log (so it reads the same whichever process ran
        it): its asset materialization's metadata, else its failure's user metadata, else its output's."""
        return step_metadata(self.instance, result.run_id, step)

    def for_demo(self) -> DemoContext:
        """The context one pipeline's demo uses: in process, this one (one demo at a time)."""
        return self

    def service_url(self, service: str) -> str | None:
        """The base URL of a deployed service (devstack.topology.SERVICES' name); in process there is none,
        and a demo serves the app itself and runs its work as Dagster runs."""
        return None


_PRINTED_LOCK = threading.Lock()


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
    printed: set[str] = field(default_factory=set)  # failed runs already shown (shared by the demos' copies)
    urls: dict[str, str] = field(default_factory=dict)  # service name → base URL (the conversion API)

    def service_url(self, service: str) -> str | None:
        return self.urls.get(service)

    def for_demo(self) -> DaemonDemoContext:
        """A copy for one pipeline's demo on its own thread: a GraphQL client and tick bookkeeping of its own,
        the failed runs already printed shared (two demos waiting on one replay run print its failure once)."""
        return replace(self, api=self.api.clone(), since={}, cursors={})

    def run(self, job_name: str, *, run_config: Mapping[str, Any] | None = None, tags: Mapping[str, str] | None = None,
            partition_key: str | None = None) -> RunOutcome:
        partitions = self.defs.resolve_job_def(job_name).partitions_def if partition_key else None
        if partitions is not None:  # as the UI and the daemon tag a partition's run (a multi-partition's dimensions)
            tags = {**partitions.get_tags_for_partition_key(partition_key), **(tags or {})}
        return self.outcome(self.api.launch(job_name, {**QUIET, **(run_config or {})}, tags, partition_key))

    def outcome(self, run_id: str) -> RunOutcome:
        status = self.api.wait_run(run_id)
        run = self.instance.get_run_by_id(run_id)
        assert run is not None, run_id
        if status != "SUCCESS" and self._first_to_show(run_id):
            first = (self.api.failures(run_id) or [f"the run ended {status}"])[0]
            print(f"    ✗ {run.job_name}: {first[:200]}", flush=True)
        return RunOutcome(run_id, status == "SUCCESS", run)

    def _first_to_show(self, run_id: str) -> bool:
        with _PRINTED_LOCK:
            first = run_id not in self.printed
            self.printed.add(run_id)
        return first

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
# `make serve`'s processes the demo needs (devstack.topology.SERVICES): Dagster's three, and the conversion API
# and worker that the conversion demo uploads to and waits for.
TOPOLOGY = ["code-server", "daemon", "webserver", "conversion-api", "conversion-worker"]


def deployment_env(demos: list[Any]) -> dict[str, str]:
    """What the code location reads for the demo: DAEMON_ENV and each pipeline demo's DEPLOYMENT_ENV (e.g. the
    matchmaking weights it publishes), as an operator configures a deployment."""
    return {**DAEMON_ENV, **{k: v for module in demos for k, v in getattr(module, "DEPLOYMENT_ENV", {}).items()}}


def through_daemon(module: Any) -> bool:
    """Whether a pipeline's demo is written for the daemon's ticks (DaemonDemoContext), not only for ticks by hand."""
    return bool(getattr(module, "THROUGH_DAEMON", False))


def main(argv: list[str] | None = None) -> int:
    """`make demo` (`python -m orchestration.demo [PIPELINE …]`): the pipelines' demos through the deployed topology."""
    args = list(sys.argv[1:] if argv is None else argv)
    names = [a for a in args if not a.startswith("-")] or None
    started = time.monotonic()
    for category in (dg.BetaWarning, dg.PreviewWarning, DeprecationWarning):  # library notices, not demo output
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", message=".*deprecated", module="orchestration.demos")  # e.g. starlette's
    print("redrive demo: starting embedded PostgreSQL, moto (S3, SQS) and the sandbox …", flush=True)
    env = deployment_env([importlib.import_module(p.demo) for p in PIPELINES])
    with local_stack("dev") as stack:
        # the pipelines' own settings as the deployed code location reads them (this process builds the same defs)
        os.environ.update({k: v for k, v in env.items() if k not in DAEMON_ENV})
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
        print(f"  starting the deployed topology: {', '.join(TOPOLOGY)} …", flush=True)
        with Topology(home=dagster_home("demo"), env={**stack.env, **env}, only=TOPOLOGY) as topology:
            api = topology.api()
            api.set_sensor(ALERT_SENSOR, running=False)  # alerts go out at the end, after the scripted faults
            try:
                ctx = DaemonDemoContext(defs, instance, settings, sandbox, engine, session, api=api,
                                        urls={"conversion-api": topology.api_url})
                ok = _run_all(ctx, names, started)
            finally:
                api.set_sensor(ALERT_SENSOR, running=True)
    print("demo: stopped everything it started." + ("" if ok else " FAILED"))
    return 0 if ok else 1


def run_one(ctx: DemoContext, name: str, module: Any) -> DemoReport | None:
    """One pipeline's demo; a failed check is one line on stderr (where it failed), never a stack trace."""
    began = time.monotonic()
    try:
        report = module.run_demo(ctx)
    except Exception as exc:  # noqa: BLE001 - report every pipeline, then fail the demo
        where = exc.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        at = f" ({where.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{where.tb_lineno})" if where else ""
        print(f"  {name}: demo check FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
              f"{at}", file=sys.stderr, flush=True)
        return None
    print(f"  {name}: checks passed ({time.monotonic() - began:.0f}s)", flush=True)
    return report


def run_demos(ctx: DaemonDemoContext, demos: list[tuple[str, Any]]) -> list[DemoReport | None]:
    """Each demo's report (None: a check failed), in the order given. The demos run at once, each on a thread of
    its own with its own copy of the context: each scripts its faults for its own entities, so they interleave."""
    pool = ThreadPoolExecutor(max_workers=max(1, len(demos)), thread_name_prefix="demo")
    try:
        return list(pool.map(lambda demo: run_one(ctx.for_demo(), *demo), demos))
    finally:  # on Ctrl-C, not waiting for the demos: the topology stops, and they end on its absence
        pool.shutdown(wait=False, cancel_futures=True)


def _run_all(ctx: DaemonDemoContext, names: list[str] | None, started: float) -> bool:
    """Every selected pipeline's demo at once, the alerts, the summary; whether every check passed."""
    health = ctx.run("stack_healthcheck_job")
    print(f"  healthcheck: {'ok' if health.success else 'FAILED'} (PostgreSQL, S3, SQS, LLM endpoint)")
    chosen = [(p.name, importlib.import_module(p.demo)) for p in PIPELINES if names is None or p.name in names]
    demos = [(name, module) for name, module in chosen if through_daemon(module)]
    skipped = [name for name, module in chosen if not through_daemon(module)]
    print(f"  running {len(demos)} pipeline demos at once; the daemon ticks their sensors …", flush=True)
    outcomes = run_demos(ctx, demos)
    reports = [r for r in outcomes if r is not None]
    failed = [name for (name, _), r in zip(demos, outcomes) if r is None]
    ctx.api.set_sensor(ALERT_SENSOR, running=True)  # the daemon's alert sensor sends them: its next tick
    ctx.tick(ALERT_SENSOR)
    # alerts only: the alert webhook path, and the alert mails (pipelines also post results and send emails)
    slack = sum(1 for e in ctx.sandbox.effects("slack.message") if e.get("path") == "redrive-alerts")
    email = sum(1 for e in ctx.sandbox.effects("mail.send") if e.get("to") == "oncall@example.com")
    print("\nWhat happened (runs launched by the daemon's sensor ticks and the run queue)")
    print(f"  {'pipeline':<22}{'done':>6}{'retried':>9}{'dead-lettered':>15}")
    for r in reports:
        print(f"  {r.pipeline:<22}{r.done:>6}{r.retried:>9}{r.dead_lettered:>15}")
        for note in r.notes:
            print(f"      · {note}")
    if skipped:
        print(f"  not yet written for the daemon (THROUGH_DAEMON), so not run: {', '.join(skipped)}")
    print(f"  alerts sent: {slack} to Slack (sandbox webhook), {email} emails (sandbox mail provider)")
    print("  runs are in PostgreSQL run storage; `make dev` shows them at http://localhost:3000")
    print(f"  dead letters: `redrive dlq list`; took {time.monotonic() - started:.1f}s")
    if failed or not health.success:
        print(f"  FAILED: {', '.join(failed) or 'healthcheck'}", file=sys.stderr)
    return health.success and not failed


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C: the stack and the topology stopped on the way out; no stack trace
        print("\ndemo: interrupted; stopped everything it started.", file=sys.stderr)
        sys.exit(130)
