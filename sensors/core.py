"""Sensor factories of the core: alert delivery, unexpected run failures, durable retries, replays.

Sensors decide and request; runs do the work (STYLE). The retry and replay sensors
only read and emit RunRequests whose keys name the entity and the attempt or replay
number (`redrive.run_keys`), so a repeated tick starts nothing twice and a failed
run never blocks the next attempt. A sensor that meets an error raises it: Dagster
shows a failed tick, never a silent "nothing new".
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

import hashlib
import json
from datetime import UTC, datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg
from dagster._core.events import JobFailureData, RunFailureReason
from dagster._core.storage.tags import AUTO_RETRY_RUN_ID_TAG, WILL_RETRY_TAG

from assets import backlog
from redrive import deadletters, liveness, metrics, observations, stalls, timers, work
from redrive import alerts
from redrive.alerts import Alert
from redrive.deadletters import DeadLetter, FinalFailure
from redrive.drain_ops import DRAIN_TAG
from redrive.failures import Code, Failure
from redrive.metrics import PipelineSource
from redrive.reconcile import FailedForGood, next_since, reconcile
from redrive.run_keys import REPLAY_SENSOR, due_work_sensor_name, run_key
from redrive.sanitize import sanitize_text
from redrive.stages import DEAD_LETTERED_TAG, DEFERRED_TAG, EXPECTED_FAILURE_TAG
from redrive.timers import Timer
from resources.reliability import ReliabilityResource

REPLAY_TAG = "redrive/replay_of"
PIPELINE_TAG = "redrive/pipeline"


def alert_delivery_sensor(minimum_interval_seconds: int = 30) -> dg.SensorDefinition:
    @dg.sensor(name="redrive_alert_delivery", minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Delivers pending alerts (retrying after a notifier outage, releasing held bursts).")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource) -> dg.SkipReason:
        report = reliability.runtime().try_dispatch()
        if report is None:
            return dg.SkipReason("no alert channel configured or dispatch failed; deliveries stay pending")
        return dg.SkipReason(
            f"sent {report.sent_messages} messages for {report.sent_alerts} alerts; "
            f"{report.deferred} held for burst window; {report.failed_attempts} channel failures"
        )

    return _sensor


def should_alert_run_failure(tags: Mapping[str, str]) -> bool:
    """Pure: alert unless Dagster will retry the run or the core already alerted for it."""
    if tags.get(WILL_RETRY_TAG) == "true":
        return False
    return tags.get(DEAD_LETTERED_TAG) != "true" and tags.get(DEFERRED_TAG) != "true" \
        and not tags.get(EXPECTED_FAILURE_TAG)


def pipeline_of_run(tags: Mapping[str, str], job_name: str, asset_keys: Iterable[dg.AssetKey],
                    asset_pipelines: Mapping[dg.AssetKey, str]) -> str:
    """Pure: the run's pipeline: its tag; for an untagged asset run (`__ASSET_JOB`), its assets' tag; else the job."""
    if tags.get(PIPELINE_TAG):
        return tags[PIPELINE_TAG]
    for key in asset_keys:
        if key in asset_pipelines:
            return asset_pipelines[key]
    return job_name


def asset_pipelines_of(assets: Iterable[dg.AssetsDefinition]) -> dict[dg.AssetKey, str]:
    """Each asset's pipeline, from the `redrive/pipeline` tag on its definition."""
    return {key: tags[PIPELINE_TAG] for a in assets for key, tags in a.tags_by_key.items() if PIPELINE_TAG in tags}


def _failed_step(step_failures: Iterable[dg.DagsterEvent]) -> tuple[str, str]:
    """The first failed step and the error class our sanitized `Failure` recorded on it (else UNKNOWN)."""
    for event in step_failures:
        data = event.step_failure_data.user_failure_data
        error_class = data.metadata.get("error_class") if data is not None else None
        code = getattr(error_class, "value", None) or Code.UNKNOWN
        return event.step_key or "run", str(code)
    return "run", str(Code.UNKNOWN)


