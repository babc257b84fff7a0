"""The Dagster UI as an operator meets it (issue 16 §4): owners and groups, backlog checks that report on their own."""

from __future__ import annotations

from datetime import timedelta

import dagster as dg
import sqlalchemy as sa

from assets import backlog
from orchestration.registry import PIPELINES
from redrive import work
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from redrive.settings import Settings


def test_every_asset_has_owners_and_a_group(settings: Settings) -> None:
    """Walk the asset graph the code location serves: an asset without owners or with the default group fails here."""
    from orchestration.definitions import build_definitions

    graph = build_definitions(settings).resolve_asset_graph()
    keys = list(graph.get_all_asset_keys())
    assert {backlog.backlog_key(p.name) for p in PIPELINES} <= set(keys)  # the walk saw every pipeline's backlog
    lacking = sorted(k.to_user_string() for k in keys
                     if not graph.get(k).owners or graph.get(k).group_name in (None, "default"))
    assert lacking == []
    assert {graph.get(backlog.backlog_key(p.name)).group_name for p in PIPELINES} == {p.name for p in PIPELINES}


def test_backlog_verdicts() -> None:
    """Pure: a letter older than the limit or due work waiting longer than the limit fails; none at all passes."""
    assert backlog.stale_letters_verdict(0, 0, 24).passed
    assert backlog.stale_letters_verdict(3, 23 * 3600, 24).passed
    stale = backlog.stale_letters_verdict(3, 25 * 3600, 24)
    assert not stale.passed and stale.severity == dg.AssetCheckSeverity.WARN and "25.0 h" in stale.description
    assert backlog.due_flowing_verdict(0, 0, 900).passed
    assert backlog.due_flowing_verdict(5, 899, 900).passed
    stuck = backlog.due_flowing_verdict(5, 901, 900)
    assert not stuck.passed and stuck.severity == dg.AssetCheckSeverity.ERROR


def test_the_sensor_reports_failing_checks_without_a_run_and_the_check_runs_on_its_own(
        defs, instance, engine, scaled_settings) -> None:
    """An old evidence dead letter and stuck criticizer work fail their checks: reported by the sensor's tick
    (no run started), and the same verdicts when an operator executes the check from the asset page."""
    runtime = defs.resources["reliability"].runtime()
    now = runtime.now()
    runtime.fail_for_good(FinalFailure(pipeline="evidence", stage="attach", entity_ref="art-1",
                                       failure=Failure.of(Code.AUTH_DENIED), attempts=3,
                                       at=now - timedelta(hours=30)))
    with engine.begin() as conn:  # the dead letter's first failure is when the entity first failed
        conn.execute(sa.text("UPDATE dead_letters SET first_failure_at = :t"), {"t": now - timedelta(hours=30)})
        work.enqueue(conn, "criticizer", "req-1", now=now - timedelta(hours=2))

    sensor = defs.resolve_sensor_def("redrive_pipeline_backlog")
    with dg.build_sensor_context(instance=instance, resources=defs.resources,
                                 repository_def=defs.get_repository_def()) as context:
        result = sensor.evaluate_tick(context)
    assert result.run_requests == []
    verdicts = {(e.asset_key.to_user_string(), e.check_name): e.passed for e in result.asset_events}
    assert len(verdicts) == 3 * len(PIPELINES)  # stale letters, due work flowing, pipeline progressing
    failing = sorted(k for k, passed in verdicts.items() if not passed)
    assert failing == [("criticizer_backlog", "due_work_flowing"), ("evidence_backlog", "no_stale_dead_letters")]

    run = defs.resolve_job_def(backlog.CHECKS_JOB).execute_in_process(instance=instance, raise_on_error=False)
    assert run.success  # a failing check is a red check, not a crashed run
    executed = {(e.asset_key.to_user_string(), e.check_name): e for e in run.get_asset_check_evaluations()}
    assert {k: e.passed for k, e in executed.items()} == verdicts
    assert executed[("evidence_backlog", backlog.STALE_LETTERS)].metadata["open_dead_letters"].value == 1
