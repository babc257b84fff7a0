"""Criticizer (002 §8): fetch → llm → notify for every due critique request, in drain runs.

A drain run (`redrive.drain`) claims due requests from the core's work queue in batches and
works several at a time; each request runs its three stages under its own policy: 5 attempts
per stage (§8.3, the counts live on the request's work row, so one stage never spends
another's), full-jitter backoff stretched by Retry-After up to 5 minutes (§8.2), 002's failure
classes with conflicts retried only where the stage is idempotent (§8.1). A retry is the row
falling due again, not a sleeping worker or a new run. A stage that gives up is dead-lettered
with its metadata and alerted once (§8.4), in the transaction that marks the request failed.

Replay from the failed stage (§8.5) uses stage checkpoints in Postgres, not Dagster's
re-execution from failure: a replay is the request's row falling due again, days later,
in whatever drain run picks it up, so no single original run holds the earlier outputs. A
checkpoint is a row any run can read, an operator can inspect, and `--from-start` clears.

Safe to rerun: a stage with a checkpoint is not run again, deliveries are recorded per
idempotency key so a retried notify posts only what is missing, and completing twice
writes the same row.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

from collections.abc import Callable
from typing import Any

import dagster as dg
import sqlalchemy as sa

from assets.criticizer import policy, repository
from assets.criticizer.policy import PIPELINE
from redrive import checkpoints
from redrive.drain import Attempt, Handler
from redrive.drain_ops import DRAIN_RETRY_POLICY, DrainConfig, drain_job, run_drain
from redrive.reliability import Reliability
from redrive.stages import StagePolicy, sanitized_body
from redrive.vocabularies import CRITICIZER
from resources.criticizer import CriticizerHttpResource
from resources.llm import LlmResource
from resources.reliability import ReliabilityResource

# entities one drain run keeps in flight unless REDRIVE_DRAIN_IN_FLIGHT says: a coroutine handler's wait on the
# LLM holds no thread, so this is sized to a provider's concurrency, not to this machine's threads
IN_FLIGHT = 64

POLICIES = {
    stage: StagePolicy(max_attempts=policy.MAX_ATTEMPTS_PER_STAGE, backoff=policy.BACKOFF,
                       vocabulary=CRITICIZER, idempotent=policy.STAGE_IDEMPOTENT[stage])
    for stage in policy.STAGES
}


def handler(runtime: Reliability, criticizer_http: CriticizerHttpResource, llm: LlmResource) -> Handler:
    """One request's fetch → llm → notify; the drain settles what a stage raises. A coroutine: the seconds an
    LLM takes hold no thread, so one drain run keeps as many requests in flight as the LLM allows. The fast
    calls (artifact store, webhook, Slack) go through sync clients on the run's call threads: on an instant
    upstream the async client's machinery was half of the run's CPU (docs/benchmarks.md)."""
    slack = criticizer_http.results_channel() or runtime.channels.get("slack")

    async def handle(attempt: Attempt) -> None:
        request_id = attempt.entity_ref
        request = await attempt.blocking(lambda: _start(runtime, request_id))
        if request.status == repository.DONE:
            return  # a duplicate due row of finished work: nothing to do
        attempt.tenant = request.tenant
        attempt.payload_ref = policy.payload_ref(request.request_id, request.fingerprint)
        attempt.context.update(_triage(request, completed={}, failing_since=request.failing_since))
        attempt.on_failure.append(lambda conn, failure, final: _note_failure(conn, runtime, attempt, request, final))

        async def fetch() -> dict[str, Any]:
            return policy.fetched(await attempt.call(lambda: criticizer_http.fetch_artifact(request.artifact_url)))

        # a crash before the LLM's checkpoint only fetches the artifact again: its checkpoint rides that write
        fetched = await attempt.astage("fetch", fetch, durable=False)
        messages = policy.critique_messages(request.rubric, request.artifact_url, fetched["text"])

        async def critique_it() -> dict[str, Any]:
            return policy.critiqued(await llm.achat_json(messages, policy.Critique), messages)

        critiqued = await attempt.astage("llm", critique_it)
        critique, sha = critiqued["critique"], critiqued["critique_sha256"]
        key = policy.idempotency_key(request.request_id, sha)

        def record(channel: str, status: int | None) -> Callable[[sa.Connection], None]:
            at = runtime.now()
            return lambda conn: repository.record_delivery(conn, request.request_id, channel, key, status, at)

        async def deliver() -> dict[str, Any]:
            done = set() if attempt.first_lease else \
                await attempt.blocking(lambda: _delivered(runtime, request.request_id, key))
            if repository.WEBHOOK not in done:
                status = await attempt.call(lambda: criticizer_http.post_webhook(
                    request.webhook_url,
                    policy.webhook_payload(request.request_id, request.artifact_url, critique, sha),
                    {**request.delivery_headers(), "Idempotency-Key": key},
                ))
                # with the next write (Slack's record, or the settlement whatever its outcome): a crash before it
                # posts again with the same Idempotency-Key, which the receiver keeps as one delivery (§8.1)
                attempt.write_later(record(repository.WEBHOOK, status))
            if slack is not None and repository.SLACK not in done:
                subject, text = policy.slack_message(request.request_id, critique)
                await attempt.call(lambda: slack.send(subject, text, key))
                await attempt.blocking(lambda: attempt.write_now(record(repository.SLACK, None)))  # Slack keeps no key
            return {"idempotency_key": key, "slack": slack is not None}

        # the last stage: its checkpoint and observation ride the settlement that follows
        await attempt.astage("notify", deliver, durable=False)

        def complete(conn: sa.Connection) -> None:
            repository.record_stage_attempts(conn, request.request_id, attempt.stage_attempts())
            repository.complete(conn, request.request_id, critique, sha, runtime.now())

        attempt.on_success.append(complete)

    return handle


def _start(runtime: Reliability, request_id: str) -> repository.CritiqueRequestRow:
    with runtime.engine.begin() as conn:
        return repository.start(conn, request_id, runtime.now())


def _delivered(runtime: Reliability, request_id: str, key: str) -> set[str]:
    with runtime.engine.connect() as conn:
        return repository.delivered(conn, request_id, key)


def _triage(request: repository.CritiqueRequestRow, *, completed: dict[str, Any], failing_since: Any) -> dict[str, Any]:
    return policy.triage_context(
        request_id=request.request_id, artifact_url=request.artifact_url, rubric=request.rubric,
        webhook_url=request.webhook_url, header_names=list(request.webhook_headers), completed=completed,
        failing_since=failing_since,
    )


def _note_failure(conn: sa.Connection, runtime: Reliability, attempt: Attempt,
                  request: repository.CritiqueRequestRow, final: bool) -> None:
    """In the settlement's transaction: when the failure episode began, attempts so far, and for a dead
    letter the hashes of the completed stages' outputs (§8.4)."""
    stage = attempt.current_stage
    since = repository.note_failure(conn, request.request_id, runtime.now())
    repository.record_stage_attempts(conn, request.request_id, attempt.stage_attempts(stage))
    if final:
        completed = {s: out for s in policy.STAGES if s != stage
                     and (out := checkpoints.load(conn, PIPELINE, request.request_id, s)) is not None}
        attempt.context.update(_triage(request, completed=completed, failing_since=since))


@dg.op(name="criticizer_drain", retry_policy=DRAIN_RETRY_POLICY, out=dg.Out(dict))
@sanitized_body
def drain_op(context: dg.OpExecutionContext, config: DrainConfig, reliability: ReliabilityResource,
             criticizer_http: CriticizerHttpResource, llm: LlmResource):
    """Work every due critique request: fetch the artifact, ask the LLM for a critique, deliver it."""
    runtime = reliability.runtime()
    return run_drain(context, runtime, PIPELINE, POLICIES, handler(runtime, criticizer_http, llm), config,
                     in_flight=IN_FLIGHT)


criticizer_job = drain_job(
    "criticizer_job", PIPELINE, drain_op,
    description="Criticizer (002 §8): a drain run over due critique requests — fetch → llm → notify for each, "
                "retries as due times on rows, dead letters for what gives up. Started by criticizer_due_work.",
)