def record_run_failure(runtime, run: dg.DagsterRun, step_failures: Iterable[dg.DagsterEvent], message: str | None,
                       asset_pipelines: Mapping[dg.AssetKey, str]) -> None:
    """A run that failed for good: a drain run gives its leases back and alerts once; any other run is
    dead-lettered (and alerted) once, on its partition or on the run itself when it has none."""
    pipeline = pipeline_of_run(run.tags, run.job_name, run.asset_selection or (), asset_pipelines)
    partition = run.tags.get("dagster/partition")
    if run.tags.get(DRAIN_TAG) == "true":
        with runtime.engine.begin() as conn:
            released = work.release_owner(conn, f"run:{run.run_id}", now=runtime.now())
        if partition is None:  # nothing of the run itself to replay: its entities are due again, now
            stage, code = _failed_step(step_failures)
            runtime.alert(Alert(
                pipeline=pipeline, kind="drain_run_failed", dedupe_key=f"drain_run_failed:{run.run_id}",
                error_class=code, link=runtime.run_link(run.run_id),
                summary=sanitize_text(f"drain run {run.run_id} of {run.job_name} failed at {stage} ({code}); "
                                      f"its {released} leased entities are due again now, none lost")[:400]))
            return
    letter_ids = replayed_letters(run.tags)
    if letter_ids and partition is None:
        # A replay run of several entities (no partition names them): its letters, not a `run:<id>`
        # letter nobody could replay, are the record. Those it left replaying are open again.
        stage, code = _failed_step(step_failures)
        with runtime.engine.begin() as conn:
            reopened = deadletters.reopen_failed_replays(conn, letter_ids, run_id=run.run_id,
                                                         reason=f"{stage} ({code})", at=runtime.now())
        runtime.alert(Alert(
            pipeline=pipeline, kind="replay_run_failed", dedupe_key=f"replay_run_failed:{run.run_id}",
            error_class=code, link=runtime.run_link(run.run_id),
            summary=sanitize_text(f"replay run {run.run_id} of {run.job_name} failed at {stage} ({code}); "
                                  f"{len(reopened)} of its {len(letter_ids)} dead letters are open again "
                                  f"for another replay")[:400]))
        return
    entity_ref = partition or f"run:{run.run_id}"
    with runtime.engine.connect() as conn:
        letter = deadletters.active_for(conn, pipeline, entity_ref)
    if letter is not None and letter.run_id == run.run_id:
        return  # this run's failure is already recorded: exactly once
    stage, code = _failed_step(step_failures)
    text = sanitize_text(f"run of {run.job_name} failed: {message or 'run failed'}")
    runtime.fail_for_good(FinalFailure(
        pipeline=pipeline, stage=stage, entity_ref=entity_ref, attempts=1, at=runtime.now(), run_id=run.run_id,
        failure=Failure.of(Code(code) if code in Code.__members__ else Code.UNKNOWN, message=text[:400],
                           retryable=False),
        context={"dagster_run_id": run.run_id, "job": run.job_name},
    ))


def run_failure_alert_sensor(asset_pipelines: Mapping[dg.AssetKey, str] | None = None) -> dg.SensorDefinition:
    @dg.run_failure_sensor(name="redrive_run_failure_alerts", monitor_all_code_locations=False,
                           default_status=dg.DefaultSensorStatus.RUNNING,
                           description="Posts unexpected run failures to the alert channels; silent for runs Dagster will retry.")
    def _sensor(context: dg.RunFailureSensorContext, reliability: ReliabilityResource) -> None:
        """Dead-letters and alerts unexpected run failures once; silent for runs Dagster will retry.

        An op's own failure (outside the stage runner, retries spent) is a dead letter like any
        other (issue 13 §1), on the run's partition, or on the run itself when it has none.
        """
        run = context.dagster_run
        if not should_alert_run_failure(run.tags):
            return
        record_run_failure(reliability.runtime(), run, context.get_step_failure_events(),
                           context.failure_event.message, asset_pipelines or {})

    return _sensor


NOT_RETRYING = "Not retrying run"  # the start of Dagster's engine event when it declines a run tagged will_retry


