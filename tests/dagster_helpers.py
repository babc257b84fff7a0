"""Driving sensors the way the daemon does: evaluate a tick, launch what it requests."""

from __future__ import annotations

import dagster as dg


def tick(defs: dg.Definitions, instance: dg.DagsterInstance, sensor_name: str) -> list[dg.RunRequest]:
    sensor = defs.resolve_sensor_def(sensor_name)
    with dg.build_sensor_context(instance=instance, resources=defs.resources, sensor_name=sensor_name) as context:
        return list(sensor.evaluate_tick(context).run_requests or [])


def launch(defs: dg.Definitions, instance: dg.DagsterInstance, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
    """Execute a sensor's run request in process, as the daemon's launcher would, honouring its run key."""
    job = defs.resolve_job_def(request.job_name) if request.job_name else None
    assert job is not None, "the request names its job"
    tags = {**(request.tags or {})}
    if request.run_key:
        tags["dagster/run_key"] = request.run_key
    return job.execute_in_process(run_config=request.run_config, tags=tags, instance=instance,
                                  raise_on_error=False)
