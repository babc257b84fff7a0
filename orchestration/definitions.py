"""The single Definitions of the redrive code location (loaded by workspace.yaml)."""

from __future__ import annotations

import logging
import warnings

import dagster as dg

from assets.backlog import backlog_defs
from assets.healthcheck import stack_healthcheck
from orchestration.jobs import healthcheck_job
from orchestration.metrics import pipeline_sources
from orchestration.registry import load_pipelines
from orchestration.retention import retention_defs
from redrive import logs
from redrive.settings import Settings
from resources.factory import build_resources
from sensors.core import (
    alert_delivery_sensor,
    dead_letter_reconciliation_sensor,
    asset_pipelines_of,
    dead_letter_replay_sensor,
    deferred_retry_sensor,
    pipeline_backlog_sensor,
    pipeline_stall_sensor,
    declined_retry_sensor,
    run_failure_alert_sensor,
    run_watchdog_sensor,
)


def build_definitions(settings: Settings | None = None) -> dg.Definitions:
    """Build everything from settings read now, never at import time of a module."""
    settings = settings or Settings()
    logs.configure(replace=False, only_if_set=True)
    logs.one_line_per_run_record()
    # Beta and preview features we chose on purpose (sensor owners, partitioned checks, dagster.yaml's python_logs
    # handler): not repeated by every process that loads the location (the code server, each run worker) into
    # its log, every time Dagster touches them. Whatever else warns still does.
    for category in (dg.BetaWarning, dg.PreviewWarning):
        warnings.filterwarnings("ignore", category=category)
    pipelines = load_pipelines(settings)
    replay_targets = {k: v for p in pipelines for k, v in p.replay_targets.items()}
    failed_for_good = {k: v for p in pipelines for k, v in p.failed_for_good.items()}
    resources = build_resources(settings)
    for p in pipelines:
        resources.update(p.resources)
    names, sources = [p.name for p in pipelines], pipeline_sources()
    backlogs, backlog_checks, backlog_job = backlog_defs(names, sources, settings.dead_letter_max_age_hours,
                                            settings.due_work_max_wait_seconds, settings.pipeline_stall_seconds)
    assets = [stack_healthcheck, *backlogs, *[a for p in pipelines for a in p.assets]]
    retention_job, retention_schedule = retention_defs(settings)
    return dg.Definitions(
        assets=assets,
        asset_checks=[*backlog_checks, *[c for p in pipelines for c in p.asset_checks]],
        jobs=[healthcheck_job, backlog_job, retention_job, *[j for p in pipelines for j in p.jobs]],
        schedules=[retention_schedule, *[s for p in pipelines for s in p.schedules]],
        sensors=[
            alert_delivery_sensor(),
            run_failure_alert_sensor(asset_pipelines_of(a for a in assets if isinstance(a, dg.AssetsDefinition))),
            declined_retry_sensor(asset_pipelines_of(a for a in assets if isinstance(a, dg.AssetsDefinition)),
                                  jobs=[j for p in pipelines for j in p.jobs]),
            dead_letter_replay_sensor(replay_targets),
            dead_letter_reconciliation_sensor(failed_for_good),
            *[deferred_retry_sensor(name, target) for name, target in replay_targets.items()],
            pipeline_backlog_sensor(names, sources, settings.dead_letter_max_age_hours,
                                    settings.due_work_max_wait_seconds, stall_seconds=settings.pipeline_stall_seconds),
            run_watchdog_sensor(settings.run_dead_after_seconds),
            pipeline_stall_sensor(names, sources, settings.pipeline_stall_seconds),
            *[s for p in pipelines for s in p.sensors],
        ],
        resources=resources,
        # Every job's ops run in the run's own process: a step process per op would load the code location
        # again (~4 CPU-s each) for jobs whose ops are sequential anyway. No job here has parallel ops that pay.
        executor=dg.in_process_executor,
    )


_prebuilt: dg.Definitions | None = None


def prebuild() -> None:
    """Build the Definitions once in the process every run's process is forked from (orchestration.code_server),
    so a run starts with them built. A failure is left to each run to meet and report as its own; it is said here
    in one line (its class only: the message may carry configuration), since every run then builds them again."""
    global _prebuilt
    try:
        _prebuilt = build_definitions()
    except Exception as exc:  # noqa: BLE001 - the run that builds them again fails with it, in its own event log
        _prebuilt = None
        logging.getLogger(__name__).warning(
            "the code server's forkserver could not build the Definitions (%s): each run builds them itself",
            type(exc).__name__)


@dg.definitions
def defs() -> dg.Definitions:
    return _prebuilt if _prebuilt is not None else build_definitions()