# How long after a run failed, tagged will_retry, Dagster's retry daemon may take to retry it before the run counts
# as never retried. The daemon retries within seconds; the chaos run saw one retry never made (the daemon SIGKILLed
# and PostgreSQL backends cut around the failure), the run left failed with will_retry=true for good.
RETRY_GRACE_SECONDS = 300.0


def declined_retry(tags: Mapping[str, str], engine_messages: Iterable[str], failed_seconds_ago: float = 0.0,
                   grace: float = RETRY_GRACE_SECONDS) -> bool:
    """Pure: Dagster tagged the run `will_retry=true` and launched no retry, and either said it will not or has
    not for ``grace`` seconds since the run failed."""
    return (tags.get(WILL_RETRY_TAG) == "true" and AUTO_RETRY_RUN_ID_TAG not in tags
            and (any(m.startswith(NOT_RETRYING) for m in engine_messages) or failed_seconds_ago >= grace))


RETRY_OF_TAG = "redrive/retry_of"  # a run the declined-retry sensor started again: the run it retries
# Tags of the declined run a retry does not carry: Dagster's own bookkeeping of that run and of its backfill
# (a retry outside the ended backfill is what lets Dagster's run retries cover it again if it fails too).
_NOT_CARRIED = ("dagster/", ".dagster/", DEAD_LETTERED_TAG)


def retry_request(run: dg.DagsterRun) -> dg.RunRequest:
    """The declined run, once more: same job, partition, config and assets; keyed on the run, so one retry."""
    tags = {k: v for k, v in run.tags.items() if not k.startswith(_NOT_CARRIED)}
    return dg.RunRequest(run_key=f"retry-of:{run.run_id}", job_name=run.job_name, run_config=run.run_config,
                         partition_key=run.tags.get("dagster/partition"),
                         asset_selection=list(run.asset_selection) if run.asset_selection else None,
                         tags={**tags, RETRY_OF_TAG: run.run_id})


def declined_retry_sensor(asset_pipelines: Mapping[dg.AssetKey, str] | None = None, *,
                          jobs: Sequence[Any] = (),  # JobDefinition or define_asset_job's unresolved job
                          minimum_interval_seconds: int = 30, limit: int = 100,
                          retry_grace: float = RETRY_GRACE_SECONDS) -> dg.SensorDefinition:
    """The run-failure sensor is silent for a run tagged `dagster/will_retry=true`; Dagster then declines the
    retry of a run whose backfill has ended ("Not retrying run since it is part of a backfill…"), and a job
    backfill ends as soon as its runs are submitted: a partition run of a backfill killed with its worker was
    never run again (the chaos run: 250 users of a dead-lettered partition). A run Dagster said it would retry
    and still has not ``retry_grace`` seconds later is treated the same. This sensor starts such a run once
    more itself, outside the backfill, so Dagster's own run retries cover the new run; a declined run of a job
    it cannot start is recorded as the failure sensor would, once."""
    targets = {j.name for j in jobs}

    @dg.sensor(name="redrive_declined_run_retries", minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING, jobs=list(jobs) or None,
               description="Starts once more a failed run whose automatic retry Dagster declined (a run of an "
                           "ended backfill); dead-letters and alerts one it cannot start.")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource) -> dg.SensorResult:
        from datetime import UTC, datetime, timedelta

        now = datetime.now(UTC)
        records = context.instance.get_run_records(filters=dg.RunsFilter(
            statuses=[dg.DagsterRunStatus.FAILURE], tags={WILL_RETRY_TAG: "true"},
            updated_after=now - timedelta(days=1)), limit=limit)
        recorded, retries, runtime = 0, [], None
        for record in records:
            run = record.dagster_run
            updated = record.update_timestamp  # Dagster's storage gives it naive, in UTC
            ended = record.end_time or (updated if updated.tzinfo else updated.replace(tzinfo=UTC)).timestamp()
            if AUTO_RETRY_RUN_ID_TAG in run.tags or run.tags.get(DEAD_LETTERED_TAG) == "true":
                continue  # retried (the retry is judged on its own), or recorded by an earlier tick
            if run.job_name in targets:
                ours = context.instance.get_run_ids(dg.RunsFilter(tags={RETRY_OF_TAG: run.run_id}), limit=1)
                if ours:  # our retry exists: say so where Dagster looks (its UI, its retry daemon), look no more
                    context.instance.add_run_tags(run.run_id, {AUTO_RETRY_RUN_ID_TAG: ours[0]})
                    continue
            logs = context.instance.all_logs(run.run_id, of_type={dg.DagsterEventType.ENGINE_EVENT,
                                                                   dg.DagsterEventType.STEP_FAILURE})
            events = [e.dagster_event for e in logs if e.dagster_event is not None]
            engine = [e.message or "" for e in events if e.event_type == dg.DagsterEventType.ENGINE_EVENT]
            if not declined_retry(run.tags, engine, failed_seconds_ago=now.timestamp() - ended, grace=retry_grace):
                continue  # the retry daemon has not decided yet: look again next tick
            if run.job_name in targets:
                retries.append(retry_request(run))  # its run key makes it one run, however many ticks ask
                continue
            runtime = runtime or reliability.runtime()
            record_run_failure(runtime, run, [e for e in events if e.event_type == dg.DagsterEventType.STEP_FAILURE],
                               "Dagster declined its automatic retry", asset_pipelines or {})
            context.instance.add_run_tags(run.run_id, {DEAD_LETTERED_TAG: "true"})  # once, whatever follows
            recorded += 1
        return dg.SensorResult(run_requests=retries, skip_reason=None if retries else dg.SkipReason(
            f"{recorded} failed runs whose retry Dagster declined recorded"))

    return _sensor


