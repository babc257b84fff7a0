"""The conversion worker loop (003 §3.4, §3.5) — one code path for Dagster runs and plain processes.

Each turn: reclaim expired leases; claim one due job (SKIP LOCKED, oldest first — and nothing while
the circuit breaker is open: then hold the queue and probe the gateway once the cooldown has
passed); call the gateway with a timeout, stage the XML, and finish with a *fenced* write: complete,
schedule a retry (``queued`` + ``retryAfter``) or fail for good (dead letter + alert through the
core), recording the call in the breaker's window in the same transaction. A
heartbeat thread extends the lease on long jobs. On SIGTERM the worker stops claiming, lets the
in-flight job finish within WORKER_SHUTDOWN_GRACE_SEC, or requeues it cleanly, writes the final
status and only then disconnects.

Run it as a plain process::

    python -m assets.conversion.worker            # or, mounted in the operator command: redrive worker conversion
    python -m assets.conversion.worker --until-idle 10 --max-seconds 600

Every worker action is one JSON log line (003 §3.7): event, job_id, status, attempt, duration_ms,
gateway_status, error_code, breaker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import sqlalchemy as sa
import typer

from assets.conversion import policy
from assets.conversion import repository as repo
from assets.conversion.files import FileStore
from assets.conversion.settings import BREAKER, PIPELINE, ConversionSettings
from redrive.alerts import Alert
from redrive.backoff import FullJitter
from redrive.breaker import CircuitBreaker, Transition, counts_as_failure, record_call
from redrive.budgets import decide
from redrive.deadletters import FinalFailure
from redrive.failures import Failure
from redrive.reliability import Reliability
from redrive.sanitize import sanitize_text
from redrive.vocabularies import CONVERSION
from resources.conversion import Gateway

logger = logging.getLogger("redrive.conversion.worker")

STAGE = "convert"
MAX_CONSECUTIVE_ERRORS = 8
LOOP_BACKOFF = FullJitter(initial=1.0, max_delay=30.0)
"""Waits between turns that failed outside a job (the database unreachable): 002's full jitter, from the core."""


class ShutdownNow(BaseException):  # noqa: N818 - a control-flow signal, like KeyboardInterrupt
    """The shutdown grace ran out (or a second signal came): abandon the call and requeue the job."""


def new_worker_id() -> str:
    """Host, pid and a random suffix: unique per process, and says where a lease holder runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


# ---------------------------------------------------------------------------------------- structured logs


class JsonLog:
    """003 §3.7 structured log lines; the core's record factory still redacts every one."""

    def __init__(self, worker: str, also: Callable[[str], None] | None = None) -> None:
        self.worker = worker
        self.breaker = "closed"
        self.also = also

    def __call__(self, event: str, *, level: int = logging.INFO, **fields: Any) -> None:
        record = {"ts": datetime.now(UTC).isoformat(timespec="milliseconds"), "event": event,
                  "pipeline": PIPELINE, "worker": self.worker, "breaker": self.breaker,
                  **{k: v for k, v in fields.items() if v is not None}}
        line = json.dumps(record, default=str, separators=(",", ":"))
        logger.log(level, line)
        if self.also is not None:
            self.also(line)


# ------------------------------------------------------------------------------------------- shutdown


