"""The drain at the Dagster edge: one op per drain run, its retry policy, its executor, its config.

A drain run is one op in one process (`in_process_executor`): a second process would load
the code location again for nothing. Per-entity failures never fail the op: the drain
settles each entity (due again, or dead-lettered). What does fail the op is the run's own
infrastructure (PostgreSQL unreachable, the code broken): `DRAIN_RETRY_POLICY` retries it
with backoff and jitter, and the drain resumes where the rows say (leases fence the rest).
Whatever the op raises reaches Dagster's event log only as a sanitized one-line failure.
"""

# No `from __future__ import annotations`: Dagster reads config types from live annotations.

from collections.abc import Mapping
from typing import Any

import dagster as dg

from redrive.drain import Drain, DrainReport, Handler
from redrive.reliability import Reliability
from redrive.settings import cached_settings
from redrive.stages import StagePolicy, sanitized_failures  # noqa: F401 - also imported from here

DRAIN_TAG = "redrive/drain"  # a drain run: its entities are rows with leases, not the run itself
# on a drain run that dead-lettered entities: how many (the run is green; the run list and this tag say so,
# and the pipeline's `no_open_dead_letters` check turns red on the backlog sensor's next tick)
DRAIN_DEAD_LETTERED_TAG = "redrive/entities_dead_lettered"

# Unclassified and infrastructure failures of the op itself (database or S3 unreachable).
DRAIN_RETRY_POLICY = dg.RetryPolicy(max_retries=3, delay=2.0, backoff=dg.Backoff.EXPONENTIAL,
                                    jitter=dg.Jitter.PLUS_MINUS)


class DrainConfig(dg.Config):
    """Bounds of one drain run; the defaults suit the 2-core reference machine."""

    concurrency: int | None = None  # entities in flight at once; None: REDRIVE_DRAIN_IN_FLIGHT, else the pipeline's
    batch_size: int = 50  # rows leased per claim statement
    max_seconds: float = 600.0  # the run ends after this; the sensor starts the next round
    linger_seconds: float = 5.0  # wait this long for work falling due before ending
    max_items: int | None = None


def run_drain(context: dg.OpExecutionContext, runtime: Reliability, pipeline: str,
              policies: Mapping[str, StagePolicy], handle: Handler, config: DrainConfig, *,
              group_key: str | None = None, in_flight: int = 8) -> dg.Output:
    """Drain `pipeline`'s due work (of one group, e.g. a file job) and report the counts; `in_flight` is the
    pipeline's own default of entities at once (a coroutine handler's can be hundreds)."""
    in_flight = config.concurrency or cached_settings().drain_in_flight(pipeline, in_flight)
    drain = Drain(reliability=runtime, pipeline=pipeline, policies=policies, owner=f"run:{context.run_id}",
                  concurrency=in_flight, batch_size=config.batch_size, max_seconds=config.max_seconds,
                  linger_seconds=config.linger_seconds, max_items=config.max_items, run_id=context.run_id)
    with sanitized_failures(f"drain of {pipeline}"):
        report = drain.run(handle, group_key=group_key)
    context.log.info(_summary(pipeline, report))
    if report.dead_lettered:
        context.instance.add_run_tags(context.run_id, {DRAIN_DEAD_LETTERED_TAG: str(report.dead_lettered)})
    metadata: dict[str, Any] = {k: dg.MetadataValue.int(v) for k, v in report.as_metadata().items()}
    metadata["failures_by_class"] = dg.MetadataValue.json(report.failures)
    return dg.Output({**report.as_metadata(), "failures": report.failures, "retries": report.retry_log},
                     metadata=metadata)


def _summary(pipeline: str, report: DrainReport) -> str:
    return (f"{pipeline}: {report.claimed} claimed in {report.batches} batches; {report.done} done, "
            f"{report.retried} due again later, {report.dead_lettered} dead-lettered, "
            f"{report.lease_lost} lost to a reclaim, {report.deferred} retries deferred by an upstream's budget, "
            f"{report.infrastructure} attempts our database lost (not counted)")


def drain_job(name: str, pipeline: str, op: dg.OpDefinition, *, description: str,
              partitions_def: dg.PartitionsDefinition | None = None,
              tags: Mapping[str, str] | None = None) -> dg.JobDefinition:
    """A one-op job on the in-process executor, tagged with its pipeline (tag concurrency limits)."""

    @dg.graph(name=f"{name}_graph")
    def _graph() -> None:
        op()

    return _graph.to_job(name=name, description=description, executor_def=dg.in_process_executor,
                         partitions_def=partitions_def,
                         tags={"redrive/pipeline": pipeline, DRAIN_TAG: "true", **(tags or {})})