@dataclass(frozen=True)
class ReplayTarget:
    """How a pipeline's entity becomes a run: for durable retries and for replays."""

    job: dg.JobDefinition
    run_config: Callable[[str, Mapping[str, object]], dict]
    partition_key: Callable[[str], str | None] = lambda entity: None
    # Several entities of one partition in one run, for pipelines whose replay is a cheap requeue:
    # replaying a thousand letters is then a few runs, not a thousand.
    batch_run_config: Callable[[Sequence[str]], dict] | None = None

    @property
    def job_name(self) -> str:
        return self.job.name


def deferred_retry_sensor(pipeline: str, target: ReplayTarget, *, limit: int = 100,
                          minimum_interval_seconds: int = 30) -> dg.SensorDefinition:
    @dg.sensor(name=f"{pipeline}_deferred_retries", job=target.job,
               minimum_interval_seconds=minimum_interval_seconds, default_status=dg.DefaultSensorStatus.RUNNING,
               description=f"Requests the next attempt of {pipeline} entities whose durable retry timer is due.")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource):
        runtime = reliability.runtime()
        with runtime.engine.connect() as conn:
            due = timers.due(conn, runtime.now(), pipeline=pipeline, limit=limit)
        if not due:
            return dg.SkipReason("no retry timer due")
        return [timer_run_request(pipeline, target, t) for t in due]

    return _sensor


def timer_run_request(pipeline: str, target: ReplayTarget, timer: Timer) -> dg.RunRequest:
    return dg.RunRequest(
        run_key=run_key(pipeline, timer.entity_ref, attempt=timer.attempt),
        job_name=target.job_name,
        run_config=target.run_config(timer.entity_ref, {"attempt": timer.attempt, **timer.payload}),
        partition_key=target.partition_key(timer.entity_ref),
        tags={"redrive/pipeline": pipeline, "redrive/attempt": str(timer.attempt)},
    )


def replayed_letters(tags: Mapping[str, str]) -> list[int]:
    """Pure: the dead letters a replay run replays, from its tag (every id, so a failed run can reopen them)."""
    return [int(i) for i in tags.get(REPLAY_TAG, "").split(",") if i.strip().isdigit()]


def replay_run_request(letter: DeadLetter, target: ReplayTarget) -> dg.RunRequest:
    return dg.RunRequest(
        run_key=run_key(letter.pipeline, letter.entity_ref, replay=letter.replay_count),
        job_name=target.job_name,
        run_config=target.run_config(letter.entity_ref, {"replay_of": letter.id, "replay_from": letter.replay_from,
                                                         "stage": letter.stage}),
        partition_key=target.partition_key(letter.entity_ref),
        tags={"redrive/pipeline": letter.pipeline, REPLAY_TAG: str(letter.id),
              "redrive/replay": str(letter.replay_count)},
    )


