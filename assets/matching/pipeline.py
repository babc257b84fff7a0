"""Document matching on SQS (000): the drain job the queue sensor starts, set-up, and re-queueing.

The worker itself (the per-message flow) is `assets.matching.worker`; ops here only build it
from resources, run it and report counts. A rerun is always safe: SQS hands out each message
to one receiver at a time, a duplicate delivery recomputes the same edges, and the write phase
is one transaction serialized per tenant.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

import asyncio
from collections.abc import Sequence
from typing import Any

import dagster as dg

from assets.matching import ingestion, repository, worker
from assets.matching.policy import PIPELINE, STATUSES
from redrive.drain_ops import DRAIN_TAG
from redrive.stages import OP_RETRY_POLICY, sanitized_body
from resources.database import PostgresResource
from resources.llm import LlmResource
from resources.matching import MatchingResource
from resources.reliability import ReliabilityResource
from assets.matching.settings import MatchingSettings
from redrive.settings import Settings


class DrainConfig(dg.Config):
    max_batches: int | None = None  # default: MATCHING_MAX_BATCHES_PER_RUN
    wait_seconds: int | None = None  # long poll of each receive; default: MATCHING_RECEIVE_WAIT_SECONDS
    # Rehearsals only: shrink the 5 / 30 minute visibility steps for this run (default: the setting).
    visibility_scale: float | None = None


def build_worker(context: dg.OpExecutionContext, reliability: ReliabilityResource, matching: MatchingResource,
                 llm: LlmResource, visibility_scale: float | None = None) -> worker.Worker:
    runtime = reliability.runtime()
    scale = runtime.time_scale
    return worker.Worker(
        runtime=runtime,
        queue=matching.queue(),
        llm=llm,
        config=worker.WorkerConfig(
            max_receive_count=matching.max_receive_count,
            visibility_timeout=matching.visibility_timeout_seconds,
            visibility_scale=visibility_scale or matching.visibility_scale or scale,
            llm_max_attempts=matching.llm_max_attempts,
            candidate_limit=matching.candidate_limit,
            batch_size=matching.batch_size,
            in_flight=matching.in_flight,
        ),
        admin_link=matching.admin_link,
        sleep=lambda seconds: asyncio.sleep(seconds * scale),  # REDRIVE_TIME_SCALE shrinks 2 s → 4 s → 8 s
        run_id=context.run_id,
        log=context.log,
    )


@dg.op(retry_policy=OP_RETRY_POLICY)
@sanitized_body
def drain_matching_queue(context: dg.OpExecutionContext, config: DrainConfig, reliability: ReliabilityResource,
                         matching: MatchingResource, llm: LlmResource) -> dg.Output:
    """Receive matching messages in batches and apply 000's per-message flow to each."""
    work = build_worker(context, reliability, matching, llm, config.visibility_scale)
    report = work.drain(
        max_batches=config.max_batches or matching.max_batches_per_run,
        wait_seconds=matching.receive_wait_seconds if config.wait_seconds is None else config.wait_seconds,
    )
    counts = report.counts
    context.log.info(f"matching: {len(report.outcomes)} deliveries in {report.batches} batches: {counts}")
    if report.unhandled:
        # the flow's own bookkeeping broke (database or SQS); the messages stay in SQS and come back
        raise dg.Failure(
            description=f"{len(report.unhandled)} deliveries left for redelivery: "
                        f"{sorted({o.code or '-' for o in report.unhandled})}",
            metadata={"counts": dg.MetadataValue.json(counts)},
            allow_retries=False,  # SQS redelivers them (000's durable timer); the op's RetryPolicy must not
        )
    return dg.Output(
        counts,
        metadata={
            "deliveries": len(report.outcomes),
            "batches": report.batches,
            **{k: v for k, v in counts.items()},
            "llm_calls": sum(o.llm_calls for o in report.outcomes),
            "edges_written": sum(o.edges for o in report.outcomes),
        },
    )


# A drain run: its entities are SQS messages that come back after their visibility timeout when the run dies, so a
# killed run is alerted once and never dead-lettered as `run:<id>` (a letter no replay could act on; chaos run).
@dg.job(tags={"redrive/pipeline": PIPELINE, DRAIN_TAG: "true"})
def matching_drain_job() -> None:
    """Drain the matching queue: match each document, retry through SQS visibility, fail to the DLQ."""
    drain_matching_queue()


