"""`make serve`'s processes (devstack/topology.py): each on its own, work goes through them, nothing survives.

One test, because the topology costs a minute to start on a shared machine: the webserver loads the
`redrive` location from the gRPC code server, the daemon heartbeats, a PDF uploaded to the conversion
API is converted by the conversion worker process, a run launched through GraphQL goes QUEUED →
SUCCESS by the daemon's run coordinator, devstack.dagster_api starts and stops a sensor, waits for the
daemon's tick and reads a failed run's one line, the rehearsal and conversion demos run at once as
`make demo` runs them, and after `stop()` no process of the topology is left.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import psutil
import pytest

from assets.conversion import repository as conversion_repo
from devstack.postgres import create_database, drop_database, with_database
from devstack.topology import SERVICES, Topology
from redrive.db import engine_for, normalize_url
from tests.conversion.conftest import make_pdf
from tests.threads import sampled

WORKSPACE = """{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus
    displayMetadata { key value } locationOrLoadError { __typename ... on PythonError { message } } } } } }"""
DAEMONS = "{ instance { daemonHealth { allDaemonStatuses { daemonType healthy required } } } }"
LAUNCH = """mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename
    ... on LaunchRunSuccess { run { runId status } } ... on PythonError { message }
    ... on RunConfigValidationInvalid { errors { message } } } }"""
RUN = """query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status tags { key value } } } }"""


DAGSTER_CONSOLE_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4} - dagster - ")


def graphql(topology: Topology, query: str, **variables: Any) -> dict[str, Any]:
    reply = httpx.post(f"{topology.webserver_url}/graphql", json={"query": query, "variables": variables}, timeout=30)
    reply.raise_for_status()
    body = reply.json()
    assert "errors" not in body, body
    return body["data"]


def eventually(check: Callable[[], Any], what: str, timeout: float = 180.0) -> Any:
    """Poll until `check` returns something truthy: waiting on real processes, not asserting a duration."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def process_tree(root: int) -> Iterator[dict[int, tuple[int, str]]]:
    """The descendants of `root`, sampled every 20 ms while inside: pid -> (parent pid, command line), kept after
    a process exited (a run's process lives seconds)."""
    seen: dict[int, tuple[int, str]] = {}

    def sample() -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            for proc in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
                if proc.pid not in seen:
                    with contextlib.suppress(psutil.Error):
                        seen[proc.pid] = (proc.ppid(), " ".join(proc.cmdline()))

    with sampled(sample, 0.02):
        yield seen


@pytest.fixture
def dagster_pg_url(admin_url: str):
    """Dagster's run, event and schedule storage in a database of this test's own."""
    name = f"dagster_topology_{os.getpid()}"
    drop_database(admin_url, name)
    create_database(admin_url, name)
    url = normalize_url(with_database(admin_url, name))
    yield url
    engine_for(url).dispose()
    drop_database(admin_url, name)


