"""The deployed topology on one machine: every process a deployment runs, each started on its own.

`make serve` (`python -m devstack serve`), the topology test, the scale benchmark and a chaos run
use `Topology`: a gRPC code server (`dagster api grpc`), `dagster-webserver` and `dagster-daemon`
pointed at it by a generated workspace, the conversion API and conversion workers — the commands
in `SERVICES`, which docs/deploying.md lists verbatim (a test holds them together). The Dagster
instance is `dagster.yaml.example` itself, so local runs meet the production shape: PostgreSQL
storage, the QueuedRunCoordinator with the `redrive/pipeline` tag limits, run retries that
leave op failures (dead-lettered, deferred work) alone.

Every process gets a marker in its environment, which its children inherit; `stop()` ends each
process group with SIGTERM (SIGKILL after a grace) and then any process still carrying the marker,
so nothing of a topology outlives it — run workers started by the code server included.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil

from devstack.process import free_port
from redrive.db import dagster_storage_url
from redrive.logs import log_format
from redrive.settings import PROJECT_ROOT

if TYPE_CHECKING:
    from devstack.dagster_api import DagsterApi

MARKER = "REDRIVE_TOPOLOGY_ID"
LOCATION = "redrive"
INSTANCE_YAML = PROJECT_ROOT / "dagster.yaml.example"


CODE_PACKAGES = ("assets", "orchestration", "redrive", "resources", "sensors")


def compile_code_location() -> None:
    """Write the code location's bytecode before any process loads it. Where PYTHONDONTWRITEBYTECODE is set (as in
    many container images) no process ever writes it, so every process that loads the location (the code server,
    the daemon, its run workers' forkserver, a run under REDRIVE_RUN_PROCESS_START=spawn) would compile every
    module from source."""
    import compileall

    for package in CODE_PACKAGES:
        compileall.compile_dir(str(PROJECT_ROOT / package), quiet=1)


@dataclass(frozen=True)
class Service:
    """One process of a deployment: its command as deployed (`{placeholders}` filled per host) and its role."""

    name: str
    command: tuple[str, ...]
    role: str
    health: str | None = None  # "grpc", or an HTTP path answered once the process serves
    port: str | None = None  # the placeholder of its HTTP port, where the health path alone does not say

    def argv(self, values: Mapping[str, str]) -> list[str]:
        return [part.format(**values) for part in self.command]


SERVICES: tuple[Service, ...] = (
    Service("code-server", ("python", "-m", "orchestration.code_server", "-m", "orchestration.definitions",
                            "--location-name", LOCATION, "-h", "{host}", "-p", "{grpc_port}",
                            "--log-format", "{dagster_log_format}"),
            "the code location (`dagster api grpc`): loads the Definitions once, serves them over gRPC, launches run "
            "workers, each forked from a process that loaded the location once", "grpc"),
    Service("webserver", ("dagster-webserver", "-w", "{workspace}", "-h", "{host}", "-p", "{webserver_port}",
                          "--log-format", "{dagster_log_format}"),
            "the UI and GraphQL API", "/server_info"),
    Service("daemon", ("dagster-daemon", "run", "-w", "{workspace}", "--log-format", "{dagster_log_format}"),
            "ticks sensors and schedules, dequeues runs under the tag limits, retries failed runs"),
    Service("conversion-api", ("python", "-m", "assets.conversion.api", "serve", "--host", "{host}",
                               "--port", "{api_port}"),
            "the conversion HTTP API, its page and /metrics (003)", "/healthz"),
    Service("conversion-worker", ("redrive", "worker", "conversion"),
            "claims and converts PDF jobs until SIGTERM; WORKER_CONCURRENCY jobs in flight each (003 §3.4)"),
    Service("metrics", ("redrive", "metrics", "serve", "--host", "{host}", "--port", "{metrics_port}"),
            "Prometheus /metrics of every pipeline, read from PostgreSQL at each scrape (issue 16 §3)", "/metrics"),
    Service("dlq-console", ("redrive", "console", "serve", "--host", "{host}", "--port", "{console_port}"),
            "the dead-letter console: every pipeline's letters by root cause; replay and resolve (issue 27)",
            "/healthz", port="console_port"),
)
MIGRATE: tuple[str, ...] = ("redrive", "db", "upgrade")  # once per release, before the services start

# What docs/deploying.md shows: the ports of a deployment and the workspace the chart or compose file mounts.
DEPLOYED = {"host": "0.0.0.0", "grpc_port": "4000", "webserver_port": "3000", "api_port": "8090", "metrics_port": "9108",
            "console_port": "8095",
            "workspace": "/opt/dagster/dagster_home/workspace.yaml", "dagster_log_format": "json"}
# Dagster's own processes write their lines in the format redrive's do (REDRIVE_LOG_FORMAT): one line per record
DAGSTER_LOG_FORMATS = {"json": "json", "text": "colored"}


def deployed_commands() -> dict[str, str]:
    """Each service's command line as a deployment runs it."""
    return {s.name: " ".join(s.argv(DEPLOYED)) for s in SERVICES} | {"migrate": " ".join(MIGRATE)}


def workspace_yaml(host: str, port: int) -> str:
    return (f"load_from:\n  - grpc_server:\n      host: {host}\n      port: {port}\n"
            f"      location_name: {LOCATION}\n")


def _executable(name: str) -> str:
    """This virtualenv's entry point (`dagster`, `redrive`, …), so a deployment's command runs as written."""
    if name == "python":
        return sys.executable
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


@dataclass
class Process:
    service: Service
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Topology:
    """Start every service (or `only` some), wait until each serves, stop them all for sure.

    `env` is what the processes see on top of this one's environment (DATABASE_URL, DAGSTER_PG_URL, …);
    `home` becomes DAGSTER_HOME, with dagster.yaml (a copy of dagster.yaml.example) and workspace.yaml.
    """

    home: Path
    env: Mapping[str, str] = field(default_factory=dict)
    workers: int = 1
    only: Sequence[str] | None = None
    host: str = "127.0.0.1"
    start_timeout: float = 240.0
    stop_grace: float = 20.0
    processes: dict[str, Process] = field(default_factory=dict)
    values: dict[str, str] = field(default_factory=dict)
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)

    # ---------------------------------------------------------------------------------------- addresses

    @property
    def webserver_url(self) -> str:
        return f"http://{self.host}:{self.values['webserver_port']}"

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.values['api_port']}"

    @property
    def console_url(self) -> str:
        return f"http://{self.host}:{self.values['console_port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.values['metrics_port']}/metrics"

    def api(self) -> DagsterApi:
        """The deployment driven through the webserver's GraphQL API: launch and wait for runs, sensors' ticks."""
        from devstack.dagster_api import DagsterApi

        return DagsterApi(self.webserver_url, LOCATION)

    @property
    def log_dir(self) -> Path:
        return self.home / "service-logs"  # not "logs": Dagster keeps its own telemetry files there

    # ------------------------------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Topology:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _names(self) -> list[tuple[str, Service]]:
        wanted = set(self.only) if self.only is not None else None
        out = []
        for service in SERVICES:
            if wanted is not None and service.name not in wanted:
                continue
            if service.name == "conversion-worker":
                out += [(f"{service.name}-{i}", service) for i in range(1, self.workers + 1)]
            else:
                out.append((service.name, service))
        return out

    def start(self) -> None:
        compile_code_location()
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.values = {"host": self.host, "grpc_port": str(free_port()), "webserver_port": str(free_port()),
                       "api_port": str(free_port()), "metrics_port": str(free_port()),
                       "console_port": str(free_port()),
                       "workspace": str(self.home / "workspace.yaml")}
        self.values["dagster_log_format"] = DAGSTER_LOG_FORMATS[log_format(self._child_env())]
        shutil.copyfile(INSTANCE_YAML, self.home / "dagster.yaml")
        dagster_url = self._child_env().get("DAGSTER_PG_URL")
        if dagster_url:  # the migration step's share: the instance does not create its tables at every tick
            from orchestration.storage import prepare_dagster_storage

            prepare_dagster_storage(dagster_url)
        (self.home / "workspace.yaml").write_text(workspace_yaml(self.host, int(self.values["grpc_port"])))
        names = self._names()
        # the code server first: the webserver and the daemon load the location from it when they start
        first = [(n, s) for n, s in names if s.name == "code-server"]
        for name, service in first:
            self._spawn(name, service)
            self._wait(name)
        rest = [(n, s) for n, s in names if s.name != "code-server"]
        for name, service in rest:
            self._spawn(name, service)
        for name, _ in rest:
            self._wait(name)

    def _child_env(self) -> dict[str, str]:
        # JSON logs unless the caller says otherwise: a deployment's log shipper reads one object per line.
        # DAGSTER_UI_URL is this webserver (every alert's link), unless the caller names another (a proxy's).
        env = {"REDRIVE_LOG_FORMAT": "json", **os.environ, "DAGSTER_UI_URL": self.webserver_url, **self.env,
               "DAGSTER_HOME": str(self.home), MARKER: self.marker, "PYTHONUNBUFFERED": "1"}
        if env.get("DAGSTER_PG_URL"):  # dagster-postgres needs psycopg2, whatever driver DATABASE_URL named
            env["DAGSTER_PG_URL"] = dagster_storage_url(env["DAGSTER_PG_URL"])
        return env

    def endpoints(self) -> dict[str, str]:
        """Where an operator reaches each part (devstack.serve_env.ENDPOINTS), plus what the services were given
        on top of this process's environment (DAGSTER_PG_URL, DAGSTER_HOME, the sandbox's Slack webhook, …)."""
        env = self._child_env()
        out = {"DAGSTER_UI_URL": env["DAGSTER_UI_URL"], "CONVERSION_API": self.api_url,
               "METRICS_URL": self.metrics_url}
        if "console_port" in self.values:
            out["DLQ_CONSOLE_URL"] = self.console_url
        for key in ("SANDBOX_URL", "AWS_ENDPOINT_URL", "DATABASE_URL"):
            if env.get(key):
                out[key] = env[key]
        if "DATABASE_URL" in out:  # libpq's form, so `psql "$DATABASE_URL"` works too (redrive adds its driver)
            out["DATABASE_URL"] = out["DATABASE_URL"].replace("postgresql+psycopg2://", "postgresql://", 1)
        return out | {k: v for k, v in self.env.items() if k not in out} | {"DAGSTER_HOME": str(self.home)}

    def _spawn(self, name: str, service: Service) -> None:
        argv = service.argv(self.values)
        argv[0] = _executable(argv[0])
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            # a session of its own: Ctrl-C in the terminal reaches `serve`, which stops the services in order
            proc = subprocess.Popen([*_DEFAULT_SIGNALS, *argv], cwd=PROJECT_ROOT, env=self._child_env(), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.processes[name] = Process(service, name, proc, log)

    def _wait(self, name: str) -> None:
        process = self.processes[name]
        health = process.service.health
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if process.proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.proc.returncode} while starting: "
                                   f"{self.tail(name)}")
            if health is None or self._healthy(health, process.service.port):
                return
            time.sleep(0.25)  # polling a process we started until it serves; not a timing assertion
        raise RuntimeError(f"{name} did not become healthy in {self.start_timeout:.0f}s: {self.tail(name)}")

    def _healthy(self, health: str, port_key: str | None = None) -> bool:
        if health == "grpc":
            return grpc_serving(self.host, int(self.values["grpc_port"]))
        port = self.values[port_key] if port_key else {
            "/server_info": self.values["webserver_port"], "/metrics": self.values["metrics_port"]}.get(
            health, self.values["api_port"])
        try:
            return httpx.get(f"http://{self.host}:{port}{health}", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, name: str, chars: int = 1500) -> str:
        log = self.processes[name].log
        return log.read_text(errors="replace")[-chars:] if log.exists() else ""

    def exited(self) -> dict[str, int]:
        """Services that are no longer running, with their exit codes."""
        return {name: p.proc.returncode for name, p in self.processes.items() if p.proc.poll() is not None}

    def restart(self, name: str) -> None:
        """Stop one process (SIGTERM, then SIGKILL) and start it again with the same command and ports."""
        process = self.processes[name]
        self._stop_one(process)
        self._spawn(name, process.service)
        self._wait(name)

    def kill(self, name: str) -> None:
        """SIGKILL one process (as the OOM killer would; a chaos run's fault) and start it again, as a
        process supervisor would. Only its own process group: run workers the code server started live on."""
        process = self.processes[name]
        if process.proc.poll() is None:
            _signal_group(process.proc.pid, signal.SIGKILL)
            process.proc.wait(10)
        self.respawn(name)

    def respawn(self, name: str) -> None:
        """Start an exited process again with the same command and ports."""
        process = self.processes[name]
        self._spawn(name, process.service)
        self._wait(name)

    def _stop_one(self, process: Process) -> None:
        if process.proc.poll() is None:
            _signal_group(process.proc.pid, signal.SIGTERM)
            try:
                process.proc.wait(self.stop_grace)
            except subprocess.TimeoutExpired:
                _signal_group(process.proc.pid, signal.SIGKILL)
                process.proc.wait(10)
        _signal_group(process.proc.pid, signal.SIGKILL)  # what the group leader left behind (run workers, …)

    def stop(self) -> None:
        """Workers first (they requeue what they hold), the code server last; then anything carrying the marker."""
        previous = _ignore_interrupts()
        try:
            for process in reversed(list(self.processes.values())):
                self._stop_one(process)
            for proc in self.survivors():
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(self.survivors(), timeout=10)
        finally:
            _restore_interrupts(previous)

    def survivors(self) -> list[psutil.Process]:
        """Processes of this topology still alive: any process whose environment carries its marker."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get(MARKER) == self.marker \
                        and proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found


def grpc_serving(host: str, port: int, timeout: float = 2.0) -> bool:
    """The standard gRPC health check, which `dagster api grpc` answers once the Definitions are loaded."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="DagsterApi"),
                                                                     timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# Run before each service: SIGINT and SIGTERM back to their defaults, then exec the service (same pid). A parent
# started in the background has SIGINT ignored, the child inherits that, and Dagster maps SIGTERM onto SIGINT's
# handler: it would ignore SIGTERM. Done in the child's own program, not in a `preexec_fn`: that makes `subprocess`
# fork() and run the parent's at-fork handlers, and a parent that has used gRPC (a bench starting a second
# deployment) hung there on a futex with gRPC's timer thread beside it.
_DEFAULT_SIGNALS = (sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "signal.signal(signal.SIGTERM, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])")


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _ignore_interrupts() -> object:
    """A second Ctrl-C must not cut the shutdown short and leave processes behind."""
    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to protect
        return None


def _restore_interrupts(previous: object) -> None:
    if previous is not None:
        signal.signal(signal.SIGINT, previous)  # type: ignore[arg-type]
