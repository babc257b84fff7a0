"""The review-notification sensor: the first run of each new job, as a partition of the job.

Decides and requests; the run does the work. Its run key names the job and attempt 1, so a repeated
tick starts nothing twice; later attempts come from the core's durable-retry and replay sensors
with their own keys. Partitions the API could not add (no Dagster instance at hand, e.g. a job
created by another service) are added here before the run is requested.
"""

# No `from __future__ import annotations`: Dagster reads resource types from live annotations.

import dagster as dg

from assets.review_notifications import repository
from assets.review_notifications.api import PARTITIONS_NAME
from assets.review_notifications.policy import PIPELINE
from redrive.run_keys import run_key
from resources.database import PostgresResource


def pending_jobs_sensor(job: dg.JobDefinition, *, batch: int = 100,
                        minimum_interval_seconds: int = 30) -> dg.SensorDefinition:
    @dg.sensor(name=f"{PIPELINE}_pending_jobs", job=job, minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING)
    def _sensor(context: dg.SensorEvaluationContext, database: PostgresResource):
        """Requests the first run of each review notification job that has not started yet."""
        with database.engine().connect() as conn:
            jobs = repository.pending_jobs(conn, limit=batch)
        if not jobs:
            return dg.SkipReason("no new review notification job")
        keys = [j.key for j in jobs]
        new = [k for k in keys if not context.instance.has_dynamic_partition(PARTITIONS_NAME, k)]
        return dg.SensorResult(
            run_requests=[
                dg.RunRequest(run_key=run_key(PIPELINE, k, attempt=1), partition_key=k,
                              tags={"redrive/pipeline": PIPELINE, "redrive/attempt": "1"})
                for k in keys
            ],
            dynamic_partitions_requests=[dg.AddDynamicPartitionsRequest(PARTITIONS_NAME, new)] if new else [],
        )

    return _sensor