def batch_replay_run_request(pipeline: str, partition: str | None, letters: Sequence[DeadLetter],
                             target: ReplayTarget) -> dg.RunRequest:
    """One run for several letters of one pipeline and partition; its key names exactly those replays."""
    assert target.batch_run_config is not None
    replays = sorted((letter.id, letter.replay_count) for letter in letters)
    digest = hashlib.sha256(json.dumps(replays).encode()).hexdigest()[:16]
    return dg.RunRequest(
        run_key=f"{pipeline}:replay-batch:{partition or '-'}:{digest}",
        job_name=target.job_name,
        run_config=target.batch_run_config([letter.entity_ref for letter in letters]),
        partition_key=partition,
        tags={PIPELINE_TAG: pipeline, REPLAY_TAG: ",".join(str(i) for i, _ in replays),  # all of them: see below
              "redrive/replays": str(len(replays))},
    )


def replay_run_requests(pending: Sequence[DeadLetter], targets: Mapping[str, ReplayTarget], *,
                        max_single: int = 50) -> tuple[list[dg.RunRequest], list[DeadLetter]]:
    """A run per replayed letter (at most `max_single` a tick), or one per pipeline and partition where the
    target takes a batch; with the letters those runs replay."""
    requests, taken, batches = [], [], {}
    for letter in pending:
        target = targets.get(letter.pipeline)
        if target is None:
            continue
        if target.batch_run_config is not None:
            batches.setdefault((letter.pipeline, target.partition_key(letter.entity_ref)), []).append(letter)
        elif len(requests) < max_single:
            requests.append(replay_run_request(letter, target))
        else:
            continue  # the next tick
        taken.append(letter)
    for (pipeline, partition), letters in batches.items():
        requests.append(batch_replay_run_request(pipeline, partition, letters, targets[pipeline]))
    return requests, taken


def dead_letter_replay_sensor(targets: Mapping[str, ReplayTarget], *, limit: int = 500,
                              minimum_interval_seconds: int = 15) -> dg.SensorDefinition:
    """Replays as runs. The cursor remembers which replays it started, so the next tick takes the next ones;
    a lost cursor starts them again — per-letter run keys dedupe those, and a batch replay is a requeue,
    which is idempotent."""
    jobs = list({t.job_name: t.job for t in targets.values()}.values())

    @dg.sensor(name=REPLAY_SENSOR, jobs=jobs, minimum_interval_seconds=minimum_interval_seconds, default_status=dg.DefaultSensorStatus.RUNNING,
               description="Starts runs for the dead letters an operator asked to replay (`redrive dlq replay`): "
                           "one per letter, or one per pipeline and partition where replay is a requeue.")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource):
        runtime = reliability.runtime()
        started = {int(k): v for k, v in json.loads(context.cursor or "{}").items()}
        with runtime.engine.connect() as conn:
            started = deadletters.replays_still_current(conn, started)
            pending = deadletters.replays_pending(conn, limit=limit, started=started)
        requests, taken = replay_run_requests(pending, targets)
        started.update({letter.id: letter.replay_count for letter in taken})
        context.update_cursor(json.dumps({str(k): v for k, v in started.items()}))
        return requests or dg.SkipReason("no replay requested")

    return _sensor


ACTIVE_RUN_STATUSES = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
                       dg.DagsterRunStatus.STARTED]


def _active_runs(instance: dg.DagsterInstance, job_name: str) -> int:
    return instance.get_runs_count(dg.RunsFilter(job_name=job_name, statuses=ACTIVE_RUN_STATUSES))


def _active_partitions(instance: dg.DagsterInstance, job_name: str) -> set[str]:
    """The partitions of `job_name` with a queued or running run, in one read of the run storage."""
    runs = instance.get_runs(dg.RunsFilter(job_name=job_name, statuses=ACTIVE_RUN_STATUSES))
    return {p for run in runs if (p := run.tags.get("dagster/partition")) is not None}


