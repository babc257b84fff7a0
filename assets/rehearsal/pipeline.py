"""Failure rehearsal: fetch an artifact, ask the LLM about it — two stages on the reliability core.

Operators use it to rehearse failure modes locally: script faults in the sandbox
(429 with Retry-After, 503, 401, timeouts…) and watch retries, dead letters, alerts
and `redrive dlq replay` work end to end. Each stage's output is checkpointed, so a
replay starts at the failed stage and never fetches twice. Safe to rerun: a stage
with a checkpoint is not run again, and completing twice writes the same result.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

import hashlib
from typing import Any

import dagster as dg
from pydantic import BaseModel, ConfigDict

from assets.rehearsal import repository
from redrive import checkpoints, logs, observations
from redrive.backoff import FullJitter
from redrive.stages import OP_RETRY_POLICY, EntityRunFields, StagePolicy, Unit, checkpointed_stage, entity_run_config, sanitized_body
from resources.http import ArtifactStoreResource
from resources.llm import LlmResource
from resources.reliability import ReliabilityResource

PIPELINE = "rehearsal"
POLICIES = {
    "fetch": StagePolicy(max_attempts=5, backoff=FullJitter()),
    "ask": StagePolicy(max_attempts=5, backoff=FullJitter()),
}


class Verdict(BaseModel):
    model_config = ConfigDict(extra="ignore")
    verdict: str


class RehearsalConfig(EntityRunFields):
    request_id: str


def unit_for(request: repository.RehearsalRequest, config: RehearsalConfig) -> Unit:
    return Unit(
        pipeline=PIPELINE,
        entity_ref=request.request_id,
        payload_ref=request.payload_ref,
        context={"request_id": request.request_id, "artifact_path": request.artifact_path},
        prior_attempts=config.prior_attempts,
    )


@dg.op(retry_policy=OP_RETRY_POLICY, name="rehearsal_fetch", out=dg.Out(dict, is_required=False))
@sanitized_body
def fetch(context: dg.OpExecutionContext, config: RehearsalConfig, reliability: ReliabilityResource,
          artifact_store: ArtifactStoreResource):
    """Download the artifact from the store (the sandbox locally)."""
    runtime = reliability.runtime()
    if config.attempt is not None:
        runtime.resume(PIPELINE, config.request_id, config.attempt)
    with runtime.engine.begin() as conn:
        if config.replay_from == "start":
            checkpoints.clear(conn, PIPELINE, config.request_id)
        request = repository.get(conn, config.request_id)
    def download() -> dict[str, Any]:
        body = artifact_store.fetch(request.artifact_path)
        return {"text": body.decode("utf-8", errors="replace"), "sha256": hashlib.sha256(body).hexdigest()}

    output = checkpointed_stage(context, runtime, unit_for(request, config), "fetch", POLICIES["fetch"], download)
    if output is not None:
        yield dg.Output(output)


@dg.op(retry_policy=OP_RETRY_POLICY, name="rehearsal_ask")
@sanitized_body
def ask(context: dg.OpExecutionContext, config: RehearsalConfig, reliability: ReliabilityResource,
        llm: LlmResource, fetched: dict) -> None:
    """Ask the LLM for a verdict on the artifact; completing closes the request's dead letter."""
    runtime = reliability.runtime()
    with runtime.engine.connect() as conn:
        request = repository.get(conn, config.request_id)
    messages = [{"role": "system", "content": "Answer as JSON {\"verdict\": …}."},
                {"role": "user", "content": f"{request.prompt}\n\n{fetched['text']}"}]
    output = checkpointed_stage(context, runtime, unit_for(request, config), "ask", POLICIES["ask"],
                                lambda: llm.chat_json(messages, Verdict).model_dump())
    if output is None:
        return
    with runtime.engine.begin() as conn:
        repository.complete(conn, request.request_id, output)
        observations.observe(conn, PIPELINE, "ask", observations.DONE)
    runtime.succeeded(PIPELINE, request.request_id)
    context.log.info(f"{request.request_id}: verdict {output['verdict']!r}",
                     extra=logs.fields(pipeline=PIPELINE, entity=request.request_id, stage="ask", run_id=context.run_id))


@dg.job(tags={"redrive/pipeline": PIPELINE})
def rehearsal_job() -> None:
    """Failure rehearsal: fetch → ask for one request, under the core's retry, dead-letter and alert policy."""
    ask(fetch())


def run_config(request_id: str, extra: dict[str, Any]) -> dict[str, Any]:
    return entity_run_config(RehearsalConfig, ["rehearsal_fetch", "rehearsal_ask"], request_id=request_id, **extra)
