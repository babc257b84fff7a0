"""Criticizer (002 §8): fetch → llm → notify, one op per stage, one dynamic partition per request.

Every stage runs under the core's stage adapter with its own policy: 5 attempts per
stage (§8.3; Dagster counts retries per op, so one stage never spends another's),
full-jitter backoff stretched by Retry-After up to 5 minutes (§8.2), 002's failure
classes with conflicts retried only where the stage is idempotent (§8.1). A stage
that gives up is dead-lettered with its metadata and alerted once (§8.4).

Replay from the failed stage (§8.5) uses stage checkpoints in Postgres, not Dagster's
re-execution from failure. Re-execution would need every op output in a persistent IO
manager reachable from the new run (e.g. S3 pickles), and it only works on the
original run: a replay the sensor starts days later, a durable-retry run, or a run
on a new code version would not see those outputs. A checkpoint is a row any run
can read, an operator can inspect, and `--from-start` clears in the same transaction
it records the restart in. So each op first looks for its stage's checkpoint and
reuses it; only stages without one do work.

Safe to rerun: a stage with a checkpoint is not run again, deliveries are recorded per
idempotency key so a retried notify posts only what is missing, and completing twice
writes the same row.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

from collections.abc import Callable
from typing import Any

import dagster as dg

from assets.criticizer import policy, repository
from assets.criticizer.policy import PIPELINE
from redrive import checkpoints
from redrive.deadletters import FROM_START
from redrive.reliability import Reliability
from redrive.stages import OP_RETRY_POLICY, EntityRunFields, StagePolicy, Unit, checkpointed_stage, entity_run_config, sanitized_body
from redrive.vocabularies import CRITICIZER
from resources.criticizer import CriticizerHttpResource
from resources.llm import LlmResource
from resources.reliability import ReliabilityResource

requests_partitions = dg.DynamicPartitionsDefinition(name="criticizer_requests")


POLICIES = {
    stage: StagePolicy(max_attempts=policy.MAX_ATTEMPTS_PER_STAGE, backoff=policy.BACKOFF,
                                 vocabulary=CRITICIZER, idempotent=policy.STAGE_IDEMPOTENT[stage])
    for stage in policy.STAGES
}


class CriticizerConfig(EntityRunFields):
    """Which request; the core's fields say where this run stands (a durable retry's attempt, a replay)."""

    request_id: str


OPS = {stage: f"criticizer_{stage}" for stage in policy.STAGES}  # op names are unique in the code location


def run_config(request_id: str, extra: Any) -> dict[str, Any]:
    """Run config for a request (the core's replay and durable-retry sensors call this too)."""
    return entity_run_config(CriticizerConfig, list(OPS.values()), **{**dict(extra), "request_id": request_id})


def staged(
    context: dg.OpExecutionContext,
    runtime: Reliability,
    request: repository.CritiqueRequestRow,
    config: CriticizerConfig,
    stage: str,
    work: Callable[[], dict[str, Any]],
) -> tuple[dict[str, Any], bool] | None:
    """The core's `checkpointed_stage`, plus what the criticizer's dead letters and status show.

    Returns (output, reused) — reused when the stage's checkpoint was found and no work done — or
    None when the next attempt became a durable timer. Adds: the attempts a completed stage took
    (`stage_attempts`), and on a failure, when the failure episode began and the hashes of the
    completed stages' outputs, into the unit's context before the core reads it for a dead letter.
    """
    triage = policy.triage_context(
        request_id=request.request_id, artifact_url=request.artifact_url, rubric=request.rubric,
        webhook_url=request.webhook_url, header_names=list(request.webhook_headers), completed={},
        failing_since=request.failing_since,
    )
    unit = Unit(
        pipeline=PIPELINE,
        entity_ref=request.request_id,
        tenant=request.tenant,
        payload_ref=policy.payload_ref(request.request_id, request.fingerprint),
        context=triage,
        # completed stages' counts ride along into the dead letter's stage_attempts; the failing
        # stage's own count comes only from this run's config (a durable retry) and Dagster.
        prior_attempts={**{s: n for s, n in request.stage_attempts.items() if s != stage},
                        **{s: n for s, n in config.prior_attempts.items() if s == stage}},
    )
    ran: list[bool] = []

    def tracked() -> dict[str, Any]:
        ran.append(True)
        try:
            return work()
        except Exception:
            # Only on the failure path: run_stage reads the unit's context after `work` fails, so
            # what is added here reaches the dead letter.
            try:
                with runtime.engine.begin() as conn:
                    since = repository.note_failure(conn, request.request_id, runtime.now())
                    completed = {s: checkpoints.load(conn, PIPELINE, request.request_id, s) or {}
                                 for s in request.stage_attempts if s != stage}
                triage.update(policy.triage_context(
                    request_id=request.request_id, artifact_url=request.artifact_url, rubric=request.rubric,
                    webhook_url=request.webhook_url, header_names=list(request.webhook_headers),
                    completed=completed, failing_since=since))
            except Exception:  # noqa: BLE001 - bookkeeping must not replace the stage's own failure
                context.log.warning(f"{stage}: could not record the failure of {request.request_id}")
            raise

    output = checkpointed_stage(context, runtime, unit, stage, POLICIES[stage], tracked)
    if output is None:
        return None
    if ran:
        attempts = unit.prior_attempts.get(stage, 0) + context.retry_number + 1
        with runtime.engine.begin() as conn:
            repository.stage_done(conn, request.request_id, stage, attempts)
        context.log.info(f"{stage} of {request.request_id} done in {attempts} attempt(s)")
    return output, not ran


def _request(runtime: Reliability, request_id: str) -> repository.CritiqueRequestRow:
    with runtime.engine.connect() as conn:
        return repository.get(conn, request_id)


def _check_partition(context: dg.OpExecutionContext, request_id: str) -> None:
    if context.has_partition_key and context.partition_key != request_id:
        raise dg.Failure(f"run of partition {context.partition_key} was configured for request {request_id}",
                         allow_retries=False)


@dg.op(retry_policy=OP_RETRY_POLICY, name=OPS["fetch"], out=dg.Out(dict, is_required=False))
@sanitized_body
def fetch_op(context: dg.OpExecutionContext, config: CriticizerConfig, reliability: ReliabilityResource,
             criticizer_http: CriticizerHttpResource):
    """Download the artifact under review (a code-review or document store; the sandbox locally)."""
    _check_partition(context, config.request_id)
    runtime = reliability.runtime()
    if config.attempt is not None:
        runtime.resume(PIPELINE, config.request_id, config.attempt)
    with runtime.engine.begin() as conn:
        if config.replay_from == FROM_START:
            cleared = repository.restart(conn, config.request_id)
            context.log.info(f"full restart of {config.request_id}: {cleared} stage checkpoint(s) cleared")
        request = repository.start(conn, config.request_id, runtime.now())
    result = staged(context, runtime, request, config, "fetch",
                    lambda: policy.fetched(criticizer_http.fetch_artifact(request.artifact_url)))
    if result is not None:
        output, reused = result
        yield dg.Output(output, metadata={"bytes": output["bytes"], "sha256": output["sha256"][:16],
                                          "source": "checkpoint" if reused else "store"})


@dg.op(retry_policy=OP_RETRY_POLICY, name=OPS["llm"], out=dg.Out(dict, is_required=False))
@sanitized_body
def llm_op(context: dg.OpExecutionContext, config: CriticizerConfig, reliability: ReliabilityResource,
           llm: LlmResource, fetched: dict):
    """Ask the LLM for a structured critique of the artifact against the rubric (validated with pydantic)."""
    runtime = reliability.runtime()
    request = _request(runtime, config.request_id)
    messages = policy.critique_messages(request.rubric, request.artifact_url, fetched["text"])
    result = staged(context, runtime, request, config, "llm",
                    lambda: policy.critiqued(llm.chat_json(messages, policy.Critique), messages))
    if result is not None:
        output, reused = result
        critique = output["critique"]
        yield dg.Output(output, metadata={"verdict": critique["verdict"], "score": critique["score"],
                                          "findings": len(critique["findings"]),
                                          "source": "checkpoint" if reused else "llm"})


@dg.op(retry_policy=OP_RETRY_POLICY, name=OPS["notify"])
@sanitized_body
def notify_op(context: dg.OpExecutionContext, config: CriticizerConfig, reliability: ReliabilityResource,
              criticizer_http: CriticizerHttpResource, critiqued: dict) -> None:
    """Post the critique to the request's webhook and to Slack; completing closes a replayed dead letter."""
    runtime = reliability.runtime()
    request = _request(runtime, config.request_id)
    critique, sha = critiqued["critique"], critiqued["critique_sha256"]
    key = policy.idempotency_key(request.request_id, sha)
    slack = criticizer_http.results_channel() or runtime.channels.get("slack")

    def deliver() -> dict[str, Any]:
        with runtime.engine.connect() as conn:
            done = repository.delivered(conn, request.request_id, key)
        if repository.WEBHOOK not in done:
            status = criticizer_http.post_webhook(
                request.webhook_url,
                policy.webhook_payload(request.request_id, request.artifact_url, critique, sha),
                {**request.webhook_headers, "Idempotency-Key": key},
            )
            with runtime.engine.begin() as conn:
                repository.record_delivery(conn, request.request_id, repository.WEBHOOK, key, status, runtime.now())
        if slack is not None and repository.SLACK not in done:
            subject, text = policy.slack_message(request.request_id, critique)
            slack.send(subject, text, key)
            with runtime.engine.begin() as conn:
                repository.record_delivery(conn, request.request_id, repository.SLACK, key, None, runtime.now())
        return {"idempotency_key": key, "slack": slack is not None}

    result = staged(context, runtime, request, config, "notify", deliver)
    if result is None:
        return
    with runtime.engine.begin() as conn:
        repository.complete(conn, request.request_id, critique, sha, runtime.now())
    closed = runtime.succeeded(PIPELINE, request.request_id)
    context.log.info(f"{request.request_id}: critique delivered ({critique['verdict']}, {critique['score']}/10)"
                     + (f"; dead letter {closed.id} closed" if closed else ""))


@dg.job(partitions_def=requests_partitions, tags={"redrive/pipeline": PIPELINE})
def criticizer_job() -> None:
    """Criticizer: fetch → llm → notify for one critique request (one partition), under 002 §8's policy."""
    notify_op(llm_op(fetch_op()))