def due_work_sensor(pipeline: str, job: dg.JobDefinition, *, by_partition: bool = False, max_runs: int = 1,
                    minimum_interval_seconds: int = 15, limit: int = 50) -> dg.SensorDefinition:
    """A drain run when `pipeline`'s work queue has due entities: one run per round, not per entity.

    The cursor counts rounds and the run key names the round (`<pipeline>:drain:round-N`), so a
    repeated tick starts nothing twice; a lost cursor resumes after the job's run count. While `max_runs` drain runs are queued or running no new
    one is requested: they claim what falls due. `by_partition`: one run per group (an evidence
    file job) with due rows, on that group's partition, at most one active run per partition.
    """

    @dg.sensor(name=due_work_sensor_name(pipeline), job=job, minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description=f"Starts a drain run of {pipeline} when entities in its work queue are due "
                           "(new work, retries falling due, dead-letter replays); one run per round, never one "
                           "per entity.")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource):
        runtime = reliability.runtime()
        # rounds continue from the cursor, or from the job's run count when the cursor is lost or reset
        now = runtime.now()
        round_no = max(int(context.cursor or 0), context.instance.get_runs_count(dg.RunsFilter(job_name=job.name)))
        tags = {"redrive/pipeline": pipeline, "redrive/drain": "true"}
        # The active runs are read before the due rows: a run that ends between the two reads has done its rows,
        # so they are not read as due. In the other order a run ending in between looked idle beside rows read
        # due while it worked them, and an empty drain run was started (seconds of a run worker's CPU each; a
        # loaded deployment's evidence took two runs per file job).
        if by_partition:
            busy = _active_partitions(context.instance, job.name)
            with runtime.engine.connect() as conn:
                groups = work.due_groups(conn, pipeline, now, limit=limit)
            requests = []
            for group, due in groups:
                if group in busy:
                    continue
                round_no += 1
                requests.append(dg.RunRequest(run_key=f"{pipeline}:drain:{group}:round-{round_no}", job_name=job.name,
                                              partition_key=group, tags={**tags, "redrive/due": str(due)}))
            if not requests:
                return dg.SkipReason("no due work outside the partitions already being drained")
            return dg.SensorResult(run_requests=requests, cursor=str(round_no))
        if _active_runs(context.instance, job.name) >= max_runs:
            return dg.SkipReason("a drain run is already working")
        with runtime.engine.connect() as conn:
            backlog = work.backlog(conn, pipeline, now)
        if backlog.due == 0:
            return dg.SkipReason("no due work")
        round_no += 1
        return dg.SensorResult(
            run_requests=[dg.RunRequest(run_key=f"{pipeline}:drain:round-{round_no}", job_name=job.name,
                                        tags={**tags, "redrive/due": str(backlog.due)})],
            cursor=str(round_no),
        )

    return _sensor


def dead_letter_reconciliation_sensor(sources: Mapping[str, FailedForGood], *, limit: int = 100,
                                      minimum_interval_seconds: int = 300) -> dg.SensorDefinition:
    @dg.sensor(name="redrive_dead_letter_reconciliation", minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Finds entities of any pipeline marked failed for good without a dead letter (a crash "
                           "between two commits) and writes the missing dead letter and alert, once.")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource) -> dg.SkipReason:
        """Gives every entity failed for good its dead letter and alert, if a crash between two commits lost them.
        The cursor is where the last complete pass started (less its grace and an overlap), so a tick reads what
        failed since, not every failure the retention windows keep; the first tick, with no cursor, reads all."""
        runtime = reliability.runtime()
        started = runtime.now()
        since = datetime.fromisoformat(context.cursor) if context.cursor else None
        repaired = reconcile(runtime, sources, limit=limit, since=since)
        following = next_since(since, started, repaired, limit)
        context.update_cursor(following.isoformat() if following else None)
        if not repaired:
            return dg.SkipReason(f"every failed entity of {', '.join(sources) or 'no pipeline'} has its dead letter")
        shown = ", ".join(f"{r.pipeline}/{r.entity_ref} -> dead letter {r.dead_letter_id}" for r in repaired[:10])
        return dg.SkipReason(f"repaired {len(repaired)} failed entities without a dead letter: {shown}")

    return _sensor


