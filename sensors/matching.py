"""Sensors of the matching pipeline: queue depth → drain run; stuck in-progress documents → one alert each.

Both only read and decide. The queue sensor's run key numbers its requests (never the wall
clock): one more than the drain runs it has requested so far (counted by tag in the instance,
and kept in the cursor), so a tick evaluated twice before its run exists asks for the same key
and Dagster starts it once. A drain run already queued or running makes it skip: one drain
empties the queue.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

from datetime import timedelta

import dagster as dg

from assets.matching import repository
from assets.matching.policy import PIPELINE
from redrive.alerts import Alert
from redrive.run_keys import run_key
from resources.matching import MatchingResource
from resources.reliability import ReliabilityResource

ACTIVE = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
          dg.DagsterRunStatus.STARTED]


REQUESTED = {"matching/requested_by": "matching_queue_sensor"}


def matching_queue_sensor(job: dg.JobDefinition, *, minimum_interval_seconds: int = 30,
                          max_concurrent: int = 1) -> dg.SensorDefinition:
    @dg.sensor(name="matching_queue_sensor", job=job, minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Requests a drain run when the matching queue has visible messages (ApproximateNumberOfMessages).")
    def _sensor(context: dg.SensorEvaluationContext, matching: MatchingResource):
        depth = matching.queue().depth()
        if depth.visible == 0:
            return dg.SkipReason(f"matching queue empty ({depth.in_flight} in flight or waiting out a retry step)")
        active = context.instance.get_runs(filters=dg.RunsFilter(job_name=job.name, statuses=ACTIVE),
                                           limit=max_concurrent)
        if len(active) >= max_concurrent:
            return dg.SkipReason(f"{depth.visible} visible; {len(active)} drain run(s) already active")
        requested = context.instance.get_runs_count(filters=dg.RunsFilter(job_name=job.name, tags=REQUESTED))
        number = max(int(context.cursor or 0), requested) + 1
        return dg.SensorResult(
            run_requests=[dg.RunRequest(
                run_key=run_key(PIPELINE, "queue", attempt=number, purpose="drain"),
                job_name=job.name,
                tags={"redrive/pipeline": PIPELINE, **REQUESTED, "matching/visible_at_request": str(depth.visible)},
            )],
            cursor=str(number),
        )

    return _sensor


def stuck_alert(document: repository.Stuck, matching: MatchingResource, threshold: float, now) -> Alert:
    minutes = max(0, int((now - document.started_at).total_seconds() // 60))
    return Alert(
        pipeline=PIPELINE,
        kind="stuck_in_progress",
        # one alert per document and delivery: a later delivery that sticks again is a new episode
        dedupe_key=f"{PIPELINE}:stuck:{document.id}:delivery-{document.attempts}",
        summary=(f"document {document.id} has been in-progress for {minutes} min (threshold "
                 f"{threshold / 60:g} min) on delivery {document.attempts}: the worker probably crashed. "
                 "SQS redelivers the message after its visibility timeout unless that was the last delivery; "
                 "then re-queue it (matching_requeue_job)."),
        entity_ref=document.id,
        tenant=document.tenant,
        attempts=document.attempts,
        link=matching.admin_link(document.id, document.tenant),
    )


def matching_stuck_sensor(*, minimum_interval_seconds: int = 60) -> dg.SensorDefinition:
    @dg.sensor(name="matching_stuck_documents", minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Alerts once per document left in-progress longer than MATCHING_STUCK_AFTER_SECONDS (a crashed worker).")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource, matching: MatchingResource):
        runtime = reliability.runtime()
        now = runtime.now()
        with runtime.engine.connect() as conn:
            stuck = repository.stuck_in_progress(conn, now - timedelta(seconds=matching.stuck_after_seconds))
        fresh = sum(runtime.alert(stuck_alert(d, matching, matching.stuck_after_seconds, now)) for d in stuck)
        return dg.SkipReason(f"{len(stuck)} stuck in-progress documents; {fresh} newly alerted")

    return _sensor
