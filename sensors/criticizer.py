"""The criticizer's sensor: each submitted critique request becomes a partition and a run.

It reads only: requests still `submitted` (no run has started them), oldest first. No
cursor: a cursor on insertion order skips a request whose transaction commits after a
later one was seen; re-reading `submitted` rows cannot lose one, and the run key
(request + attempt 1) makes Dagster start each request once however often it is seen.
New partitions are requested in the tick's result; the daemon adds them before it
launches the runs.
"""

# No `from __future__ import annotations`: Dagster reads resource types from live annotations.

from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg

from assets.criticizer import repository
from assets.criticizer.policy import PIPELINE
from redrive.run_keys import run_key
from resources.reliability import ReliabilityResource


def new_requests_sensor(job: dg.JobDefinition, partitions: dg.DynamicPartitionsDefinition,
                        run_config: Callable[[str, Mapping[str, Any]], dict], *, limit: int = 50,
                        minimum_interval_seconds: int = 30) -> dg.SensorDefinition:
    @dg.sensor(name="criticizer_new_requests", job=job, minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING)
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource):
        """Starts a criticizer run for each submitted critique request (one dynamic partition per request)."""
        with reliability.runtime().engine.connect() as conn:
            pending = repository.submitted(conn, limit)
        if not pending:
            return dg.SkipReason("no critique request waiting")
        assert partitions.name is not None
        new = [r for r in pending if not context.instance.has_dynamic_partition(partitions.name, r)]
        return dg.SensorResult(
            run_requests=[
                dg.RunRequest(run_key=run_key(PIPELINE, request_id, attempt=1), job_name=job.name,
                              partition_key=request_id,
                              run_config=run_config(request_id, {}), tags={"redrive/pipeline": PIPELINE})
                for request_id in pending
            ],
            dynamic_partitions_requests=[partitions.build_add_request(new)] if new else [],
        )

    return _sensor
