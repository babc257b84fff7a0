"""Conversion at the Dagster edge: worker runs, breaker probe runs and dead-letter replays (003 §3.4–§3.6).

A worker run is the same :class:`~assets.conversion.worker.Worker` loop as ``redrive worker
conversion``: it drains the due jobs and ends after WORKER_IDLE_EXIT_SEC with nothing to claim, and
the ``conversion_workers`` sensor starts more while there is due work and the breaker is closed.
Every run of these jobs is tagged ``redrive/pipeline=conversion``, which the instance's
``tag_concurrency_limits`` cap at WORKER_RUNS, each run WORKER_CONCURRENCY jobs in flight (see the conversion section of README.md).
Re-running any of them is safe: a worker only ever takes jobs through the fenced claim, a probe only
probes when one is due, and a replay only requeues a job that is still ``failed``.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

import signal
import threading
from collections.abc import Sequence
from typing import Any

import dagster as dg

from assets.conversion import repository as repo
from assets.conversion.files import FileStore
from assets.conversion.settings import BREAKER, PIPELINE, file_store, settings_of
from assets.conversion.worker import JsonLog, Shutdown, Worker
from redrive import liveness
from redrive.breaker import CircuitBreaker, Transition
from redrive.stages import EXPECTED_FAILURE_TAG, OP_RETRY_POLICY, sanitized_body
from resources.conversion import ConversionResource
from resources.reliability import ReliabilityResource

TAGS = {"redrive/pipeline": PIPELINE}


class WorkerRunConfig(dg.Config):
    until_idle_sec: float | None = None  # default WORKER_IDLE_EXIT_SEC
    max_seconds: float | None = None  # default WORKER_MAX_RUN_SEC
    gateway_timeout_ms: float | None = None  # default GATEWAY_TIMEOUT_MS
    idle_sleep_sec: float | None = None  # default WORKER_IDLE_SLEEP_SEC


@dg.op(retry_policy=OP_RETRY_POLICY, out=dg.Out(dict))
@sanitized_body
def convert_due_jobs(context: dg.OpExecutionContext, config: WorkerRunConfig, reliability: ReliabilityResource,
                     conversion: ConversionResource) -> dict:
    """Claims and converts due PDF jobs until none is left to claim, under leases, fencing and the circuit breaker."""
    settings = settings_of(conversion)
    overrides = {"gateway_timeout_ms": config.gateway_timeout_ms, "worker_idle_sleep_sec": config.idle_sleep_sec}
    settings = settings.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    worker_id = f"dagster:{context.run_id[:8]}"
    shutdown = Shutdown(settings.worker_shutdown_grace_sec)
    log = JsonLog(worker_id)
    log.run_id = context.run_id
    worker = Worker(reliability.runtime(), conversion.gateway(settings.gateway_timeout_ms),
                    file_store(settings), settings, worker_id=worker_id,
                    shutdown=shutdown, log=log)
    # declared dead by the run watchdog (its beats did not land): stop claiming, as on SIGTERM (issue 25)
    liveness.when_fenced(context.run_id, shutdown.request)
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        # SIGTERM (a run terminated from the UI, a deploy) → stop claiming, finish or requeue (003 §3.5);
        # SIGINT stays Dagster's: its interrupt reaches `Worker.process`, which requeues and re-raises.
        shutdown.install(signals=(signal.SIGTERM,))
    try:
        report = worker.run(until_idle=config.until_idle_sec if config.until_idle_sec is not None
                            else settings.worker_idle_exit_sec,
                            max_seconds=config.max_seconds or settings.worker_max_run_sec)
    finally:
        if main_thread:
            shutdown.uninstall()
        worker.gateway.close()
    summary = report.as_dict()
    context.log.info(f"conversion worker {worker_id}: {summary}")
    context.add_output_metadata({k: dg.MetadataValue.int(v) for k, v in summary.items()})
    return summary


@dg.op(retry_policy=OP_RETRY_POLICY)
@sanitized_body
def probe_gateway(context: dg.OpExecutionContext, reliability: ReliabilityResource,
                  conversion: ConversionResource) -> None:
    """003 §3.3 health probe: closes the open circuit breaker once the PDF gateway answers /health again."""
    runtime = reliability.runtime()
    settings = settings_of(conversion)
    breaker = CircuitBreaker(runtime.engine, BREAKER, settings.breaker_policy(runtime.time_scale), runtime.clock)
    gateway = conversion.gateway()
    try:
        outcome = breaker.probe(gateway.healthy)
    finally:
        gateway.close()
    if isinstance(outcome, Transition):
        context.log.info(f"breaker {BREAKER} closed after {outcome.open_seconds:.1f}s open; jobs resume")
    elif outcome is False:
        # a failing probe is a failed run (red in the UI), not a green one; the breaker's alert already went out
        # when it opened, so the run-failure sensor adds no dead letter, and Dagster retries neither op nor run
        context.instance.add_run_tags(context.run_id, {EXPECTED_FAILURE_TAG: "breaker-probe"})
        raise dg.Failure(description=f"breaker {BREAKER}: the PDF gateway's health probe failed; jobs stay queued "
                                     "and the next probe follows the cooldown", allow_retries=False)
    else:
        context.log.info(f"breaker {BREAKER}: no probe due (closed, cooling down, or another probe ran)")


class ReplayConfig(dg.Config):
    job_id: str | None = None
    job_ids: list[str] = []  # a batch of replays (the core's replay sensor)
    replay_of: int | None = None


@dg.op(retry_policy=OP_RETRY_POLICY)
@sanitized_body
def requeue_failed_job(context: dg.OpExecutionContext, config: ReplayConfig, reliability: ReliabilityResource,
                       conversion: ConversionResource) -> None:
    """Replay of dead-lettered conversions: each failed job goes back to `queued` with a fresh attempt budget.

    One job's refusal (gone, source missing) does not stop the others; the run fails at the end, naming
    the refused jobs, so their letters stay visible to the operator.
    """
    runtime = reliability.runtime()
    settings = settings_of(conversion)
    files = FileStore(settings.uploads_dir, settings.results_dir)
    reason = f"replay:{config.replay_of}" if config.replay_of is not None else "replay"
    refused: list[str] = []
    for job_id in ([config.job_id] if config.job_id else []) + list(config.job_ids):
        with runtime.engine.begin() as conn:
            job = repo.get(conn, job_id)
            if job is None:
                refused.append(f"{job_id}: does not exist")
                continue
            if job.status == "succeeded":  # done meanwhile (a user's retry): the dead letter closes
                runtime.succeeded(PIPELINE, job.id)
                context.log.info(f"{job.id} already succeeded; dead letter closed")
                continue
            if job.status in ("queued", "processing"):
                context.log.info(f"{job.id} is already {job.status}; its completion closes the dead letter")
                continue
            try:
                repo.manual_retry(conn, job.id, None, runtime.now(), files.source_present(job.source_location),
                                  reason=reason)
            except repo.RetryRefused as exc:
                refused.append(f"{job_id}: {exc.code}: {exc.message}")
                continue
        context.log.info(f"{job.id} requeued by {reason}; a worker run converts it")
    if refused:
        raise dg.Failure(description=f"replay refused for {len(refused)} job(s): " + "; ".join(refused[:20]),
                         allow_retries=False)


@dg.job(tags=TAGS)
def conversion_worker_job() -> None:
    """A conversion worker: drains due PDF-to-XML jobs (at most WORKER_RUNS of these run at once)."""
    convert_due_jobs()


@dg.job(tags=TAGS)
def conversion_breaker_probe_job() -> None:
    """Probes the PDF gateway's health while the circuit breaker is open; a success resumes dispatch."""
    probe_gateway()


@dg.job(tags=TAGS)
def conversion_replay_job() -> None:
    """Requeues one dead-lettered conversion job (`redrive dlq replay`)."""
    requeue_failed_job()


def replay_run_config(entity_ref: str, extra: Any) -> dict:
    return {"ops": {"requeue_failed_job": {"config": {"job_id": entity_ref, "replay_of": extra.get("replay_of")}}}}


def batch_replay_run_config(entity_refs: Sequence[str]) -> dict:
    return {"ops": {"requeue_failed_job": {"config": {"job_ids": list(entity_refs)}}}}


def worker_run_config(**overrides: Any) -> dict:
    return {"ops": {"convert_due_jobs": {"config": {k: v for k, v in overrides.items() if v is not None}}}}
