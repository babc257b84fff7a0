"""The run watchdog and the stall watch through Dagster's instance (issue 25), with injected clocks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import dagster as dg
import sqlalchemy as sa
from prometheus_client.core import REGISTRY  # noqa: F401 - the collector is registered per test below

from assets import backlog
from redrive import liveness, metrics, observations, work
from redrive.clock import FrozenClock
from redrive.reliability import Reliability
from redrive.schema import alerts
from sensors.core import fail_silent_runs, stall_evaluations, watch_stalls
from tests.dagster_helpers import evaluate_failure_sensor, tick


def runtime(engine: sa.Engine, clock: FrozenClock) -> Reliability:
    return Reliability(engine=engine, clock=clock)


def started_run(defs, instance, job_name: str = "criticizer_job") -> dg.DagsterRun:
    job = defs.resolve_job_def(job_name)
    return instance.create_run_for_job(job_def=job, tags=job.tags, status=dg.DagsterRunStatus.STARTED)


def test_a_silent_drain_run_is_failed_its_leases_come_back_and_the_next_round_is_requested(
        defs, instance, engine, sandbox, monkeypatch) -> None:
    """The worker of a drain run died where it could not report (PostgreSQL away, its backend cut): no beat for
    longer than the window → the watchdog fences it, gives its leased rows back due now, fails the run through
    Dagster (a RUN_FAILURE the run-failure sensor and run retries see), and the due-work sensor starts the next
    round. A second tick changes nothing."""
    clock = FrozenClock(datetime.now(UTC))
    monkeypatch.setattr("resources.reliability.SystemClock", lambda: clock)  # the sensors read this clock too
    run = started_run(defs, instance)
    with engine.begin() as conn:
        for i in range(3):
            work.enqueue(conn, "criticizer", f"w-{i}", now=clock.now())
        held = work.claim(conn, "criticizer", owner=liveness.holder_of(run.run_id), limit=3, lease_seconds=600,
                          now=clock.now())
        assert liveness.beat(conn, liveness.holder_of(run.run_id), run.run_id, now=clock.now())
    assert len(held) == 3
    assert not tick(defs, instance, "criticizer_due_work")  # "a drain run is already working"

    clock.advance(60)
    assert fail_silent_runs(runtime(engine, clock), instance, dead_after=90) == []  # inside the window
    clock.advance(31)
    [failed] = fail_silent_runs(runtime(engine, clock), instance, dead_after=90)
    assert failed.run_id == run.run_id and failed.silent_seconds > 90
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
    [record] = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.RUN_FAILURE).records
    assert "no heartbeat" in record.event_log_entry.dagster_event.message
    with engine.connect() as conn:
        assert {work.state(conn, "criticizer", i.entity_ref).status for i in held} == {"due"}
        assert liveness.is_dead(conn, liveness.holder_of(run.run_id))
    assert fail_silent_runs(runtime(engine, clock), instance, dead_after=90) == []  # not STARTED any more

    [request] = tick(defs, instance, "criticizer_due_work")  # the next round starts
    assert request.job_name == "criticizer_job" and request.tags["redrive/due"] == "3"
    evaluate_failure_sensor(defs, instance, run.run_id)  # the run-failure sensor tells the operator once
    with engine.connect() as conn:
        kinds = conn.execute(sa.select(alerts.c.kind)).scalars().all()
    assert kinds == ["drain_run_failed"]


def test_a_slow_run_that_beats_is_left_alone_and_a_run_that_never_beat_is_failed_after_its_window(
        defs, instance, engine) -> None:
    """A run whose worker keeps beating (one long call) stays STARTED for ten minutes; a conversion worker run (not
    a drain) whose worker died before its first beat is failed once the window from its start has passed."""
    clock = FrozenClock(datetime.now(UTC))
    slow = started_run(defs, instance)
    never = started_run(defs, instance, "conversion_worker_job")
    hb = liveness.Heartbeat(engine, slow.run_id, now=clock.now)
    failed = []
    for _ in range(60):
        clock.advance(10)
        assert hb.beat_once()
        failed += fail_silent_runs(runtime(engine, clock), instance, dead_after=90)
    assert [s.run_id for s in failed] == [never.run_id]
    assert instance.get_run_by_id(slow.run_id).status == dg.DagsterRunStatus.STARTED
    assert instance.get_run_by_id(never.run_id).status == dg.DagsterRunStatus.FAILURE
    assert not hb.fenced.is_set()


def _stalled_alerts(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return conn.execute(sa.select(alerts.c.pipeline).where(alerts.c.kind == "pipeline_stalled")).scalars().all()


def _gauge(engine: sa.Engine, clock: FrozenClock, name: str, pipeline: str) -> float:
    collector = metrics.PipelineCollector(engine, clock, ["demo", "idle"])
    for family in collector.collect():
        for sample in family.samples:
            if sample.name == name and sample.labels.get("pipeline") == pipeline:
                return sample.value
    raise AssertionError(f"{name} not served for {pipeline}")


def test_a_stalled_pipeline_raises_one_alert_and_a_failing_check_and_both_clear_when_it_moves(engine) -> None:
    """Due work and nothing settled for longer than the limit: one `pipeline_stalled` alert (however many ticks
    see it), a failing `pipeline_progressing` check and the stall metrics; when an attempt settles again the check
    passes and the metric drops. A pipeline with nothing due is never stalled."""
    clock = FrozenClock(datetime(2026, 11, 23, 9, 0, tzinfo=UTC))
    rt = runtime(engine, clock)
    pipelines = ["demo", "idle"]
    with engine.begin() as conn:
        for i in range(5):
            work.enqueue(conn, "demo", f"s-{i}", now=clock.now())
    first = watch_stalls(rt, pipelines, {}, 180)
    assert first.changes == {"demo": "seen", "idle": "seen"}  # first sight: the check is reported once
    assert all(e.passed for e in stall_evaluations(first, clock.now(), 180))

    for _ in range(6):  # 3 minutes of ticks with nothing settled: still inside the limit
        clock.advance(30)
        assert watch_stalls(rt, pipelines, {}, 180).changes == {}
    clock.advance(30)
    stalled = watch_stalls(rt, pipelines, {}, 180)
    assert stalled.changes == {"demo": "stalled"}
    [evaluation] = stall_evaluations(stalled, clock.now(), 180)
    assert (evaluation.asset_key, evaluation.check_name, evaluation.passed) == (
        backlog.backlog_key("demo"), backlog.PROGRESSING, False)
    for _ in range(5):
        clock.advance(30)
        assert watch_stalls(rt, pipelines, {}, 180).changes == {}
    assert _stalled_alerts(engine) == ["demo"]  # one alert per stall
    assert _gauge(engine, clock, "redrive_pipeline_stalled", "demo") == 1.0
    assert _gauge(engine, clock, "redrive_pipeline_seconds_without_progress", "demo") == 360.0
    assert _gauge(engine, clock, "redrive_pipeline_stalled", "idle") == 0.0
    [check] = [v for v in backlog.verdicts(rt, ["demo"], {}, 24, 900, 180)["demo"] if v.check == backlog.PROGRESSING]
    assert not check.passed

    with engine.begin() as conn:  # it moves: one attempt settles
        observations.observe(conn, "demo", "work", observations.DONE)
    clock.advance(30)
    moved = watch_stalls(rt, pipelines, {}, 180)
    assert moved.changes == {"demo": "cleared"}
    assert [e.passed for e in stall_evaluations(moved, clock.now(), 180)] == [True]
    assert _gauge(engine, clock, "redrive_pipeline_stalled", "demo") == 0.0
    assert _gauge(engine, clock, "redrive_pipeline_seconds_without_progress", "demo") == 0.0
    assert backlog.verdicts(rt, ["demo"], {}, 24, 900, 180)["demo"][2].passed
    assert _stalled_alerts(engine) == ["demo"]


def test_a_stall_policy_never_counts_idle_time() -> None:
    """Pure: time with nothing due does not count towards a stall; the clock starts when work falls due."""
    from redrive.stalls import next_state

    t0 = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
    state, _ = next_state(None, progress=0, due=0, now=t0, limit=180)
    state, change = next_state(state, progress=0, due=0, now=t0 + timedelta(hours=2), limit=180)
    assert change is None and state.stalled_since is None
    state, change = next_state(state, progress=0, due=4, now=t0 + timedelta(hours=2, seconds=10), limit=180)
    assert change is None and state.seconds_without_progress(t0 + timedelta(hours=2, seconds=10)) == 0
    state, change = next_state(state, progress=0, due=4, now=t0 + timedelta(hours=2, seconds=191), limit=180)
    assert change == "stalled"
    state, change = next_state(state, progress=0, due=0, now=t0 + timedelta(hours=3), limit=180)
    assert change == "cleared"  # nothing left to do is not a stall either


def test_every_run_that_uses_the_core_beats_while_it_runs_and_stops_when_it_ends(defs, instance, engine) -> None:
    """A run's resources start its heartbeat (one per run however many resources ask) and stop it at the end."""
    result = defs.resolve_job_def("pipeline_backlog_checks").execute_in_process(instance=instance)
    assert result.success
    with engine.connect() as conn:
        beats = liveness.last_beats(conn, [result.run_id])
    assert list(beats) == [result.run_id] and beats[result.run_id][1] is None  # it beat, and is not dead
    assert result.run_id not in liveness._running  # stopped with the run


def test_every_job_of_the_code_location_beats(defs) -> None:
    """Every job's ops use a resource that starts the run's heartbeat (`reliability` or `database`): a job that did
    not would be failed by the watchdog a window after it started, however alive."""
    silent = []
    for job in defs.get_repository_def().get_all_jobs():
        keys = set().union(*(set(node.required_resource_keys) for node in job.graph.node_defs))
        if not keys & {"reliability", "database"}:
            silent.append(job.name)
    assert silent == []
