"""The Dagster edge of the core: run one stage of one entity's work under its retry policy.

Decides with the pure policy (classify → vocabulary → decide) and carries it out:
- retryable, short wait → `RetryRequested` with the policy's delay; Dagster holds the
  run worker for that wait (it sleeps in `ActiveExecution.sleep_til_ready`), which is
  fine for seconds or a few minutes;
- retryable, long wait (over the durable threshold) → a durable timer row and
  `DeferredRetry`; the op ends, no worker idles, a sensor starts the next attempt;
- permanent, or the stage's budget spent → dead letter + alert exactly once, then
  `Failure(allow_retries=False)`, and the run is tagged so the run-failure sensor
  does not alert a second time.
Exceptions raised to Dagster carry only the sanitized message: Dagster stores the
cause chain in its event log, and a secret in an upstream error must not land there.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

import dagster as dg

from redrive import logs, observations
from redrive.backoff import BackoffPolicy
from redrive.budgets import RetryDecision, decide
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure, classify_exception
from redrive.reliability import Reliability
from redrive.sanitize import sanitize_exception, sanitize_text
from redrive.vocabularies import Vocabulary

T = TypeVar("T")

DEAD_LETTERED_TAG = "redrive/dead_lettered"
DEFERRED_TAG = "redrive/deferred"
# A run that failed on purpose and was reported where it belongs (a breaker probe that found the upstream
# still down: the breaker's own alert said so when it opened); the run-failure sensor adds no dead letter.
EXPECTED_FAILURE_TAG = "redrive/expected_failure"

# Unclassified and infrastructure failures of an op itself (database or S3 unreachable, a bug):
# Dagster re-runs the op with backoff and jitter. Classified per-entity failures never reach it:
# run_stage raises `RetryRequested` with the stage's own budget, or `Failure(allow_retries=False)`.
# Dagster counts both kinds of retry on one counter (`context.retry_number`), so an infrastructure
# retry also counts as an attempt of the stage that runs next: a stage's budget can only shrink.
OP_RETRY_POLICY = dg.RetryPolicy(max_retries=3, delay=1.0, backoff=dg.Backoff.EXPONENTIAL,
                                 jitter=dg.Jitter.PLUS_MINUS)


@dataclass(frozen=True)
class StagePolicy:
    """How one stage retries: its budget, its backoff, and how its failures are named."""

    max_attempts: int
    backoff: BackoffPolicy
    vocabulary: Vocabulary | None = None
    integrity: str = "conflict"
    idempotent: bool = True  # 002 §8.1: a conflict is retryable only for an idempotent operation

    def classify(self, exc: BaseException, now: datetime | None = None) -> Failure:
        """`now` dates an HTTP-date Retry-After against the injected clock."""
        failure = classify_exception(exc, integrity=self.integrity, now=now)
        return self.vocabulary.apply(failure, idempotent=self.idempotent) if self.vocabulary else failure


@dataclass(frozen=True)
class Unit:
    """One entity's work, as the core needs to know it for budgets, dead letters and replay."""

    pipeline: str
    entity_ref: str
    tenant: str | None = None
    payload_ref: Mapping[str, Any] = field(default_factory=dict)
    context: Mapping[str, Any] = field(default_factory=dict)
    prior_attempts: Mapping[str, int] = field(default_factory=dict)


class DeferredRetry(Exception):
    """The stage's next attempt is a durable timer; the op should end without output."""

    def __init__(self, stage: str, attempt: int, due_at: Any) -> None:
        super().__init__(f"{stage}: attempt {attempt} deferred until {due_at.isoformat()}")
        self.stage, self.attempt, self.due_at = stage, attempt, due_at


class StageFailed(Exception):
    """Sanitized stand-in for the real exception in what Dagster records."""


def decide_for(policy: StagePolicy, failure: Failure, attempt: int, reliability: Reliability,
               jitter_key: str) -> RetryDecision:
    """The policy's decision in real terms (the durable threshold compares these)."""
    return decide(failure, attempt, policy.max_attempts, policy.backoff, reliability.rng_for(jitter_key))