class Shutdown:
    """SIGTERM: stop claiming; the in-flight job has ``grace`` seconds, then :class:`ShutdownNow` is raised.

    The exception is only raised while the worker is in an interruptible section (reading the source,
    calling the gateway); during its final database writes the worker is never interrupted, so the
    last status it writes is whole. A second signal cuts the grace short.
    """

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.event = threading.Event()
        self._interruptible = False
        self._deadline_passed = False
        self._installed: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def request(self) -> None:
        self.event.set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking at once on shutdown; True when shutdown was requested."""
        return self.event.wait(max(0.0, seconds))

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Shutdown:
        for sig in signals:
            self._installed[sig] = signal.signal(sig, self._on_signal)
        self._installed[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._on_alarm)
        return self

    def uninstall(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, previous in self._installed.items():
            signal.signal(sig, previous)
        self._installed.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.event.is_set():
            self._deadline_passed = True
        self.event.set()
        if self._deadline_passed or self.grace <= 0:
            self._deadline_passed = True
            if self._interruptible:
                raise ShutdownNow()
        elif signal.SIGALRM in self._installed:
            signal.setitimer(signal.ITIMER_REAL, self.grace)

    def _on_alarm(self, signum: int, frame: object) -> None:
        self._deadline_passed = True
        if self._interruptible:
            raise ShutdownNow()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        if self._deadline_passed:
            raise ShutdownNow()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False


# ------------------------------------------------------------------------------------------- lease keeper


class LeaseKeeper:
    """003 §3.5: extend the held lease every WORKER_LEASE_EXTEND_SEC, from one thread per worker.

    :meth:`release` waits for an extension in progress, so no extension ever races the final write
    (which would be refused and look like a lost lease).
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.extensions = 0
        self._cond = threading.Condition()
        self._lease: repo.Lease | None = None
        self._due = 0.0
        self._closed = False
        self._thread: threading.Thread | None = None

    def hold(self, lease: repo.Lease) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"lease-keeper-{self.worker.worker_id}",
                                                daemon=True)
                self._thread.start()
            self._lease = lease
            self._due = time.monotonic() + self.worker.settings.worker_lease_extend_sec
            self._cond.notify()

    def release(self) -> None:
        with self._cond:  # held by the keeper while it extends: returns only once no extension is running
            self._lease = None
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._lease = None
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        every = self.worker.settings.worker_lease_extend_sec
        with self._cond:
            while not self._closed:
                if self._lease is None:
                    self._cond.wait()
                    continue
                remaining = self._due - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                lease, self._due = self._lease, time.monotonic() + every
                try:
                    if self.worker.extend(lease):
                        self.extensions += 1
                    else:
                        self._lease = None  # lost: the final write will be refused too, and say so
                except Exception:  # noqa: BLE001 - a missed extension is retried next period; the lease has slack
                    self.worker.log("lease_extend_error", job_id=lease.job_id, level=logging.WARNING)


# ---------------------------------------------------------------------------------------------- worker


@dataclass
class WorkerReport:
    claimed: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    requeued: int = 0
    reclaimed: int = 0
    fenced: int = 0
    probes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


Outcome = Literal["succeeded", "retry", "failed", "requeued", "fenced"]