BACKLOG_REFRESH_SECONDS = 300.0


def pipeline_backlog_sensor(pipelines: Sequence[str], sources: Mapping[str, PipelineSource], max_age_hours: float,
                            max_wait_seconds: float, minimum_interval_seconds: int = 30,
                            refresh_seconds: float = BACKLOG_REFRESH_SECONDS,
                            stall_seconds: float = backlog.DEFAULT_STALL_SECONDS) -> dg.SensorDefinition:
    @dg.sensor(name="redrive_pipeline_backlog", minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Reports every pipeline's backlog checks (open and stale dead letters, stuck due work) "
                           f"on its `<pipeline>_backlog` asset: a change on the next tick ({minimum_interval_seconds} "
                           f"s), every check every {refresh_seconds / 60:g} minutes; never starts a run.")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource):
        runtime = reliability.runtime()
        found = backlog.verdicts(runtime, pipelines, sources, max_age_hours, max_wait_seconds, stall_seconds)
        failing = [f"{p}: {v.check}" for p, vs in found.items() for v in vs if not v.passed]
        events, cursor = backlog.news(found, json.loads(context.cursor or "{}"), runtime.now().timestamp(),
                                      refresh_seconds)
        if events:  # a tick that reports nothing new says nothing (every 30 s)
            context.log.info(f"backlog checks: {', '.join(failing) or 'all passing'}; {len(events)} reported")
        return dg.SensorResult(asset_events=events, cursor=json.dumps(cursor, sort_keys=True))

    return _sensor


# --- liveness (issue 25) --------------------------------------------------------------------------------

WATCHDOG_REASON = "the run watchdog: no heartbeat from its worker"


def _started_at(record) -> "datetime":
    if record.start_time:
        return datetime.fromtimestamp(record.start_time, tz=UTC)
    created = record.create_timestamp  # the run storage's naive UTC
    return created if created.tzinfo else created.replace(tzinfo=UTC)


def fail_silent_runs(runtime, instance: dg.DagsterInstance, *, dead_after: float,
                     limit: int = 500) -> list[liveness.Silent]:
    """Every STARTED run whose worker has been silent longer than `dead_after`: fenced (marked dead, its leased
    rows due again now, one transaction), then failed through Dagster's instance API, so run retries, the
    run-failure sensor and the due-work sensors carry on. A run already fenced whose failure could not be
    reported (the run storage was away) is reported again on the next tick."""
    records = instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]), limit=limit)
    if not records:
        return []
    now = runtime.now()
    started = {r.dagster_run.run_id: _started_at(r) for r in records}
    with runtime.engine.begin() as conn:
        silent = liveness.silent_runs(conn, started, now=now, dead_after=dead_after)
        liveness.prune(conn, older_than=liveness.stale_before(now), keep=started)
    failed = []
    for s in silent:
        with runtime.engine.begin() as conn:
            released = liveness.declare_dead(conn, s.run_id, reason=WATCHDOG_REASON, now=now,
                                             release=lambda c, holder, at: work.release_owner(c, holder, now=at))
        run = instance.get_run_by_id(s.run_id)
        if run is None or run.status != dg.DagsterRunStatus.STARTED:
            continue  # it ended meanwhile; the fence holds whatever it still tries
        given_back = f"; its {released} leased entities are due again now" if released else ""
        instance.report_run_failed(run, (
            f"{WATCHDOG_REASON} for {s.silent_seconds:.0f} s (limit {dead_after:g} s): its process is gone or cut "
            f"off; the run is fenced and writes nothing more{given_back}"),
            JobFailureData(error=None, failure_reason=RunFailureReason.UNEXPECTED_TERMINATION))
        failed.append(s)
    return failed


