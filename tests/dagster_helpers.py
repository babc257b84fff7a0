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