@dataclass
class Worker:
    reliability: Reliability
    gateway: Gateway
    files: FileStore
    settings: ConversionSettings
    worker_id: str = field(default_factory=new_worker_id)
    shutdown: Shutdown = field(default_factory=lambda: Shutdown(30.0))
    log: JsonLog = None  # type: ignore[assignment]
    report: WorkerReport = field(default_factory=WorkerReport)

    def __post_init__(self) -> None:
        self.engine: sa.Engine = self.reliability.engine
        self.clock = self.reliability.clock
        self.breaker = CircuitBreaker(self.engine, BREAKER, self.settings.breaker_policy(self.reliability.time_scale),
                                      self.clock)
        self.backoff = self.settings.backoff()
        if self.log is None:
            self.log = JsonLog(self.worker_id)
        self.keeper = LeaseKeeper(self)
        self._last_reclaim: float | None = None
        self._held_logged = False

    # -- the loop -------------------------------------------------------------------------------------

    def run(self, *, until_idle: float | None = None, max_seconds: float | None = None,
            max_jobs: int | None = None) -> WorkerReport:
        """Loop until shutdown, ``max_seconds``, ``max_jobs``, or ``until_idle`` seconds with nothing to claim."""
        started = self.clock.monotonic()
        idle_since: float | None = None
        errors = 0
        self.log("worker_started", lease_ttl_sec=self.settings.worker_lease_ttl_sec)
        try:
            while not self.shutdown.requested:
                now = self.clock.monotonic()
                if max_seconds is not None and now - started >= max_seconds:
                    break
                if max_jobs is not None and self.report.claimed >= max_jobs:
                    break
                try:
                    outcome = self.step()
                    errors = 0
                except Exception as exc:  # noqa: BLE001 - the database blinked: back off, do not die at once
                    errors += 1
                    failure = policy.classify(exc)
                    self.log("worker_error", error_code=failure.code, consecutive=errors, level=logging.ERROR)
                    if not failure.retryable or errors >= MAX_CONSECUTIVE_ERRORS:
                        raise
                    self.shutdown.wait(LOOP_BACKOFF.delay(errors, self.reliability.rng_for(self.worker_id))
                                       * self.reliability.time_scale)
                    continue
                if outcome in ("processed",):
                    idle_since = None
                    continue
                if until_idle is not None:
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= until_idle:
                        break
                self.shutdown.wait(self.settings.worker_idle_sleep_sec)  # 003 §3.4: none claimed, sleep ~1–2 s
        except ShutdownNow:
            pass  # the in-flight job was requeued in `process`
        finally:
            self.keeper.close()
        self.log("worker_stopped", **self.report.as_dict(), shutdown=self.shutdown.requested)
        return self.report

    def step(self) -> Literal["processed", "idle", "held"]:
        """One turn: reclaim when due, claim and process at most one job; an open breaker holds the queue."""
        self.maybe_reclaim()
        lease = self.claim()  # the claim itself refuses to dispatch while the breaker is open
        if lease is not None:
            self.process(lease)
            return "processed"
        if not self.gate():
            return "held"
        self.maybe_reclaim(force=True)
        return "idle"

    # -- reclaim --------------------------------------------------------------------------------------

    def maybe_reclaim(self, force: bool = False) -> list[repo.Reclaimed]:
        every = min(5.0, self.settings.worker_lease_ttl_sec / 2)
        now = self.clock.monotonic()
        if not force and self._last_reclaim is not None and now - self._last_reclaim < every:
            return []
        if force and self._last_reclaim is not None and now - self._last_reclaim < min(every, 0.5):
            return []
        self._last_reclaim = now
        return self.reclaim()

    def reclaim(self) -> list[repo.Reclaimed]:
        """003 §3.4 reclaim step; a lease lost on the last attempt dead-letters the job."""
        now = self.clock.now()
        with self.engine.begin() as conn:
            moved = repo.reclaim_expired(conn, now, self.settings.retry_max_attempts)
        for r in moved:
            self.report.reclaimed += 1
            self.log("lease_expired", job_id=r.job_id, attempt=r.attempt, status="failed" if r.outcome == "fail" else "queued",
                     leased_by=r.leased_by, epoch=r.epoch, level=logging.WARNING)
            if r.outcome == "fail":
                failure = CONVERSION.apply(policy.LOST_LEASE)
                self._fail_for_good(r.job_id, None, failure, r.attempt, now)
        return moved

    # -- circuit breaker ------------------------------------------------------------------------------

    def gate(self) -> bool:
        """003 §3.3 hold-queue mode, after a claim found nothing: open → probe once the cooldown passed.

        True when the breaker is (or just became) closed, False while it holds the queue.
        """
        state = self.breaker.state()
        if not state.is_open:
            self.log.breaker = "closed"
            self._held_logged = False
            return True
        self.log.breaker = "open"
        probed = self.breaker.probe(self.gateway.healthy)
        if probed is not None:
            self.report.probes += 1
        if isinstance(probed, Transition):
            self.log.breaker = "closed"
            self.log("breaker_closed", open_seconds=round(probed.open_seconds, 3), open_count=probed.open_count)
            return True
        if probed is False:
            self.log("breaker_probe_failed", level=logging.WARNING)
        elif not self._held_logged:
            self.log("breaker_open_hold", status="queued")
        self._held_logged = True
        return False

    def _breaker_opened(self, transition: Transition, failure: Failure) -> None:
        self.log.breaker = "open"
        self.log("breaker_opened", failure_rate=round(transition.failure_rate, 3), open_count=transition.open_count,
                 error_code=failure.code, level=logging.WARNING)
        self.reliability.alert(Alert(
            pipeline=PIPELINE,
            kind="breaker_open",
            dedupe_key=f"breaker:{transition.breaker}:open:{transition.open_count}",
            summary=(f"PDF gateway circuit breaker opened ({transition.failure_rate:.0%} of the last "
                     f"{self.breaker.policy.window} calls failed, last: {failure.code}); conversion jobs stay "
                     "queued and resume when the gateway's health probe succeeds"),
            error_class=failure.code,
        ))

    # -- claim ----------------------------------------------------------------------------------------

    def claim(self) -> repo.Lease | None:
        if self.shutdown.requested:
            return None  # 003 §3.5: stop claiming
        now = self.clock.now()
        with self.engine.begin() as conn:
            lease = repo.claim(conn, self.worker_id, now, self.settings.worker_lease_ttl_sec, BREAKER)
        if lease is not None:
            self.report.claimed += 1
            self.log("job_claimed", job_id=lease.job_id, status="processing", attempt=lease.attempt, epoch=lease.epoch)
        return lease

    def extend(self, lease: repo.Lease) -> bool:
        now = self.clock.now()
        with self.engine.begin() as conn:
            ok = repo.extend(conn, lease, now, self.settings.worker_lease_ttl_sec)
        if ok:
            self.log("lease_extended", job_id=lease.job_id, attempt=lease.attempt, epoch=lease.epoch)
        else:
            self._fenced(lease, "extend")
        return ok

    # -- process --------------------------------------------------------------------------------------

    def process(self, lease: repo.Lease) -> Outcome:
        start = time.perf_counter()  # durations are measurements, not decisions: the real clock
        call_ms: float | None = None
        xml: bytes | None = None
        failure: Failure | None = None
        self.keeper.hold(lease)
        try:
            with self.shutdown.interruptible():
                try:
                    pdf = self.files.read_source(lease.source_location)
                except FileNotFoundError as exc:
                    raise SourceMissing() from exc
                call_start = time.perf_counter()
                try:
                    xml = self.gateway.convert(pdf)
                finally:
                    call_ms = round((time.perf_counter() - call_start) * 1000, 2)
                policy.check_xml(xml)
        except SourceMissing:
            failure = SOURCE_MISSING
            call_ms = None  # the gateway was never called: nothing for the breaker
        except (ShutdownNow, KeyboardInterrupt):
            self.keeper.release()
            self.requeue(lease, "shutdown")
            raise
        except Exception as exc:  # noqa: BLE001 - every failure is classified, none escapes unnamed
            failure = policy.classify(exc)
        except BaseException:  # Dagster's interrupt on run termination, SystemExit…: requeue, then let it go
            self.keeper.release()
            self.requeue(lease, "interrupted")
            raise
        finally:
            self.keeper.release()
        duration_ms = round((time.perf_counter() - start) * 1000, 1)
        if failure is None:
            assert xml is not None
            return self._complete(lease, xml, duration_ms, call_ms)
        return self._failed(lease, failure, duration_ms, call_ms)

    def _record_call(self, conn: sa.Connection, failure: Failure | None, call_ms: float | None) -> Transition | None:
        """The gateway call into the breaker's window, in the same transaction as the job's final write.

        4xx answers and bad XML count as a healthy gateway; 5xx, timeouts and network errors do not.
        """
        if call_ms is None:
            return None
        ok = failure is None or not counts_as_failure(failure)
        return record_call(conn, BREAKER, ok, call_ms, self.clock.now(), self.breaker.policy)

    def _complete(self, lease: repo.Lease, xml: bytes, duration_ms: float, call_ms: float | None) -> Outcome:
        staged = self.files.stage_result(lease.job_id, lease.epoch, xml)
        now = self.clock.now()
        published = False
        try:
            with self.engine.begin() as conn:
                self._record_call(conn, None, call_ms)
                if repo.complete(conn, lease, staged.location, now,
                                 {"worker": lease.worker, "epoch": lease.epoch, "duration_ms": duration_ms,
                                  "gateway_status": 200, "bytes": len(xml)}):
                    self.files.publish(staged)  # inside the transaction: the row lock keeps a reclaim away
                    published = True
        finally:
            if not published:
                self.files.discard(staged)
        if not published:
            self._fenced(lease, "complete")
            return "fenced"
        self.report.succeeded += 1
        self.log("job_completed", job_id=lease.job_id, status="succeeded", attempt=lease.attempt,
                 duration_ms=duration_ms, gateway_status=200)
        if lease.has_dead_letter:
            self.reliability.succeeded(PIPELINE, lease.job_id)  # a retried or replayed job closes its dead letter
        return "succeeded"

    def _failed(self, lease: repo.Lease, failure: Failure, duration_ms: float, call_ms: float | None) -> Outcome:
        now = self.clock.now()
        rng = self.reliability.rng_for(f"{PIPELINE}:{lease.job_id}:{STAGE}:{lease.attempt}")
        decision = decide(failure, lease.attempt, self.settings.retry_max_attempts, self.backoff, rng)
        meta = {"worker": lease.worker, "epoch": lease.epoch, "duration_ms": duration_ms,
                "gateway_status": failure.upstream_status}
        message = sanitize_text(failure.message)[:300]
        if decision.retry:
            wait = policy.scaled_seconds(decision.delay, self.reliability.time_scale)
            retry_at = now + timedelta(seconds=wait)
            with self.engine.begin() as conn:
                transition = self._record_call(conn, failure, call_ms)
                ok = repo.schedule_retry(conn, lease, failure.code, message, retry_at, now,
                                         {**meta, "delay_ms": round(wait * 1000, 1)})
            if transition is not None:
                self._breaker_opened(transition, failure)
            if not ok:
                self._fenced(lease, "retry")
                return "fenced"
            self.report.retried += 1
            self.log("job_retry_scheduled", job_id=lease.job_id, status="queued", attempt=lease.attempt,
                     duration_ms=duration_ms, gateway_status=failure.upstream_status, error_code=failure.code,
                     retry_in_ms=round(wait * 1000, 1), level=logging.WARNING)
            return "retry"
        with self.engine.begin() as conn:
            transition = self._record_call(conn, failure, call_ms)
            ok = repo.fail(conn, lease, failure.code, message, now, {**meta, "reason": decision.reason})
        if transition is not None:
            self._breaker_opened(transition, failure)
        if not ok:
            self._fenced(lease, "fail")
            return "fenced"
        self.log("job_failed", job_id=lease.job_id, status="failed", attempt=lease.attempt, duration_ms=duration_ms,
                 gateway_status=failure.upstream_status, error_code=failure.code, reason=decision.reason,
                 level=logging.ERROR)
        self._fail_for_good(lease.job_id, lease.owner, failure, lease.attempt, now)
        return "failed"

    def _fail_for_good(self, job_id: str, owner: str | None, failure: Failure, attempts: int, now: datetime) -> None:
        self.report.failed += 1
        self.reliability.fail_for_good(FinalFailure(
            pipeline=PIPELINE, stage=STAGE, entity_ref=job_id, failure=failure, attempts=attempts, at=now,
            tenant=owner, context={"job_id": job_id, "error_code": failure.code},
            payload_ref={"table": "conversion_jobs", "id": job_id},
        ))

    def requeue(self, lease: repo.Lease, reason: str) -> bool:
        """003 §3.5: the in-flight job cannot finish — back to ``queued``, lease cleared, attempt given back."""
        with self.engine.begin() as conn:
            ok = repo.requeue(conn, lease, self.clock.now(), reason)
        if ok:
            self.report.requeued += 1
            self.log("job_requeued", job_id=lease.job_id, status="queued", attempt=lease.attempt, reason=reason,
                     level=logging.WARNING)
        else:
            self._fenced(lease, "requeue")
        return ok

    def _fenced(self, lease: repo.Lease, write: str) -> None:
        """A late write of a lease that was reclaimed: refused by the database, logged and counted."""
        self.report.fenced += 1
        with self.engine.begin() as conn:
            repo.record_fenced(conn, lease, write, self.clock.now())
        self.log("lease_lost_write_refused", job_id=lease.job_id, attempt=lease.attempt, epoch=lease.epoch,
                 write=write, level=logging.WARNING)


