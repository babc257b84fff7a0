"""The pruner at the Dagster edge: one op on an hourly schedule, and Dagster's own run storage.

`prune_expired` applies every retention rule (the pipelines' from the registry, then the core's:
:func:`orchestration.registry.retention_rules`) through the one loop in :mod:`redrive.retention`,
then deletes old runs of drain and maintenance jobs through Dagster's instance API (failed runs are
kept longer); runs of asset jobs stay, since their event logs are the assets' materialization and
partition history. Ticks are Dagster's to prune: `retention:` in dagster.yaml.example.
`redrive retention plan|run` (orchestration/cli.py) is the same without Dagster.
"""

# No `from __future__ import annotations`: Dagster reads config types from live annotations.

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import dagster as dg

from orchestration.registry import retention_rules
from redrive import retention
from redrive.drain_ops import DRAIN_TAG
from redrive.settings import Settings
from redrive.stages import sanitized_body
from resources.reliability import ReliabilityResource

MAINTENANCE_TAG = "redrive/maintenance"  # a run of the core's upkeep (this pruner, the healthcheck, backlog checks)

# The op's own infrastructure (PostgreSQL unreachable mid-run): retried with backoff; a batch it was in
# rolled back, and the rules pick up where the rows say.
RETENTION_RETRY_POLICY = dg.RetryPolicy(max_retries=3, delay=30.0, backoff=dg.Backoff.EXPONENTIAL,
                                        jitter=dg.Jitter.PLUS_MINUS)

PRUNED_RUN_STATUSES = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.CANCELED)
FAILED_RUN_STATUSES = (dg.DagsterRunStatus.FAILURE,)


@dataclass
class RunsPruned:
    deleted: dict[str, int] = field(default_factory=dict)  # "<tag> <status>" → runs deleted

    @property
    def total(self) -> int:
        return sum(self.deleted.values())


def prune_dagster_runs(instance: dg.DagsterInstance, now: datetime, settings: Settings, *, limit: int = 500,
                       pause_seconds: float = 0.0, sleep: Callable[[float], None] = time.sleep) -> RunsPruned:
    """Delete finished runs of drain and maintenance jobs older than their window, at most ``limit`` a kind
    per call (the next tick goes on): succeeded or canceled after `retention_dagster_run_days`, failed
    after `retention_dagster_failed_run_days`. A run still queued or running is never touched."""
    out = RunsPruned()
    windows = ((PRUNED_RUN_STATUSES, settings.retention_dagster_run_days),
               (FAILED_RUN_STATUSES, settings.retention_dagster_failed_run_days))
    for tag in (DRAIN_TAG, MAINTENANCE_TAG):
        for statuses, days in windows:
            if days <= 0:
                continue
            records = instance.get_run_records(
                filters=dg.RunsFilter(tags={tag: "true"}, statuses=list(statuses),
                                      updated_before=now - timedelta(days=days)),
                limit=limit, ascending=True)
            for record in records:
                instance.delete_run(record.dagster_run.run_id)  # its event log goes with it
            key = f"{tag} {'/'.join(s.value.lower() for s in statuses)}"
            out.deleted[key] = len(records)
            if records and pause_seconds:
                sleep(pause_seconds)
    return out


def retention_defs(settings: Settings) -> tuple[dg.JobDefinition, dg.ScheduleDefinition]:
    """The pruner's job and its hourly schedule (running by default: a deployment prunes from day one)."""

    @dg.op(name="prune_expired", retry_policy=RETENTION_RETRY_POLICY,
           description="Remove expired rows and files (every retention rule), then old drain and maintenance runs.")
    @sanitized_body
    def prune_expired(context: dg.OpExecutionContext, reliability: ReliabilityResource) -> dg.Output:
        runtime = reliability.runtime()
        started = time.monotonic()
        pruned = retention.prune(runtime.engine, retention_rules(settings), settings, runtime.now(),
                                 batch_size=settings.retention_batch_size,
                                 pause_seconds=settings.retention_pause_seconds,
                                 max_seconds=settings.retention_max_run_seconds)
        runs = prune_dagster_runs(context.instance, runtime.now(), settings)
        context.log.info(f"pruned {pruned.total} rows in {pruned.batches} batches ({pruned.files} files) and "
                         f"{runs.total} Dagster runs in {time.monotonic() - started:.1f}s"
                         + ("" if pruned.complete else "; stopped at its time limit, the next run goes on"))
        metadata: dict[str, Any] = {
            "rows": dg.MetadataValue.int(pruned.total), "batches": dg.MetadataValue.int(pruned.batches),
            "files": dg.MetadataValue.int(pruned.files), "complete": dg.MetadataValue.bool(pruned.complete),
            "by_rule": dg.MetadataValue.json({k: v for k, v in pruned.rows.items() if v}),
            "dagster_runs": dg.MetadataValue.json(runs.deleted),
        }
        return dg.Output({"rows": pruned.rows, "dagster_runs": runs.deleted}, metadata=metadata)

    @dg.graph(name="retention_graph")
    def _graph() -> None:
        prune_expired()

    job = _graph.to_job(name="retention_job", executor_def=dg.in_process_executor,
                        description="Removes what the retention policy says has expired (docs/operating.md, "
                                    "Retention); never anything open, due, leased, retrying or dead-lettered.",
                        tags={MAINTENANCE_TAG: "true"})
    schedule = dg.ScheduleDefinition(name="retention_schedule", job=job, cron_schedule="17 * * * *",
                                     default_status=dg.DefaultScheduleStatus.RUNNING,
                                     description="Prunes expired rows, files and old runs every hour.")
    return job, schedule
