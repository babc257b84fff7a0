"""Driving sensors the way the daemon does: evaluate a tick, apply its partition requests, launch its runs."""

from __future__ import annotations

import dagster as dg

from orchestration.demo import evaluate_sensor


def tick(defs: dg.Definitions, instance: dg.DagsterInstance, sensor_name: str) -> list[dg.RunRequest]:
    """One tick, evaluated with the repository (partitioned requests need it); dynamic partitions are added."""
    return evaluate_sensor(defs, instance, sensor_name)


def launch(defs: dg.Definitions, instance: dg.DagsterInstance, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
    """Execute a sensor's run request in process, as the daemon's launcher would, with its run key and partition."""
    job = defs.resolve_job_def(request.job_name) if request.job_name else None
    assert job is not None, "the request names its job"
    tags = {**(request.tags or {})}
    if request.run_key:
        tags["dagster/run_key"] = request.run_key
    return job.execute_in_process(run_config=request.run_config, tags=tags, instance=instance,
                                  partition_key=request.partition_key, raise_on_error=False)


def evaluate_failure_sensor(defs: dg.Definitions, instance: dg.DagsterInstance, run_id: str) -> None:
    """One evaluation of the run-failure sensor on this failed run, as the daemon would make it."""
    run = instance.get_run_by_id(run_id)
    assert run is not None
    failure = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.RUN_FAILURE).records[0]
    sensor = defs.get_sensor_def("redrive_run_failure_alerts")
    with dg.build_run_status_sensor_context(
        sensor_name=sensor.name, dagster_event=failure.event_log_entry.dagster_event, dagster_instance=instance,
        dagster_run=run, resources=defs.resources,
    ) as context:
        sensor(context.for_run_failure())


# What the Dagster UI shows, read through its GraphQL schema on an in-process workspace of these definitions
# (the webserver runs the same resolvers; no gRPC server to start).
loaded_definitions: dg.Definitions | None = None  # the attribute the in-process code location loads

_PARTITION_STATS = """query($key: AssetKeyInput!) { assetNodeOrError(assetKey: $key) { __typename
    ... on AssetNode { partitionStats { numMaterialized numFailed numMaterializing numPartitions } } } }"""
_CHECK = """query($key: AssetKeyInput!, $check: String!, $partition: String) {
    assetCheckExecutions(assetKey: $key, checkName: $check, partition: $partition, limit: 1) {
        status evaluation { severity description } } }"""


class DagsterUi:
    """Partition status and asset check results as the UI's GraphQL answers them."""

    def __init__(self, defs: dg.Definitions, instance: dg.DagsterInstance) -> None:
        self.defs, self.instance = defs, instance

    def __enter__(self) -> DagsterUi:
        import sys

        from dagster._core.remote_origin import InProcessCodeLocationOrigin
        from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
        from dagster._core.workspace.context import WorkspaceProcessContext
        from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget

        global loaded_definitions
        loaded_definitions = self.defs
        origin = InProcessCodeLocationOrigin(LoadableTargetOrigin(
            executable_path=sys.executable, module_name=__name__, attribute="loaded_definitions"),
            location_name="redrive")
        self._process = WorkspaceProcessContext(self.instance, InProcessWorkspaceLoadTarget(origin))
        self._process.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.__exit__(*exc)

    def query(self, text: str, **variables: object) -> dict:
        from dagster_graphql.test.utils import execute_dagster_graphql

        result = execute_dagster_graphql(self._process.create_request_context(), text, variables)
        return result.data

    def partition_stats(self, asset: str) -> dict[str, int]:
        """{numMaterialized, numFailed, numMaterializing, numPartitions} of the asset's partitions."""
        node = self.query(_PARTITION_STATS, key={"path": [asset]})["assetNodeOrError"]
        assert node["__typename"] == "AssetNode", node
        return node["partitionStats"]

    def latest_check(self, asset: str, check: str, partition: str | None = None) -> tuple[str, str | None] | None:
        """(status, description) of the check's latest execution (SUCCEEDED / FAILED …), or None if never run."""
        executions = self.query(_CHECK, key={"path": [asset]}, check=check, partition=partition)["assetCheckExecutions"]
        if not executions:
            return None
        evaluation = executions[0]["evaluation"] or {}
        return executions[0]["status"], evaluation.get("description")