class SourceMissing(Exception):
    """The uploaded PDF is gone (retention or an operator); retrying cannot bring it back."""


SOURCE_MISSING = Failure("EXPIRED", False, None, "the uploaded PDF is no longer stored", "source file missing")


# ------------------------------------------------------------------------------------------ the process


def build_worker(settings: ConversionSettings | None = None, *, worker_id: str | None = None) -> Worker:
    """A worker for a plain process, from the environment alone (the same factories as the code location)."""
    from resources.database import resolve_database_url
    from redrive.settings import Settings
    from resources.conversion import HttpGateway
    from resources.factory import build_resources

    core = Settings()
    conv = settings or ConversionSettings()
    core = core.model_copy(update={"database_url": resolve_database_url(core)})
    reliability = build_resources(core)["reliability"].runtime()
    gateway = HttpGateway(conv.gateway_base_url(core), conv.gateway_timeout_ms / 1000)
    shutdown = Shutdown(conv.worker_shutdown_grace_sec)
    wid = worker_id or new_worker_id()
    return Worker(reliability, gateway, FileStore(conv.uploads_dir, conv.results_dir), conv, worker_id=wid,
                  shutdown=shutdown, log=JsonLog(wid))


worker_app = typer.Typer(help="run a pipeline's worker as a plain process", add_completion=False,
                         pretty_exceptions_enable=False)


@worker_app.command("conversion")
def conversion(
    until_idle: Annotated[float | None, typer.Option(help="exit after this many seconds with nothing to claim")] = None,
    max_seconds: Annotated[float | None, typer.Option(help="stop claiming after this many seconds")] = None,
    worker_id: Annotated[str | None, typer.Option(help="lease holder name (default host:pid:random)")] = None,
) -> None:
    """Claim and convert PDF jobs until SIGTERM (003 §3.4); configuration from the environment (003 §7)."""
    from redrive import logs

    logs.install()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        worker = build_worker(worker_id=worker_id)
    except Exception as exc:  # noqa: BLE001 - one line, never a stack trace
        typer.echo(f"error: cannot start the conversion worker: {sanitize_text(type(exc).__name__)}", err=True)
        raise typer.Exit(2) from None
    worker.shutdown.install()
    try:
        worker.run(until_idle=until_idle, max_seconds=max_seconds)
    finally:
        worker.shutdown.uninstall()
        worker.gateway.close()
        worker.engine.dispose()  # 003 §3.5: disconnect only after the final status write


if __name__ == "__main__":
    worker_app()
