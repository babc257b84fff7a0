"""Matchmaking (ADR-0004) in Dagster: the `daily_match_offers` asset, partitioned by date × timezone.

One run materializes one (date, timezone): every active user of that timezone whose job is not
completed gets their offers (batch.PartitionRun). Safe to rerun, backfill or run twice at once:
the ADR's upsert returns completed users instead of recomputing them, offers are a function of
the partition, the pool, the weights and the seed, and the database refuses a second set. A
partition where some users failed for good ends failed (so the operator sees it) after writing
everything else; its rerun touches only those users.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg
from pydantic import field_validator

from assets import OWNERS
from assets.matchmaking import batch, policy, repository
from assets.matchmaking.batch import Knobs, PartitionRun
from assets.matchmaking.policy import Partition, PartitionHealth, ScoringWeights
from assets.matchmaking.settings import MatchmakingSettings
from redrive import deadletters
from redrive.alerts import Alert
from redrive.reliability import Reliability
from redrive.stages import DEAD_LETTERED_TAG, OP_RETRY_POLICY, DeferredRetry, EntityRunFields, Unit, entity_run_config, run_stage, sanitized_body
from resources.http import ArtifactStoreResource
from resources.reliability import ReliabilityResource

PIPELINE = policy.PIPELINE
ASSET = "daily_match_offers"
JOB = "matchmaking_job"
CHECK_DUPLICATES = "zero_duplicate_offers"
CHECK_COMPLETION = "completion_rate_at_least_99_9_percent"


class MatchmakingRunConfig(EntityRunFields):
    """Optional: a replay names the users to redo; a plain run (schedule, backfill, UI) needs nothing."""

    user_ids: list[str] = []

    @field_validator("user_ids")
    @classmethod
    def _uuids(cls, value: list[str]) -> list[str]:
        out = []
        for v in value:
            try:
                out.append(str(uuid.UUID(v)))
            except ValueError:
                raise ValueError(f"user_ids: {v!r} is not a UUID") from None
        return out


def partitions_def(settings: MatchmakingSettings) -> dg.MultiPartitionsDefinition:
    # end_offset=2: a local date's 9 AM comes up to a day before that date starts in UTC (UTC+10…+14).
    return dg.MultiPartitionsDefinition({
        "date": dg.DailyPartitionsDefinition(start_date=settings.start_date.isoformat(), end_offset=2),
        "timezone": dg.StaticPartitionsDefinition(list(settings.timezones)),
    })


def partition_of(key: str | dg.MultiPartitionKey) -> Partition:
    keys = key.keys_by_dimension if isinstance(key, dg.MultiPartitionKey) else dict(
        zip(("date", "timezone"), str(key).split("|", 1), strict=True))
    return Partition.parse(keys["date"], keys["timezone"])


def key_of(partition: Partition) -> dg.MultiPartitionKey:
    return dg.MultiPartitionKey({"date": partition.date.isoformat(), "timezone": partition.timezone})


def replay_run_config(entity_ref: str, extra: Mapping[str, object]) -> dict[str, Any]:
    """A dead letter's entity as a run: `{date}:{tz}:{user}` redoes that user, `{date}:{tz}` the partition."""
    _, user_id = policy.parse_entity_ref(entity_ref)
    values = {k: v for k, v in extra.items() if v is not None}
    return entity_run_config(MatchmakingRunConfig, [ASSET], **values, user_ids=[user_id] if user_id else [])


def batch_replay_run_config(entity_refs: Sequence[str]) -> dict[str, Any]:
    """Several replays of one partition in one run: their users, or the whole partition if one letter is."""
    users = [policy.parse_entity_ref(ref)[1] for ref in entity_refs]
    return entity_run_config(MatchmakingRunConfig, [ASSET], user_ids=[] if None in users else sorted(set(users)))


def replay_partition_key(entity_ref: str) -> str:
    return key_of(policy.parse_entity_ref(entity_ref)[0])


def load_weights(artifact_store: ArtifactStoreResource, path: str | None) -> ScoringWeights:
    """The scoring artifact from the store, or the built-in weights when none is configured."""
    if not path:
        return policy.BUILTIN_WEIGHTS
    return policy.parse_weights(artifact_store.fetch(path))


def check_results(health: PartitionHealth) -> list[dg.AssetCheckResult]:
    """ADR-0004 "Validation": zero duplicate offers, and at least 99.9 % of the partition's jobs completed."""
    return [
        dg.AssetCheckResult(check_name=CHECK_DUPLICATES, passed=health.duplicate_offers == 0,
                            severity=dg.AssetCheckSeverity.ERROR,
                            metadata={"duplicate_offers": health.duplicate_offers, "offers": health.offers}),
        dg.AssetCheckResult(check_name=CHECK_COMPLETION, passed=health.completion_rate >= policy.MIN_COMPLETION_RATE,
                            severity=dg.AssetCheckSeverity.ERROR,
                            metadata={"completion_rate": round(health.completion_rate, 6), "jobs": health.jobs,
                                      "completed": health.completed, "failed": health.failed,
                                      "pending_or_running": health.unfinished}),
    ]


def alert_breaches(runtime: Reliability, partition: Partition, health: PartitionHealth, job_p95_seconds: float,
                   run_id: str | None) -> list[str]:
    """ADR-0004 "Monitoring": one alert per threshold a partition goes over (deduplicated per partition)."""
    sent = []
    for kind, summary in policy.threshold_breaches(health, job_p95_seconds):
        runtime.alert(Alert(pipeline=PIPELINE, kind=kind, dedupe_key=f"{PIPELINE}:{kind}:{partition.entity_ref}",
                            summary=f"{partition.entity_ref}: {summary}", entity_ref=partition.entity_ref,
                            link=runtime.run_link(run_id)))
        sent.append(kind)
    return sent


