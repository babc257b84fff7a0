"""Driving a running deployment as an operator's tools do, through the webserver's GraphQL API.

Launch a job onto the run queue (the daemon's QueuedRunCoordinator dequeues it and the code server
starts the run worker), wait for a run to end, start and stop a sensor, and wait for the daemon's next
tick of a sensor with the runs it requested. Dagster's own GraphQL client does the calls it has (launch,
run status); sensors go through the same schema's `startSensor` / `stopSensor` / `sensorOrError`.
`devstack.topology.Topology.api()` gives one aimed at the topology's webserver.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

FINISHED = frozenset({"SUCCESS", "FAILURE", "CANCELED"})
REPOSITORY = "__repository__"  # the name Dagster gives a code location's single Definitions

_SENSOR = """query($s: SensorSelector!, $limit: Int) { sensorOrError(sensorSelector: $s) { __typename
    ... on Sensor { sensorState { id status ticks(limit: $limit) { status timestamp runIds } } }
    ... on PythonError { message } ... on SensorNotFoundError { message } } }"""
_START = """mutation($s: SensorSelector!) { startSensor(sensorSelector: $s) { __typename
    ... on Sensor { sensorState { status } } ... on PythonError { message } } }"""
_STOP = """mutation($id: String!) { stopSensor(id: $id) { __typename
    ... on StopSensorMutationResult { instigationState { status } } ... on PythonError { message } } }"""
_FAILURES = """query($id: ID!) { logsForRun(runId: $id) { __typename ... on EventConnection { events {
    __typename ... on ExecutionStepFailureEvent { stepKey error { className message } }
    ... on RunFailureEvent { message } } } } }"""
_RUNS = """query($f: RunsFilter) { runsOrError(filter: $f) { __typename ... on Runs { results { runId status } }
    ... on PythonError { message } } }"""
_ENGINE_EVENTS = """query($id: ID!) { logsForRun(runId: $id) { __typename ... on EventConnection { events {
    __typename ... on EngineEvent { message } } } } }"""
ACTIVE = ("QUEUED", "NOT_STARTED", "STARTING", "STARTED")  # a run not yet ended (sensors.matching.ACTIVE)


class DeploymentError(RuntimeError):
    """The webserver answered with an error, or what was waited for did not happen in time."""


@dataclass(frozen=True)
class Tick:
    status: str  # SUCCESS (it requested runs), SKIPPED, FAILURE
    timestamp: float
    run_ids: tuple[str, ...]


class DagsterApi:
    def __init__(self, url: str, location: str, timeout: float = 60.0) -> None:
        from dagster_graphql import DagsterGraphQLClient

        parts = urlsplit(url)
        self.url, self.location, self.timeout = url.rstrip("/"), location, timeout
        self.client = DagsterGraphQLClient(parts.hostname or "127.0.0.1", port_number=parts.port, timeout=int(timeout))

    def clone(self) -> DagsterApi:
        """Another client of the same webserver: Dagster's GraphQL client holds one connection at a time, so
        each thread driving the deployment needs its own."""
        return DagsterApi(self.url, self.location, self.timeout)

    def graphql(self, query: str, **variables: Any) -> dict[str, Any]:
        reply = httpx.post(f"{self.url}/graphql", json={"query": query, "variables": variables}, timeout=self.timeout)
        reply.raise_for_status()
        body = reply.json()
        if body.get("errors"):
            raise DeploymentError(f"GraphQL: {body['errors'][0].get('message', body['errors'])}")
        return body["data"]

    # --------------------------------------------------------------------------------------------- runs

    def launch(self, job: str, run_config: Mapping[str, Any] | None = None,
               tags: Mapping[str, str] | None = None, partition_key: str | None = None) -> str:
        """Submit a run of `job`; it waits in the run queue until the daemon starts it. The run's id."""
        tags = {**(tags or {}), **({"dagster/partition": partition_key} if partition_key else {})}
        return self.client.submit_job_execution(job, repository_location_name=self.location,
                                                repository_name=REPOSITORY, run_config=dict(run_config or {}),
                                                tags=tags or None)

    def status(self, run_id: str) -> str:
        return self.client.get_run_status(run_id).value

    def wait_run(self, run_id: str, timeout: float = 600.0, poll: float = 1.0) -> str:
        """The run's final status (SUCCESS, FAILURE, CANCELED) once it has one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status(run_id)
            if status in FINISHED:
                return status
            time.sleep(poll)  # polling a run of the deployment; not a timing assertion
        raise DeploymentError(f"run {run_id} did not finish in {timeout:.0f}s (last status {status})")

    def failures(self, run_id: str) -> list[str]:
        """The first line of each step failure of the run (already redacted by the core), its exception's
        module path dropped: `Failure: ask attempt …`, not `dagster._core.definitions.events.Failure: …`."""
        found = self.graphql(_FAILURES, id=run_id)["logsForRun"]
        lines = []
        for event in found.get("events", []):
            error = event.get("error") if event["__typename"] == "ExecutionStepFailureEvent" else None
            if error and (error.get("message") or "").strip():
                first = error["message"].strip().splitlines()[0]
                lines.append(re.sub(rf"^[\w.]*\.({re.escape(error.get('className') or '')}): ", r"\1: ", first))
        return lines

    def active_runs(self, job: str) -> list[str]:
        """Ids of the job's runs that have not ended (queued, starting or started)."""
        found = self.graphql(_RUNS, f={"pipelineName": job, "statuses": list(ACTIVE)})["runsOrError"]
        if found["__typename"] != "Runs":
            raise DeploymentError(f"runs of {job}: {found.get('message', found['__typename'])}")
        return [r["runId"] for r in found["results"]]

    def step_process(self, run_id: str) -> int | None:
        """The pid of the process executing the run's steps (its "Executing steps in process (pid: N)" event, the
        run worker under the in-process executor); None before the run got there."""
        found = self.graphql(_ENGINE_EVENTS, id=run_id)["logsForRun"]
        for event in found.get("events", []):
            matched = re.search(r"Executing steps in process \(pid: (\d+)\)", event.get("message") or "")
            if matched:
                return int(matched.group(1))
        return None

    # ------------------------------------------------------------------------------------------ sensors

    def _selector(self, sensor: str) -> dict[str, str]:
        return {"repositoryLocationName": self.location, "repositoryName": REPOSITORY, "sensorName": sensor}

    def _sensor(self, sensor: str, limit: int = 5) -> dict[str, Any]:
        found = self.graphql(_SENSOR, s=self._selector(sensor), limit=limit)["sensorOrError"]
        if found["__typename"] != "Sensor":
            raise DeploymentError(f"sensor {sensor}: {found.get('message', found['__typename'])}")
        return found["sensorState"]

    def sensor_running(self, sensor: str) -> bool:
        return self._sensor(sensor, 1)["status"] == "RUNNING"

    def set_sensor(self, sensor: str, running: bool, attempts: int = 5, confirm: float = 3.0) -> None:
        """Start or stop a sensor, as the UI's toggle does; the daemon ticks only running sensors.

        The daemon writes a sensor's whole state back when a tick starts and ends, from a copy it read a moment
        before (dagster/_daemon/sensor.py: "minimize the window of clobbering the sensor state"): a toggle that
        lands in that window is undone. So the toggle is watched for ``confirm`` seconds and made again if a
        tick undid it, as an operator who sees the switch flip back presses it again."""
        for _ in range(attempts):
            if running:
                done = self.graphql(_START, s=self._selector(sensor))["startSensor"]
            else:
                done = self.graphql(_STOP, id=self._sensor(sensor, 1)["id"])["stopSensor"]
            if done["__typename"] == "PythonError":
                raise DeploymentError(f"sensor {sensor}: {done['message']}")
            deadline = time.monotonic() + confirm
            while self.sensor_running(sensor) == running:
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.5)  # polling the webserver, not a wait for time to pass
        raise DeploymentError(f"sensor {sensor}: the daemon's ticks undid {attempts} toggles to "
                              f"{'running' if running else 'stopped'}")

    def ticks(self, sensor: str, limit: int = 5) -> list[Tick]:
        """The sensor's latest ticks, newest first."""
        return [Tick(t["status"], float(t["timestamp"]), tuple(t["runIds"])) for t in self._sensor(sensor, limit)["ticks"]]

    def next_tick(self, sensor: str, after: float, timeout: float = 300.0, poll: float = 1.0) -> Tick:
        """The first finished tick of the sensor the daemon started after `after` (a Unix time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [t for t in self.ticks(sensor) if t.timestamp > after and t.status != "STARTED"]
            if done:
                return done[-1]
            time.sleep(poll)  # waiting for the daemon's tick; not a timing assertion
        raise DeploymentError(f"the daemon did not tick {sensor} within {timeout:.0f}s")