def run_watchdog_sensor(dead_after: float = liveness.DEAD_AFTER_SECONDS,
                        minimum_interval_seconds: int = 20) -> dg.SensorDefinition:
    @dg.sensor(name="redrive_run_watchdog", minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description=f"Fails a STARTED run whose worker sent no heartbeat for {dead_after:g} s (killed while "
                           "PostgreSQL was away, or its backend cut as it reported): fenced first, so it writes "
                           "nothing more; run retries and the due-work sensors carry on.")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource) -> dg.SkipReason:
        failed = fail_silent_runs(reliability.runtime(), context.instance, dead_after=dead_after)
        if not failed:
            return dg.SkipReason("every started run is beating")
        return dg.SkipReason("failed silent runs: " + ", ".join(f"{s.run_id} ({s.silent_seconds:.0f} s)"
                                                                 for s in failed))

    return _sensor


@dataclass(frozen=True)
class StallTick:
    states: dict[str, stalls.StallState]
    changes: dict[str, str]  # pipeline → stalled / cleared (only those that changed, or were seen first)


def watch_stalls(runtime, pipelines: Sequence[str], sources: Mapping[str, PipelineSource],
                 stall_seconds: float) -> StallTick:
    """One tick of the stall watch: every pipeline's progress counter and due work against its last state; a
    pipeline that just stalled gets its one alert in the same transaction."""
    now = runtime.now()
    with runtime.engine.begin() as conn:
        # every pipeline's settled attempts are in the core's rollup (conversion's too, by its events' trigger):
        # one small read, whatever the history
        counts = stalls.progress_counts(observations.read_all(conn))
        due = metrics.due_work(conn, now, pipelines, sources)
        before = stalls.load(conn)
        states, changes = {}, {}
        for pipeline in pipelines:
            state, change = stalls.next_state(before.get(pipeline), progress=counts.get(pipeline, 0),
                                              due=due.get(pipeline, [0, None])[0], now=now, limit=stall_seconds)
            states[pipeline] = state
            if change is not None or pipeline not in before:
                changes[pipeline] = change or "seen"
            if change == stalls.STALLED:
                assert state.stalled_since is not None
                alerts.enqueue(conn, Alert(
                    pipeline=pipeline, kind="pipeline_stalled", error_class="STALLED",
                    dedupe_key=f"pipeline_stalled:{pipeline}:{state.stalled_since.isoformat()}",
                    summary=sanitize_text(
                        f"{pipeline} is stalled: {state.due} item(s) due and no progress for "
                        f"{state.seconds_without_progress(now):.0f} s (limit {stall_seconds:g} s). "
                        "Look for STARTED runs without a live worker and at the due-work sensor "
                        "(docs/operating.md, Stuck runs and stalled pipelines).")[:400]),
                    list(runtime.channels), now)
        stalls.save(conn, states, now=now)
    if stalls.STALLED in changes.values():
        runtime.try_dispatch()
    return StallTick(states, changes)


def stall_evaluations(tick: StallTick, now: "datetime", stall_seconds: float) -> list[dg.AssetCheckEvaluation]:
    """The `pipeline_progressing` check of the pipelines whose state changed, as evaluations without a run."""
    found = {p: [backlog.progressing_verdict(tick.states[p], now, stall_seconds)] for p in tick.changes}
    return backlog.evaluations(found)


def pipeline_stall_sensor(pipelines: Sequence[str], sources: Mapping[str, PipelineSource], stall_seconds: float,
                          minimum_interval_seconds: int = 30) -> dg.SensorDefinition:
    @dg.sensor(name="redrive_stall_watch", minimum_interval_seconds=minimum_interval_seconds,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description=f"Watches every pipeline's progress: due work and nothing settled for {stall_seconds:g} s "
                           "is a stall (one alert, a failing `pipeline_progressing` check), cleared when it moves.")
    def _sensor(context: dg.SensorEvaluationContext, reliability: ReliabilityResource):
        runtime = reliability.runtime()
        tick = watch_stalls(runtime, pipelines, sources, stall_seconds)
        stalled = sorted(p for p, s in tick.states.items() if s.stalled_since is not None)
        context.log.info(f"stalled: {', '.join(stalled) or 'none'}")
        return dg.SensorResult(asset_events=stall_evaluations(tick, runtime.now(), stall_seconds))

    return _sensor
