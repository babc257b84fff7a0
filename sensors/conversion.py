"""The conversion sensor: worker runs while there is due work and the breaker is closed, a probe while it is open.

It only reads (due jobs, breaker state, conversion runs in flight) and decides with
:func:`assets.conversion.policy.dispatch`; runs do the work. Run keys are a counter kept in the
cursor (never below the number of conversion runs so far, and never the wall clock: STYLE §6), so a
repeated evaluation of the same tick starts nothing twice and a reset cursor reuses no key.
"""

# No `from __future__ import annotations`: Dagster reads resource types from live annotations.

import dagster as dg

from assets.conversion import policy
from assets.conversion import repository as repo
from assets.conversion.pipeline import TAGS, conversion_breaker_probe_job, conversion_worker_job
from assets.conversion.settings import BREAKER, PIPELINE, settings_of
from redrive import breaker
from resources.conversion import ConversionResource
from resources.reliability import ReliabilityResource

IN_FLIGHT = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
             dg.DagsterRunStatus.STARTED]


def conversion_worker_sensor(minimum_interval_seconds: int = 15) -> dg.SensorDefinition:
    @dg.sensor(name="conversion_workers", jobs=[conversion_worker_job, conversion_breaker_probe_job],
               minimum_interval_seconds=minimum_interval_seconds, default_status=dg.DefaultSensorStatus.RUNNING,
               description="Starts conversion worker runs while jobs are due and the PDF gateway's breaker is closed (003 §3.3, §3.4).")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource,
                conversion: ConversionResource):
        runtime = reliability.runtime()
        settings = settings_of(conversion)
        now = runtime.now()
        with runtime.engine.connect() as conn:
            due = repo.due_count(conn, now)
            state = breaker.get_state(conn, BREAKER)
        in_flight = context.instance.get_runs_count(
            filters=dg.RunsFilter(tags=TAGS, statuses=IN_FLIGHT))
        decision = policy.dispatch(
            due=due, in_flight=in_flight, max_runs=settings.worker_runs, per_run=settings.worker_concurrency,
            breaker_open=state.is_open,
            probe_due=breaker.probe_due(state, now, settings.breaker_policy(runtime.time_scale)))
        # Run keys count requests: the cursor, or the number of conversion runs the instance has ever seen if
        # that is higher (a reset cursor must not reuse keys Dagster already launched, or no run would start).
        seq = max(int(context.cursor or 0), context.instance.get_runs_count(filters=dg.RunsFilter(tags=TAGS)))
        requests = []
        if decision.probe:
            seq += 1
            requests.append(dg.RunRequest(run_key=f"{PIPELINE}:probe:{state.open_count}:{seq}",
                                          job_name=conversion_breaker_probe_job.name,
                                          tags={**TAGS, "redrive/breaker": BREAKER}))
        for _ in range(decision.worker_runs):
            seq += 1
            requests.append(dg.RunRequest(run_key=f"{PIPELINE}:worker:{seq}", job_name=conversion_worker_job.name,
                                          tags=dict(TAGS)))
        if not requests:
            return dg.SensorResult(skip_reason=dg.SkipReason(decision.reason))
        return dg.SensorResult(run_requests=requests, cursor=str(seq))

    return _sensor
