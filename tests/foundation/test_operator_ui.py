"""The Dagster UI as an operator meets it (issue 16 §4): owners and groups, backlog checks that report on their own."""

from __future__ import annotations

from datetime import timedelta

import dagster as dg
import sqlalchemy as sa

from click.testing import CliRunner

from assets import backlog
from orchestration.cli import app
from orchestration.demo import evaluate_sensor_tick
from orchestration.registry import PIPELINES
from redrive import work
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from redrive.settings import Settings
from tests.dagster_helpers import DagsterUi


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
    # the first tick reports every check (none shows "–"): open letters, stale letters, due work flowing, progressing
    assert len(verdicts) == 4 * len(PIPELINES)
    failing = sorted(k for k, passed in verdicts.items() if not passed)
    assert failing == [("criticizer_backlog", "due_work_flowing"), ("evidence_backlog", "no_open_dead_letters"),
                       ("evidence_backlog", "no_stale_dead_letters")]

    run = defs.resolve_job_def(backlog.CHECKS_JOB).execute_in_process(instance=instance, raise_on_error=False)
    assert run.success  # a failing check is a red check, not a crashed run
    executed = {(e.asset_key.to_user_string(), e.check_name): e for e in run.get_asset_check_evaluations()}
    assert {k: e.passed for k, e in executed.items()} == verdicts
    assert executed[("evidence_backlog", backlog.STALE_LETTERS)].metadata["open_dead_letters"].value == 1


def test_open_letters_verdict() -> None:
    """Pure: any unresolved letter fails the ERROR check, naming its classes, most first; none passes."""
    assert backlog.open_letters_verdict("matching", {}).passed
    v = backlog.open_letters_verdict("matching", {"AUTH_DENIED": 1, "SCHEMA_INVALID": 3})
    assert not v.passed and v.severity == dg.AssetCheckSeverity.ERROR and v.count == 4
    assert v.description.startswith("4 unresolved dead letter(s): 3 SCHEMA_INVALID, 1 AUTH_DENIED;")


def test_backlog_news_reports_changes_at_once_and_the_rest_on_refresh() -> None:
    """Pure: the first tick reports every verdict; an unchanged one waits for the refresh; a change goes at once."""
    quiet = {"matching": [backlog.open_letters_verdict("matching", {})]}
    events, cursor = backlog.news(quiet, {}, now=1000.0, refresh_seconds=300)
    assert [e.check_name for e in events] == [backlog.OPEN_LETTERS]
    assert backlog.news(quiet, cursor, now=1030.0, refresh_seconds=300)[0] == []
    assert len(backlog.news(quiet, cursor, now=1300.0, refresh_seconds=300)[0]) == 1
    loud = {"matching": [backlog.open_letters_verdict("matching", {"AUTH_DENIED": 1})]}
    [event], cursor = backlog.news(loud, cursor, now=1031.0, refresh_seconds=300)
    assert not event.passed and cursor["matching/no_open_dead_letters"] == [[False, 1], 1031.0]


def test_a_dead_letter_is_a_failing_check_on_the_next_tick_and_clears_on_resolve(
        defs, instance, engine, db_url) -> None:
    """As the UI reads it (GraphQL): a new criticizer dead letter turns `no_open_dead_letters` on
    `criticizer_backlog` red on the sensor's next tick (30 s), before any refresh is due; `redrive dlq
    resolve` turns it green on the tick after; other pipelines' checks stay green."""
    sensor = defs.resolve_sensor_def("redrive_pipeline_backlog")
    assert sensor.minimum_interval_seconds <= 30
    runtime = defs.resources["reliability"].runtime()
    with DagsterUi(defs, instance) as ui:
        first = evaluate_sensor_tick(defs, instance, sensor.name)
        assert first.asset_events == 4 * len(PIPELINES)  # open letters, stale letters, due work, progressing
        assert ui.latest_check("criticizer_backlog", backlog.OPEN_LETTERS)[0] == "SUCCEEDED"

        letter = runtime.fail_for_good(FinalFailure(
            pipeline="criticizer", stage="llm", entity_ref="req-7", attempts=4, at=runtime.now(),
            failure=Failure.of(Code.SCHEMA_INVALID, message="the answer is not a critique"))).dead_letter
        second = evaluate_sensor_tick(defs, instance, sensor.name, first.cursor)
        assert second.asset_events == 2  # what changed: criticizer's open and stale counts; no refresh yet
        status, description = ui.latest_check("criticizer_backlog", backlog.OPEN_LETTERS)
        assert status == "FAILED" and description.startswith("1 unresolved dead letter(s): 1 SCHEMA_INVALID")
        assert ui.latest_check("matching_backlog", backlog.OPEN_LETTERS)[0] == "SUCCEEDED"

        out = CliRunner().invoke(app, ["dlq", "resolve", str(letter.id), "--note", "SUP-3: request withdrawn"],
                                 env={"DATABASE_URL": db_url}, catch_exceptions=False)
        assert out.exit_code == 0, out.output
        evaluate_sensor_tick(defs, instance, sensor.name, second.cursor)
        assert ui.latest_check("criticizer_backlog", backlog.OPEN_LETTERS) == ("SUCCEEDED", "no unresolved dead letter")


def test_the_stall_watch_ticks_on_the_code_location_with_every_pipeline(defs, instance, engine) -> None:
    """The deployed `redrive_stall_watch`, with the registry's pipelines and their sources, evaluates without
    error: its first tick reports `pipeline_progressing` for every pipeline (passing: nothing has stalled), and
    a second tick with nothing changed reports nothing."""
    first = evaluate_sensor_tick(defs, instance, "redrive_stall_watch")
    assert first.asset_events == len(PIPELINES)
    with engine.connect() as conn:
        watched = set(conn.execute(sa.text("SELECT pipeline FROM pipeline_progress")).scalars())
    assert watched == {p.name for p in PIPELINES}
    assert evaluate_sensor_tick(defs, instance, "redrive_stall_watch").asset_events == 0