@pytest.mark.timeout(1500)
def test_topology_serves_work_and_leaves_no_process(db_url: str, dagster_pg_url: str, project_tmp: Path,
                                                    sandbox, defs, scaled_settings, engine, monkeypatch,
                                                    capsys) -> None:
    """Every service of SERVICES starts on its own; work submitted through the API and GraphQL finishes."""
    from orchestration.demos import conversion

    env = {"DATABASE_URL": db_url, "DAGSTER_PG_URL": dagster_pg_url, "REDRIVE_TIME_SCALE": "0.01",
           "UPLOADS_DIR": str(project_tmp / "uploads"), "RESULTS_DIR": str(project_tmp / "results"),
           **conversion.DEPLOYMENT_ENV}
    with engine_for(db_url).begin() as conn:
        token = conversion_repo.create_token(conn, "alice")
    topology = Topology(home=project_tmp / "dagster_home", env=env, workers=1)
    seen: dict[int, psutil.Process] = {}

    def remember() -> None:
        for process in topology.processes.values():
            try:
                leader = psutil.Process(process.proc.pid)
                for proc in [leader, *leader.children(recursive=True)]:
                    seen.setdefault(proc.pid, proc)
            except psutil.NoSuchProcess:
                pass

    with topology:
        assert sorted({p.service.name for p in topology.processes.values()}) == sorted(s.name for s in SERVICES)
        remember()

        # the webserver serves the location it loaded from the code server's gRPC port
        [entry] = graphql(topology, WORKSPACE)["workspaceOrError"]["locationEntries"]
        assert entry["name"] == "redrive" and entry["loadStatus"] == "LOADED"
        assert entry["locationOrLoadError"]["__typename"] == "RepositoryLocation", entry
        assert {"key": "port", "value": topology.values["grpc_port"]} in entry["displayMetadata"]

        # the daemon heartbeats: the sensor daemon and the run queue among them
        def daemons_healthy() -> bool:
            statuses = graphql(topology, DAEMONS)["instance"]["daemonHealth"]["allDaemonStatuses"]
            healthy = {s["daemonType"] for s in statuses if s["healthy"]}
            return {"SENSOR", "SCHEDULER", "QUEUED_RUN_COORDINATOR"} <= healthy

        eventually(daemons_healthy, "the daemon's heartbeats")

        # a PDF through the conversion API, converted by the conversion worker process
        auth = {"authorization": f"Bearer {token}", "x-filename": "topology.pdf"}
        created = httpx.post(f"{topology.api_url}/api/jobs", content=make_pdf("topology"), headers=auth, timeout=30)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]

        def job_done() -> dict[str, Any] | None:
            job = httpx.get(f"{topology.api_url}/api/jobs/{job_id}", headers=auth, timeout=30).json()
            return job if job["status"] in {"succeeded", "failed"} else None

        assert eventually(job_done, "the conversion job")["status"] == "succeeded"
        result = httpx.get(f"{topology.api_url}/api/jobs/{job_id}/result", headers=auth, timeout=30)
        assert result.status_code == 200 and b"topology" in result.content

        # a run launched through GraphQL is queued, then dequeued and run by the daemon
        params = {"selector": {"repositoryLocationName": "redrive", "repositoryName": "__repository__",
                               "jobName": "stack_healthcheck_job"}, "runConfigData": {}}
        launched = graphql(topology, LAUNCH, p=params)["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        assert launched["run"]["status"] == "QUEUED"  # the QueuedRunCoordinator of dagster.yaml.example
        run_id = launched["run"]["runId"]

        def run_finished() -> str | None:
            remember()  # the run worker and its children, while they exist
            status = graphql(topology, RUN, id=run_id)["runOrError"]["status"]
            return status if status in {"SUCCESS", "FAILURE", "CANCELED"} else None

        code_server = topology.processes["code-server"].proc.pid
        with process_tree(code_server) as tree:
            assert eventually(run_finished, "the healthcheck run", timeout=300) == "SUCCESS"
        # the run's process was forked from the code server's forkserver, which loaded the location once: not a
        # new interpreter that imports Dagster and the location and builds the Definitions for every run
        run_pid = topology.api().step_process(run_id)
        assert run_pid in tree, (run_pid, tree)
        forkserver, _ = tree[run_pid]
        assert "multiprocessing.forkserver" in tree[forkserver][1], tree[forkserver]
        assert tree[forkserver][0] == code_server
        # each of the run's records is one JSON line in the services' logs (the run worker's included), and no
        # service prints a line of Dagster's console loggers (a run's, or a sensor's tick in the code server)
        logged = [line for p in topology.processes.values() for line in p.log.read_text(errors="replace").splitlines()]
        of_run = [line for line in logged if run_id in line]
        assert of_run and [line for line in of_run if not line.startswith("{")] == [], of_run[:6]
        assert [line for line in logged if DAGSTER_CONSOLE_LINE.match(line)] == []

        # the same through devstack.dagster_api, as `make demo` drives the deployment: a sensor stopped and
        # started like the UI's toggle, the daemon's next tick of it, and a failed run's failure as one line
        api = topology.api()
        replays = "redrive_dead_letter_replays"
        api.set_sensor(replays, running=False)
        assert not api.sensor_running(replays)
        api.set_sensor(replays, running=True)
        assert api.sensor_running(replays)
        tick = api.next_tick(replays, after=time.time(), timeout=300)
        assert tick.status in {"SKIPPED", "SUCCESS"} and tick.timestamp > 0
        sandbox.script("llm", {"status": 401})  # the healthcheck's LLM round trip: refused, not retried
        failed = api.launch("stack_healthcheck_job")
        remember()
        assert api.wait_run(failed, timeout=300) == "FAILURE"
        [line] = api.failures(failed)
        assert "AUTH_DENIED" in line and "Traceback" not in line and not line.startswith("dagster."), line

        # two pipelines' demos as `make demo` runs them, at once: rehearsal's runs through the queue and its dead
        # letter's replay started by the daemon's own tick of the replay sensor; conversion's uploads to the API
        # process, converted by the worker process under scripted faults, its breaker opened and closed there
        from orchestration.demo import DaemonDemoContext, run_demos
        from orchestration.demos import conversion, rehearsal

        monkeypatch.setenv("DAGSTER_PG_URL", dagster_pg_url)  # this process reads the topology's run storage
        with dg.DagsterInstance.from_config(str(topology.home)) as instance:
            ctx = DaemonDemoContext(defs, instance, scaled_settings, sandbox, engine, "topology", api=api,
                                    urls={"conversion-api": topology.api_url})
            reports = run_demos(ctx, [("rehearsal", rehearsal), ("conversion", conversion)])
        remember()
        assert None not in reports, capsys.readouterr()
        rehearsed, converted = reports
        assert (rehearsed.done, rehearsed.retried, rehearsed.dead_lettered) == (3, 2, 1)
        assert any("replayed from stage 'ask' → resolved" in note for note in rehearsed.notes), rehearsed.notes
        assert (converted.done, converted.dead_lettered) == (15, 2) and converted.retried >= 5
        assert any("closed the breaker" in note for note in converted.notes), converted.notes
        printed = capsys.readouterr().out.splitlines()
        assert [x for x in printed if "✗" in x] == [next(x for x in printed if "✗ rehearsal_job:" in x)], printed
        assert "Traceback" not in "\n".join(printed)
        assert topology.exited() == {}  # no service died along the way

    assert topology.survivors() == []
    alive = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [" ".join(p.cmdline()[:4]) for p in alive]
    assert len(seen) >= len(SERVICES)


def test_one_service_restarts_by_name_on_its_port(db_url: str, project_tmp: Path) -> None:
    """`restart(name)` replaces just that process, which serves again on the same port; stop leaves nothing."""
    topology = Topology(home=project_tmp / "dagster_home", env={"DATABASE_URL": db_url}, workers=2,
                        only=["conversion-api", "conversion-worker"])
    with topology:
        assert sorted(topology.processes) == ["conversion-api", "conversion-worker-1", "conversion-worker-2"]
        before = {name: p.proc.pid for name, p in topology.processes.items()}
        topology.restart("conversion-api")
        after = {name: p.proc.pid for name, p in topology.processes.items()}
        assert after["conversion-api"] != before["conversion-api"]
        assert {k: v for k, v in after.items() if k != "conversion-api"} == {
            k: v for k, v in before.items() if k != "conversion-api"}
        assert httpx.get(f"{topology.api_url}/healthz", timeout=10).json() == {"status": "ok"}
        assert not psutil.pid_exists(before["conversion-api"]) or \
            psutil.Process(before["conversion-api"]).status() == psutil.STATUS_ZOMBIE
        assert len(topology.survivors()) >= 3  # the marker finds the live ones
    assert topology.survivors() == []


def test_a_service_starts_with_sigint_and_sigterm_at_their_defaults_from_a_parent_that_ignores_them() -> None:
    """Started in the background, `make serve` has SIGINT ignored; its services must not inherit that (Dagster maps
    SIGTERM onto SIGINT's handler and would ignore SIGTERM too). The reset runs in the service's own program (the
    `_DEFAULT_SIGNALS` prefix execs it, same pid), not in a `preexec_fn`, which would fork with the parent's at-fork
    handlers: a parent that had used gRPC hung there."""
    from devstack.topology import _DEFAULT_SIGNALS

    report = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, " \
             "signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"
    parent = ("import signal, subprocess, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"print(subprocess.run([*{_DEFAULT_SIGNALS!r}, sys.executable, '-c', {report!r}], "
              "capture_output=True, text=True).stdout.strip()); "
              f"print(subprocess.run([sys.executable, '-c', {report!r}], capture_output=True, text=True).stdout.strip())")
    reset, inherited = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True,
                                      check=True).stdout.splitlines()
    assert reset == "True True"
    assert inherited == "False False"  # without the prefix the child keeps the parent's ignored signals