@dg.op(retry_policy=OP_RETRY_POLICY)
@sanitized_body
def matching_setup(context: dg.OpExecutionContext, matching: MatchingResource,
                   database: PostgresResource) -> dg.Output:
    """Create the matching queue and its DLQ (60 s visibility, redrive after 3 receives), idempotently."""
    del database  # not queried: the resource is what makes this run beat for the run watchdog (redrive.liveness)
    queue = matching.queue()
    url = queue.ensure()
    attrs = queue.attributes()
    return dg.Output(url, metadata={"queue_url": url, "redrive_policy": attrs.get("RedrivePolicy", ""),
                                    "visibility_timeout": attrs.get("VisibilityTimeout", "")})


@dg.job(tags={"redrive/pipeline": PIPELINE})
def matching_setup_job() -> None:
    """Set-up: the matching queue and its DLQ in SQS."""
    matching_setup()


class RequeueConfig(dg.Config):
    document_ids: list[str] = []
    tenant: str | None = None
    statuses: list[str] = []  # e.g. ["failed"], ["pending"] for documents whose publish was lost
    include_never_queued: bool = False  # backfill: matchable documents from before the feature
    limit: int = 10000
    # set by the core's replay sensor
    replay_of: int | None = None
    replay_from: str | None = None
    stage: str | None = None
    attempt: int | None = None


@dg.op(retry_policy=OP_RETRY_POLICY)
@sanitized_body
def requeue_for_matching(context: dg.OpExecutionContext, config: RequeueConfig, reliability: ReliabilityResource,
                         matching: MatchingResource) -> dg.Output:
    """Replay or backfill: set documents back to pending and publish their ids again."""
    unknown = sorted(set(config.statuses) - set(STATUSES))
    if unknown:
        raise dg.Failure(description=f"unknown matching status {unknown}; use {list(STATUSES)}",
                         allow_retries=False)
    runtime = reliability.runtime()
    ids = list(config.document_ids)
    if config.statuses or config.include_never_queued:
        with runtime.engine.connect() as conn:
            ids += repository.select_for_requeue(conn, tenant=config.tenant, statuses=config.statuses,
                                                 include_never_queued=config.include_never_queued,
                                                 limit=config.limit)
    queued = ingestion.requeue(runtime.engine, matching.queue(), sorted(set(ids)))
    missing = sorted(set(ids) - set(queued))
    context.log.info(f"matching: re-queued {len(queued)} documents"
                     + (f"; {len(missing)} unknown ids skipped" if missing else ""))
    return dg.Output(len(queued), metadata={"requeued": len(queued), "unknown": len(missing)})


@dg.job(tags={"redrive/pipeline": PIPELINE})
def matching_requeue_job() -> None:
    """Re-queue documents for matching (dead-letter replay, backfill of failed or never-queued documents)."""
    requeue_for_matching()


def requeue_run_config(document_id: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The core's replay sensor: a dead letter's entity is a document id (or an SQS message id)."""
    allowed = {k: v for k, v in extra.items() if k in RequeueConfig.model_fields and k != "document_ids"}
    ids = [] if document_id.startswith("sqs-message:") else [document_id]
    return {"ops": {"requeue_for_matching": {"config": {"document_ids": ids, **allowed}}}}


def batch_requeue_run_config(document_ids: Sequence[str]) -> dict[str, Any]:
    """Several replays in one run: their documents published again (a quarantined message has none)."""
    ids = [d for d in document_ids if not d.startswith("sqs-message:")]
    return {"ops": {"requeue_for_matching": {"config": {"document_ids": ids}}}}


def matching_resource(settings: Settings, matching: MatchingSettings) -> MatchingResource:
    """The pipeline's queue and knobs as the resource its ops, sensors and commands use."""
    return MatchingResource(
        endpoint_url=settings.aws_endpoint_url,
        region_name=settings.aws_region,
        queue_name=matching.queue_name,
        dlq_name=matching.dlq_name,
        visibility_timeout_seconds=matching.visibility_timeout_seconds,
        max_receive_count=matching.max_receive_count,
        batch_size=matching.batch_size,
        in_flight=matching.in_flight,
        max_batches_per_run=matching.max_batches_per_run,
        receive_wait_seconds=matching.receive_wait_seconds,
        max_concurrent_drains=matching.max_concurrent_drains,
        visibility_scale=matching.visibility_scale,
        llm_max_attempts=matching.llm_max_attempts,
        candidate_limit=matching.candidate_limit,
        stuck_after_seconds=matching.stuck_after_seconds,
        admin_document_url=matching.admin_document_url,
    )