def run_stage(
    context: dg.OpExecutionContext,
    reliability: Reliability,
    unit: Unit,
    stage: str,
    policy: StagePolicy,
    work: Callable[[], T],
) -> T:
    """Run `work` once, as attempt N of `stage`; see the module docstring for what a failure becomes."""
    attempt = unit.prior_attempts.get(stage, 0) + context.retry_number + 1
    started = time.perf_counter()
    try:
        result = work()
    except Exception as exc:  # noqa: BLE001 - every failure is classified, none escapes unnamed
        failure = policy.classify(exc, reliability.now())
        stack = sanitize_exception(exc)
    else:
        reliability.observe(unit.pipeline, stage, observations.OK, seconds=time.perf_counter() - started)
        return result
    seconds = time.perf_counter() - started
    decision = decide_for(policy, failure, attempt, reliability, f"{unit.pipeline}:{unit.entity_ref}:{stage}:{attempt}")
    wait = decision.delay * reliability.time_scale
    # Every line below reaches Dagster's event log: the text is sanitized once, before any of them.
    public = sanitize_text(
        f"{stage} attempt {attempt}/{policy.max_attempts} of {unit.entity_ref}: {failure.code}: {failure.message}")
    fields = logs.fields(pipeline=unit.pipeline, entity=unit.entity_ref, stage=stage, attempt=attempt,
                         error_class=failure.code, run_id=context.run_id)
    if decision.retry:
        reliability.observe(unit.pipeline, stage, observations.RETRY, error_class=failure.code, seconds=seconds)
    if decision.retry and decision.delay <= reliability.durable_threshold:
        context.log.warning(f"{public}; retrying in {wait:.3f}s", extra=fields)
        raise dg.RetryRequested(max_retries=policy.max_attempts, seconds_to_wait=wait) from StageFailed(public)
    if decision.retry:
        due_at = reliability.defer(unit.pipeline, unit.entity_ref, attempt + 1, wait,
                                   {"stage": stage, "prior_attempts": {**unit.prior_attempts, stage: attempt}})
        context.log.warning(f"{public}; next attempt deferred to {due_at.isoformat()} (durable timer)", extra=fields)
        context.instance.add_run_tags(context.run_id, {DEFERRED_TAG: "true"})
        raise DeferredRetry(stage, attempt + 1, due_at)
    recorded = reliability.fail_for_good(
        FinalFailure(
            pipeline=unit.pipeline,
            stage=stage,
            entity_ref=unit.entity_ref,
            failure=failure,
            attempts=attempt,
            at=reliability.now(),
            tenant=unit.tenant,
            stack=stack,
            context={**unit.context, "dagster_run_id": context.run_id, "decision": decision.reason},
            payload_ref=unit.payload_ref,
            stage_attempts={**unit.prior_attempts, stage: attempt},
            run_id=context.run_id,
        )
    )
    context.instance.add_run_tags(context.run_id, {DEAD_LETTERED_TAG: "true"})
    context.log.error(f"{public}; {decision.reason}: dead letter {recorded.dead_letter.id}",
                      extra={**fields, "dead_letter_id": recorded.dead_letter.id})
    raise dg.Failure(
        description=f"{public} ({sanitize_text(decision.reason)}); dead letter {recorded.dead_letter.id}",
        metadata={
            "dead_letter_id": recorded.dead_letter.id,
            "error_class": failure.code,
            "attempts": attempt,
            "escalated": recorded.escalated,
        },
        allow_retries=False,
    ) from StageFailed(failure.code)


@contextlib.contextmanager
def sanitized_failures(what: str) -> Iterator[None]:
    """Let Dagster's own control flow through; turn any other exception into a sanitized `Failure`.

    Dagster stores an op's exception, its message and its cause chain in the event log; a
    secret in an upstream error must not land there, so the original is not chained. The
    `Failure` may be retried by the op's `RetryPolicy`; when the run fails for good, the
    run-failure sensor dead-letters it (`sensors.core.run_failure_alert_sensor`).
    """
    try:
        yield
    except (dg.Failure, dg.RetryRequested):
        raise
    except DeferredRetry as deferred:  # the next attempt is a durable timer: Dagster must not retry the op
        raise dg.Failure(description=sanitize_text(f"{what}: {deferred}"), allow_retries=False) from None
    except Exception as exc:  # noqa: BLE001 - named, sanitized, retried by the op's policy
        failure = classify_exception(exc)
        # issue 12 §3: the op's RetryPolicy is for its infrastructure and unclassified failures; a named
        # permanent one (a bug, bad data) fails the run at once and is dead-lettered by the run-failure sensor.
        raise dg.Failure(description=sanitize_text(f"{what}: {failure.code}: {failure.message}")[:500],
                         metadata={"error_class": failure.code},
                         allow_retries=failure.retryable or failure.code == Code.UNKNOWN) from StageFailed(failure.code)


def sanitized_body(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate an op's or asset's body (under `@dg.op`/`@dg.asset`) with `sanitized_failures(name)`.

    The signature is kept (`functools.wraps`), so Dagster still sees the context, config and
    resources; a generator body stays a generator, so its outputs stream as before.
    """
    what = fn.__name__
    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def streamed(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with sanitized_failures(what):
                yield from fn(*args, **kwargs)

        streamed.sanitized = True  # type: ignore[attr-defined]
        return streamed

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        with sanitized_failures(what):
            return fn(*args, **kwargs)

    body.sanitized = True  # type: ignore[attr-defined]  # tests/core_dagster/test_wiring.py finds it on every op
    return body


class EntityRunFields(dg.Config):
    """Run config every staged pipeline accepts from the core's sensors: durable retries and replays.

    Subclass it with the entity's own key field(s); `entity_run_config` builds the run config.
    """

    replay_from: str | None = None  # "failed_stage" (default) or "start" (a full restart)
    replay_of: int | None = None  # the dead letter being replayed
    stage: str | None = None
    attempt: int | None = None  # set when a durable timer started this run
    prior_attempts: dict[str, int] = {}


def entity_run_config(config_cls: type[dg.Config], ops: Sequence[str], **values: Any) -> dict[str, Any]:
    """The same config for every op of the job, keeping only fields the config class declares."""
    allowed = {k: v for k, v in values.items() if k in config_cls.model_fields}
    return {"ops": {op: {"config": allowed} for op in ops}}


def checkpointed_stage(
    context: dg.OpExecutionContext,
    reliability: Reliability,
    unit: Unit,
    stage: str,
    policy: StagePolicy,
    work: Callable[[], Mapping[str, Any]],
) -> dict[str, Any] | None:
    """Return the stage's checkpoint, or run it under its policy and checkpoint the output.

    None means the next attempt was deferred to a durable timer: end the op without output.
    A replay from the failed stage finds the earlier stages' checkpoints and skips them.
    """
    from redrive import checkpoints

    with reliability.engine.connect() as conn:
        done = checkpoints.load(conn, unit.pipeline, unit.entity_ref, stage)
    if done is not None:
        context.log.info(f"{stage}: reusing the checkpoint of {unit.entity_ref}")
        return done
    try:
        output = dict(run_stage(context, reliability, unit, stage, policy, work))
    except DeferredRetry:
        return None
    with reliability.engine.begin() as conn:
        checkpoints.save(conn, unit.pipeline, unit.entity_ref, stage, output)
    return output