def partition_verdict(partition: Partition, failed_now: int, completed_now: int, dead_lettered: int) -> str | None:
    """Pure: why this run must end failed, or None when the partition is done (issue 27).

    A partition is green only when none of its users is dead-lettered. A run that leaves users failed —
    its own failures, or, for a replay of some users, the others still waiting for theirs — fails, and
    Dagster records the partition as failed, not materialized: an operator who reruns the red partitions
    finds it, and the rerun (which redoes only unfinished users) turns it green once the last user is done.
    """
    if failed_now:
        return (f"{partition.entity_ref}: {failed_now} users failed for good and are dead-lettered "
                f"({completed_now} completed); rerun the partition after the fix (it redoes only unfinished "
                "users) or `redrive dlq replay` them")
    if dead_lettered:
        return (f"{partition.entity_ref}: this run completed {completed_now} users, but {dead_lettered} users of "
                "the partition are still dead-lettered; replay them (`redrive dlq list --pipeline matchmaking`) "
                "or rerun the partition after the fix")
    return None


@dataclass(frozen=True)
class Built:
    partitions: dg.MultiPartitionsDefinition
    asset: dg.AssetsDefinition
    job: Any  # an unresolved asset job


def build(settings: MatchmakingSettings) -> Built:
    """The asset and its job for these settings (timezones and start date shape the partitions)."""
    partitions = partitions_def(settings)
    knobs = Knobs.from_settings(settings)
    with warnings.catch_warnings():
        # Partitioned checks are a Dagster preview; without them one partition's result would stand for all.
        warnings.simplefilter("ignore", dg.PreviewWarning)
        check_specs = [
            dg.AssetCheckSpec(CHECK_DUPLICATES, asset=ASSET, partitions_def=partitions,
                              description="No user has an offer twice, or outside the set their job recorded."),
            dg.AssetCheckSpec(CHECK_COMPLETION, asset=ASSET, partitions_def=partitions,
                              description="At least 99.9 % of the partition's jobs are completed."),
        ]

    @dg.asset(name=ASSET, partitions_def=partitions, group_name=PIPELINE, kinds={"postgres"}, check_specs=check_specs,
              tags={"redrive/pipeline": PIPELINE}, retry_policy=OP_RETRY_POLICY, owners=OWNERS)
    @sanitized_body
    def daily_match_offers(context: dg.AssetExecutionContext, config: MatchmakingRunConfig,
                           reliability: ReliabilityResource,
                           artifact_store: ArtifactStoreResource) -> Iterator[Any]:
        """Daily match offers of one (date, timezone): each active user of the timezone gets up to
        DAILY_OFFER_COUNT offers from mutually eligible users of their region, dated at 9 AM local.
        Idempotent per user (ADR-0004): completed users are kept, failed or interrupted ones redone."""
        partition = partition_of(context.partition_key)
        runtime = reliability.runtime()
        step = context.op_execution_context
        if config.attempt is not None:
            runtime.resume(PIPELINE, partition.entity_ref, config.attempt)
        unit = Unit(pipeline=PIPELINE, entity_ref=partition.entity_ref,
                    payload_ref={"table": "matchmaking_jobs", "date": partition.date.isoformat(),
                                 "timezone": partition.timezone},
                    context={"date": partition.date.isoformat(), "timezone": partition.timezone},
                    prior_attempts=config.prior_attempts)
        try:
            weights = run_stage(step, runtime, unit, "load_scoring", batch.POLICY,
                                lambda: load_weights(artifact_store, settings.scoring_path))
            pool = run_stage(step, runtime, unit, "load_pool", batch.POLICY,
                             lambda: batch.load_pool(runtime.engine, partition))
        except DeferredRetry as deferred:  # the run-failure sensor stays quiet: the run is tagged deferred
            raise dg.Failure(description=f"{partition.entity_ref}: {deferred}", allow_retries=False) from None
        runtime.succeeded(PIPELINE, partition.entity_ref)  # closes a replayed partition-level dead letter

        outcome = PartitionRun(runtime, partition, knobs, weights, run_id=context.run_id,
                               log=context.log).run(pool, config.user_ids or None)
        with runtime.engine.connect() as conn:
            health = repository.partition_health(conn, partition.date, partition.timezone)
            # issue 27: a replay of some users runs only them; the others still dead-lettered keep it red
            still_dead = deadletters.active_under(conn, PIPELINE, partition.entity_ref)
        breaches = alert_breaches(runtime, partition, health, outcome.job_p95_seconds, context.run_id)
        metadata = {**outcome.metadata(), "partition_completion_rate": round(health.completion_rate, 6),
                    "partition_failure_rate": round(health.failure_rate, 6),
                    "duplicate_offers": health.duplicate_offers, "threshold_alerts": breaches,
                    "users_dead_lettered": len(still_dead)}
        checks = check_results(health)
        verdict = partition_verdict(partition, len(outcome.failed), outcome.completed, len(still_dead))
        if verdict is not None:
            yield from checks
            # each failed user already has its dead letter and alert: the run-failure sensor must not add one
            context.instance.add_run_tags(context.run_id, {DEAD_LETTERED_TAG: "true"})
            raise dg.Failure(description=verdict, metadata=metadata, allow_retries=False)
        yield dg.MaterializeResult(metadata=metadata, check_results=checks)

    job = dg.define_asset_job(
        JOB, selection=dg.AssetSelection.assets(daily_match_offers), tags={"redrive/pipeline": PIPELINE},
        description="Daily match offers of one (date, timezone) partition (ADR-0004).",
    )
    return Built(partitions, daily_match_offers, job)
