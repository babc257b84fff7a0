"""The conversion worker (003 §3.4, §3.5) — one code path for Dagster runs and plain processes.

WORKER_CONCURRENCY jobs are in flight per worker, each under its own fenced lease. Threads, not
asyncio: the gateway client, the source read and the result's fsync are blocking calls, the Gateway
protocol is synchronous, and psycopg2 and fsync release the GIL — so a slot thread per job in flight
keeps the worker's one code path and every seam as it was, where asyncio would need an async gateway,
an async driver and still a thread for the fsync.

The main thread owns the database. Each turn it writes what the slots finished and claims for the
slots that freed, in as few statements and commits as correctness allows: the turn's staged results
are made durable together (RESULTS_SYNC=turn: one syncfs, see :mod:`assets.conversion.files`), then the
successes of the turn, their breaker calls and the next claim are ONE prepared statement on a held
connection (no pool checkout, no pre-ping), then the staged results are published (renamed, one
directory fsync) while the row locks are held, then one COMMIT. A write error the file system
reports stops the worker (:class:`~assets.conversion.files.ResultsNotDurable`): its leases go back.
Failures (rare) take the careful path: the breaker's window read, the retry or the final failure —
job ``failed``, dead letter and alert in one transaction.
A lease keeper thread extends every held lease in one fenced statement. A completion whose lease was
reclaimed is refused by the database and its staged file discarded; staged files of killed workers
are swept by the reclaim step. The loop waits out a database outage with capped backoff and says so
in its logs and health. On SIGTERM it stops claiming, lets the jobs in flight finish within
WORKER_SHUTDOWN_GRACE_SEC, or requeues them cleanly, writes the final status and only then disconnects.

Run it as a plain process::

    python -m assets.conversion.worker            # or, mounted in the operator command: redrive worker conversion
    python -m assets.conversion.worker --until-idle 10 --max-seconds 600

Every worker action is one JSON log line (003 §3.7): event, job_id, status, attempt, duration_ms,
gateway_status, error_code, breaker — built only when its level is enabled.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import sqlalchemy as sa
import typer

from assets.conversion import policy
from assets.conversion import repository as repo
from assets.conversion.files import FileStore, ResultsNotDurable, Staged
from assets.conversion.settings import BREAKER, PIPELINE, ConversionSettings, file_store
from redrive import logs, upstreams
from redrive.alerts import Alert
from redrive.backoff import FullJitter
from redrive.breaker import CircuitBreaker, Transition, counts_as_failure, prune_due, prune_if_due, record_call
from redrive.clock import Clock, SystemClock
from redrive.deadletters import FinalFailure
from redrive.failures import Failure
from redrive.reliability import Reliability
from redrive.sanitize import sanitize_text
from redrive.settle import Budget, Verdict, settle
from redrive.vocabularies import CONVERSION
from resources.conversion import Gateway

logger = logging.getLogger("redrive.conversion.worker")

STAGE = "convert"
LOOP_BACKOFF_INITIAL = 1.0
"""Waits between turns that failed outside a job (the database unreachable): 002's full jitter from the core,
capped at WORKER_DB_BACKOFF_MAX_SEC; the worker never gives up on the database, only on a bug."""
OUTAGE_LOG_EVERY = 60.0
"""While the database stays away, one ``database_unavailable`` line a minute (and the health file)."""


class ShutdownNow(BaseException):  # noqa: N818 - a control-flow signal, like KeyboardInterrupt
    """The shutdown grace ran out (or a second signal came): abandon the call and requeue the job."""


def new_worker_id() -> str:
    """Host, pid and a random suffix: unique per process, and says where a lease holder runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


# ---------------------------------------------------------------------------------------- structured logs


class JsonLog:
    """003 §3.7 structured log lines: the event is the message, its fields are the record's ``extra``.

    The process's formatter (``REDRIVE_LOG_FORMAT``, :mod:`redrive.logs`) writes them as one JSON
    object per line and redacts every field. ``entity`` and ``error_class`` repeat ``job_id`` and
    ``error_code`` under the names every pipeline's lines share.
    """

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.breaker = "closed"
        self.run_id: str | None = None

    def __call__(self, event: str, *, level: int = logging.INFO, **fields: Any) -> None:
        if not logger.isEnabledFor(level):
            return  # issue 14: no line is built for a level that is off
        extra = {"event": event, "pipeline": PIPELINE, "stage": STAGE, "worker": self.worker,
                 "breaker": self.breaker, "run_id": self.run_id,
                 **{k if k not in _RESERVED else f"{k}_": v for k, v in fields.items()}}
        extra["entity"], extra["error_class"] = fields.get("job_id"), fields.get("error_code")
        logger.log(level, event, extra=logs.fields(**extra))


_RESERVED = logs.STANDARD_ATTRIBUTES


# ------------------------------------------------------------------------------------------- shutdown


class Shutdown:
    """SIGTERM: stop claiming; the jobs in flight have ``grace`` seconds, then :class:`ShutdownNow` is raised.

    The grace is a deadline on ``clock`` (the system clock unless a test gives its own), checked by the
    worker's wait for its slots — never an alarm: SIGALRM stays the process's (a library or the host
    program may use it). The exception is only raised while the worker is in an interruptible section
    (waiting for its slots); during its final database writes the worker is never interrupted, so the
    last status it writes is whole. A second signal cuts the grace short.
    """

    def __init__(self, grace: float, clock: Clock | None = None) -> None:
        self.grace = grace
        self.event = threading.Event()
        self._clock: Clock = clock or SystemClock()
        self._deadline: float | None = None
        self._cut_short = False
        self._interruptible = False
        self._installed: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def request(self) -> None:
        """Stop claiming and start the grace; asked again, the grace is over at once."""
        if self.event.is_set():
            self._cut_short = True
        else:
            self._deadline = self._clock.monotonic() + max(0.0, self.grace)
        self.event.set()

    @property
    def expired(self) -> bool:
        """The grace ran out (or was cut short): what is still in flight is requeued."""
        return self._cut_short or (self._deadline is not None and self._clock.monotonic() >= self._deadline)

    def remaining(self) -> float | None:
        """Seconds of grace left; None while no shutdown was asked for."""
        if self._deadline is None:
            return None
        return 0.0 if self._cut_short else max(0.0, self._deadline - self._clock.monotonic())

    def check(self) -> None:
        if self.expired:
            raise ShutdownNow()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking at once on shutdown; True when shutdown was requested."""
        return self.event.wait(max(0.0, seconds))

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> Shutdown:
        for sig in signals:
            self._installed[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._installed.items():
            signal.signal(sig, previous)
        self._installed.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.request()
        if self._interruptible and self.expired:
            raise ShutdownNow()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        self.check()
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False


# ------------------------------------------------------------------------------------------- lease keeper


class LeaseKeeper:
    """003 §3.5: every held lease extended WORKER_LEASE_EXTEND_SEC after it was taken or last extended.

    One thread per worker; the leases due at the same moment go out in one fenced statement, each
    with its own epoch. :meth:`release` waits for an extension in progress, so no extension ever races
    a job's final write (which would be refused and look like a lost lease).
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.extensions = 0
        self._cond = threading.Condition()
        self._due: dict[str, tuple[float, repo.Lease]] = {}
        self._closed = False
        self._thread: threading.Thread | None = None

    def hold(self, leases: Sequence[repo.Lease]) -> None:
        if not leases:
            return
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"lease-keeper-{self.worker.worker_id}",
                                                daemon=True)
                self._thread.start()
            idle = not self._due
            due = time.monotonic() + self.worker.settings.worker_lease_extend_sec
            for lease in leases:
                self._due[lease.job_id] = (due, lease)
            if idle:  # otherwise it already waits for an earlier due time and then sees these: no wake-up a turn
                self._cond.notify()

    def release(self, job_ids: Sequence[str]) -> None:
        with self._cond:  # held by the keeper while it extends: returns only once no extension is running
            for job_id in job_ids:
                self._due.pop(job_id, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._cond:  # a worker may run again (tests do): the next hold starts a new keeper
            self._thread, self._closed = None, False

    def _run(self) -> None:
        every = self.worker.settings.worker_lease_extend_sec
        with self._cond:
            while not self._closed:
                if not self._due:
                    self._cond.wait()
                    continue
                now = time.monotonic()
                first = min(d for d, _ in self._due.values())
                if first > now:
                    self._cond.wait(first - now)
                    continue
                due = [lease for d, lease in self._due.values() if d <= now]
                try:
                    held = self.worker.extend_many(due)
                except Exception:  # noqa: BLE001 - a missed extension is retried soon; the lease has slack
                    self.worker.log("lease_extend_error", in_flight=len(due), level=logging.WARNING)
                    retry_at = now + min(every, 1.0)
                    for lease in due:
                        self._due[lease.job_id] = (retry_at, lease)
                    continue
                self.extensions += len(held)
                for lease in due:
                    if lease.job_id in held:
                        self._due[lease.job_id] = (now + every, lease)
                    else:
                        self._due.pop(lease.job_id, None)  # lost: its final write will be refused too, and say so


# ---------------------------------------------------------------------------------------------- slots


@dataclass(frozen=True)
class Attempt:
    """What a slot thread brings back from one job: a staged result or a failure, and its timings."""

    lease: repo.Lease
    staged: Staged | None
    size: int
    failure: Failure | None
    call_ms: float | None
    duration_ms: float
    deferred: upstreams.RetryDeferred | None = None  # the gateway's retry budget held this retry back: nothing sent


class Slots:
    """WORKER_CONCURRENCY daemon threads: each takes a lease, runs the attempt, hands the :class:`Attempt` back.

    Daemon threads, so a process whose shutdown grace ran out exits without waiting for a gateway
    call it has abandoned (the job was requeued; its staged file, if any, is swept later).
    """

    def __init__(self, size: int, attempt: Callable[[repo.Lease], Attempt], name: str) -> None:
        self.size = size
        self.finished: queue.SimpleQueue[Attempt] = queue.SimpleQueue()
        self._todo: queue.SimpleQueue[repo.Lease | None] = queue.SimpleQueue()
        self._attempt = attempt
        self._threads = [threading.Thread(target=self._run, name=f"{name}-slot-{i}", daemon=True)
                         for i in range(size)]
        self._started = False
        self.busy = 0  # leases taken but not handed back; read by the main thread's orphan check
        self._busy_lock = threading.Lock()

    def idle(self) -> bool:
        """No lease queued, none being worked on and nothing waiting to be collected."""
        return self.busy == 0 and self._todo.empty() and self.finished.empty()

    def submit(self, leases: Sequence[repo.Lease]) -> None:
        if not self._started:
            for t in self._threads:
                t.start()
            self._started = True
        for lease in leases:
            with self._busy_lock:
                self.busy += 1
            self._todo.put(lease)

    def take_unstarted(self) -> list[repo.Lease]:
        """The leases no thread has taken yet (claimed ahead), out of the queue."""
        taken: list[repo.Lease] = []
        while True:
            try:
                lease = self._todo.get_nowait()
            except queue.Empty:
                return taken
            if lease is None:  # a stop marker of close(): not ours to take
                self._todo.put(None)
                return taken
            with self._busy_lock:
                self.busy -= 1
            taken.append(lease)

    def close(self) -> None:
        """Stop the threads once their current job is done; a later submit starts fresh ones."""
        if self._started:
            for _ in self._threads:
                self._todo.put(None)
            self._threads = [threading.Thread(target=self._run, name=t.name, daemon=True) for t in self._threads]
            self._started = False

    def _run(self) -> None:
        while True:
            lease = self._todo.get()
            if lease is None:
                return
            try:
                self.finished.put(self._attempt(lease))
            finally:
                with self._busy_lock:
                    self.busy -= 1


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
    deferred: int = 0
    probes: int = 0
    swept: int = 0
    db_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Health:
    """What the worker says about itself (issue 13 item 13): in the logs, and in WORKER_HEALTH_FILE if set."""

    status: Literal["ok", "degraded"] = "ok"
    database: Literal["up", "unreachable"] = "up"
    since: str | None = None
    consecutive_errors: int = 0
    last_error: str | None = None
    in_flight: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


Outcome = Literal["succeeded", "retry", "failed", "requeued", "fenced", "deferred"]
Sleep = Callable[[float], object]


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
    sleep: Sleep | None = None
    """Waits between turns (idle, database outage); default: the shutdown event's wait, which wakes on SIGTERM."""

    def __post_init__(self) -> None:
        self.engine: sa.Engine = self.reliability.engine
        self.clock = self.reliability.clock
        self.breaker = CircuitBreaker(self.engine, BREAKER, self.settings.breaker_policy(self.reliability.time_scale),
                                      self.clock)
        self.backoff = self.settings.backoff()
        self.loop_backoff = FullJitter(initial=LOOP_BACKOFF_INITIAL, max_delay=self.settings.worker_db_backoff_max_sec)
        if self.log is None:
            self.log = JsonLog(self.worker_id)
        if self.sleep is None:
            self.sleep = self.shutdown.wait
        self.keeper = LeaseKeeper(self)
        self.slots = Slots(self.settings.worker_concurrency, self._attempt, self.worker_id)
        self.hot = repo.HotPath(self.engine, BREAKER, idle_limit_ms=self._idle_limit_ms())
        self.health = Health()
        self.in_flight: dict[tuple[str, int], repo.Lease] = {}
        self.abandoned: set[tuple[str, int]] = set()
        self._lost: set[tuple[str, int]] = set()  # leases another worker reclaimed while we were away
        self._unwritten: list[Attempt] = []
        self._turn_seconds = 0.0  # moving averages of a turn's writes and of a job's attempt, for claim_ahead
        self._job_seconds = 0.0
        self._last_reclaim: float | None = None
        self._legacy_swept = False  # the results folder itself is listed once per process (files.staged_files)
        self._held_logged = False
        self._outage_logged_at: float | None = None
        self._outage_started = 0.0

    # -- the loop -------------------------------------------------------------------------------------

    def run(self, *, until_idle: float | None = None, max_seconds: float | None = None,
            max_jobs: int | None = None) -> WorkerReport:
        """Loop until shutdown, ``max_seconds``, ``max_jobs``, or ``until_idle`` seconds with nothing to claim.

        Jobs in flight when it stops claiming are finished and written before it returns.
        """
        started = self.clock.monotonic()
        idle_since: float | None = None
        self.log("worker_started", lease_ttl_sec=self.settings.worker_lease_ttl_sec,
                 concurrency=self.settings.worker_concurrency, results_sync="turn" if self.files.turn_sync else "file")
        self._write_health()
        try:
            while True:
                now = self.clock.monotonic()
                stopping = self.shutdown.requested or (max_seconds is not None and now - started >= max_seconds)
                claiming = not stopping and (max_jobs is None or self.report.claimed < max_jobs)
                if not claiming and not self.in_flight and not self._unwritten:
                    break
                try:
                    if stopping:  # 003 §3.5: finish what is in flight; what was claimed ahead goes back now
                        self._give_back(self.slots.take_unstarted())
                    state = self.turn(claim=claiming, limit=None if max_jobs is None
                                      else max(0, max_jobs - self.report.claimed))
                except ResultsNotDurable:
                    raise  # not an outage to wait out: no staged result can be trusted any more
                except Exception as exc:  # noqa: BLE001 - the database is away: wait it out, never die of it
                    failure = policy.classify(exc)
                    if not failure.retryable:
                        raise
                    self._database_error(failure)
                    continue
                self._database_back()
                if state == "busy":
                    idle_since = None
                    continue
                if not claiming:
                    continue
                if until_idle is not None:
                    idle_since = now if idle_since is None else idle_since
                    if now - idle_since >= until_idle:
                        break
                self.sleep(self.settings.worker_idle_sleep_sec)  # 003 §3.4: none claimed, sleep ~1–2 s
        except (ShutdownNow, KeyboardInterrupt):
            self._abandon("shutdown")
        except ResultsNotDurable:
            self.log("results_not_durable", in_flight=len(self.in_flight), level=logging.CRITICAL)
            self._abandon("results_not_durable")
            raise
        except BaseException:  # Dagster's interrupt on run termination, SystemExit…: requeue, then let it go
            self._abandon("interrupted")
            raise
        finally:
            self.keeper.close()
            self.slots.close()
            self.hot.close()
        self.log("worker_stopped", **self.report.as_dict(), shutdown=self.shutdown.requested)
        return self.report

    def turn(self, *, claim: bool = True, limit: int | None = None) -> Literal["busy", "idle", "held"]:
        """Write what finished, claim for the free slots (and a few ahead), reclaim expired leases, then wait
        for the next job to finish.

        What finished is written before anything is reclaimed (issue 26 §2): after a pause or a database
        outage longer than the lease, our own expired leases are still ours until someone reclaims them
        (the epoch decides), so results our slots finished meanwhile are recorded, not refused.
        """
        finished = self._unwritten + self._collect(block=False)
        self._measure_jobs(finished)
        ahead = policy.claim_ahead(self.settings.worker_concurrency, self._turn_seconds, self._job_seconds)
        free = self.settings.worker_concurrency + ahead - len(self.in_flight) + len(finished)
        want = max(0, min(free, limit if limit is not None else free)) if claim else 0
        self._unwritten = list(finished)  # a copy: _write removes what it wrote from the retry list
        started = time.perf_counter()  # a measurement for claim_ahead, not a decision on time: the real clock
        claimed = self._write(finished, want)
        if finished or claimed:
            self._turn_seconds = _ewma(self._turn_seconds, time.perf_counter() - started)
        self._unwritten = []
        if claimed:
            self._start(claimed)
        self.maybe_reclaim()
        if self.in_flight:
            self._unwritten = self._collect(block=True)
            return "busy"
        if claimed or finished:
            return "busy"
        if claim and not self.gate():
            return "held"
        if claim:
            self.maybe_reclaim(force=True)
        return "idle"

    def step(self) -> Literal["processed", "idle", "held"]:
        """One synchronous turn (tests, probes): claim up to WORKER_CONCURRENCY due jobs, finish and write them all."""
        self.maybe_reclaim()
        claimed = self._write([], self.settings.worker_concurrency)
        if claimed:
            self._start(claimed)
            while self.in_flight:
                self._write(self._collect(block=True), 0)
            return "processed"
        if not self.gate():
            return "held"
        self.maybe_reclaim(force=True)
        return "idle"

    def _start(self, leases: Sequence[repo.Lease]) -> None:
        for lease in leases:
            self.in_flight[(lease.job_id, lease.epoch)] = lease
            self.report.claimed += 1
            self.log("job_claimed", job_id=lease.job_id, status="processing", attempt=lease.attempt,
                     epoch=lease.epoch)
        self.keeper.hold(leases)
        self.slots.submit(leases)

    def _measure_jobs(self, finished: Sequence[Attempt]) -> None:
        for attempt in finished:
            self._job_seconds = _ewma(self._job_seconds, attempt.duration_ms / 1000)

    def _give_back(self, leases: Sequence[repo.Lease]) -> None:
        """Claimed ahead, never started: back to ``queued`` with their attempt, as a shutdown requeue does."""
        for lease in leases:
            self.keeper.release([lease.job_id])
            self.in_flight.pop((lease.job_id, lease.epoch), None)
            try:
                self.requeue(lease, "not started")
            except Exception:  # noqa: BLE001 - the database is away: the lease expires and the reclaim takes it over
                self.log("requeue_error", job_id=lease.job_id, level=logging.ERROR)

    def _collect(self, *, block: bool) -> list[Attempt]:
        """Attempts the slots finished: wait for one if ``block`` (interruptible by the shutdown grace), then
        take every other one already there — a turn writes them together (group commit)."""
        out: list[Attempt] = []
        if block:
            with self.shutdown.interruptible():
                while True:
                    grace = self.shutdown.remaining()
                    try:
                        out.append(self.slots.finished.get(timeout=0.5 if grace is None else min(0.5, grace)))
                        break
                    except queue.Empty:
                        self.shutdown.check()  # the grace ran out: requeue what is still in flight
                        if self.slots.idle() and self.in_flight:
                            self._orphaned()
                            return out
                        if self._reclaim_due():
                            return out  # let the loop reclaim and sweep while long jobs run
        while True:
            try:
                out.append(self.slots.finished.get_nowait())
            except queue.Empty:
                break
        kept = []
        for attempt in out:
            key = (attempt.lease.job_id, attempt.lease.epoch)
            if key in self.abandoned:  # requeued at shutdown meanwhile
                self.abandoned.discard(key)
                if attempt.staged is not None:
                    self.files.discard(attempt.staged)
                continue
            kept.append(attempt)
        return kept

    def _orphaned(self) -> None:
        """Leases no slot will ever hand back (a bug if it happens): forget them; their leases expire and are reclaimed."""
        for key, lease in list(self.in_flight.items()):
            self.log("lease_orphaned", job_id=lease.job_id, epoch=lease.epoch, level=logging.ERROR)
            self.keeper.release([lease.job_id])
            del self.in_flight[key]

    # -- database outages (issue 13 item 13) ------------------------------------------------------------

    def _database_error(self, failure: Failure) -> None:
        self.report.db_errors += 1
        h = self.health
        h.consecutive_errors += 1
        h.last_error = failure.code
        now = self.clock.monotonic()
        if h.database == "up":
            h.status, h.database, h.since = "degraded", "unreachable", self.clock.now().isoformat()
            self._outage_started = now
            self._outage_logged_at = None
        if self._outage_logged_at is None or now - self._outage_logged_at >= OUTAGE_LOG_EVERY:
            self._outage_logged_at = now
            self.log("database_unavailable", error_code=failure.code, consecutive=h.consecutive_errors,
                     outage_sec=round(now - self._outage_started, 1), in_flight=len(self.in_flight),
                     level=logging.ERROR)
            self._write_health()
        rng = self.reliability.rng_for(f"{self.worker_id}:{h.consecutive_errors}")
        self.sleep(self.loop_backoff.delay(min(h.consecutive_errors, 30), rng) * self.reliability.time_scale)

    def _database_back(self) -> None:
        h = self.health
        if h.database == "up":
            return
        outage = round(self.clock.monotonic() - self._outage_started, 1)
        self.log("database_recovered", outage_sec=outage, consecutive=h.consecutive_errors, level=logging.WARNING)
        self.health = Health(in_flight=len(self.in_flight))
        self._write_health()

    def _write_health(self) -> None:
        target: Path | None = self.settings.worker_health_file
        if target is None:
            return
        body = json.dumps({**self.health.as_dict(), "worker": self.worker_id,
                           "at": self.clock.now().isoformat()}).encode()
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(body)
            os.replace(tmp, target)
        except OSError:
            self.log("health_file_error", level=logging.WARNING)

    # -- transactions ---------------------------------------------------------------------------------

    def _idle_limit_ms(self) -> int:
        """How long PostgreSQL waits on this worker inside a transaction: one lease (at least a second)."""
        return max(1000, int(self.settings.worker_lease_ttl_sec * 1000))

    @contextlib.contextmanager
    def _begin(self) -> Iterator[sa.Connection]:
        """A transaction PostgreSQL ends by itself if this process freezes inside it for longer than a lease.

        A worker stopped mid-transaction (SIGSTOP, a frozen VM, a partition that keeps the socket open) would
        otherwise keep its rows locked for as long as it is away; the reclaim skips locked rows, so its jobs
        would wait for it however long their leases have been expired. Past a lease they are not ours anyway.
        """
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"SET LOCAL idle_in_transaction_session_timeout = {self._idle_limit_ms()}")
            yield conn

    # -- reclaim --------------------------------------------------------------------------------------

    def _reclaim_due(self) -> bool:
        every = min(5.0, self.settings.worker_lease_ttl_sec / 2)
        return self._last_reclaim is None or self.clock.monotonic() - self._last_reclaim >= every

    def maybe_reclaim(self, force: bool = False) -> list[repo.Reclaimed]:
        every = min(5.0, self.settings.worker_lease_ttl_sec / 2)
        now = self.clock.monotonic()
        if not force and self._last_reclaim is not None and now - self._last_reclaim < every:
            return []
        if force and self._last_reclaim is not None and now - self._last_reclaim < min(every, 0.5):
            return []
        self._last_reclaim = now
        self._keep_own_leases()
        moved = self.reclaim()
        self.sweep_staged()
        return moved

    def _keep_own_leases(self) -> None:
        """Extend every lease this worker still holds before reclaiming: after a pause (GC, SIGSTOP, a frozen
        VM) or an outage our leases may have run out while our slots kept working; they are still ours unless
        another worker reclaimed them (the fenced extension says which), so our own reclaim must not take them
        and charge their jobs for our pause."""
        leases = [lease for key, lease in self.in_flight.items() if key not in self._lost]
        if not leases:
            return
        now = self.clock.now()
        with self._begin() as conn:
            held = repo.extend_many(conn, leases, now, self.settings.worker_lease_ttl_sec)
        for lease in leases:
            if lease.job_id not in held:  # reclaimed by another worker while we were away: its write will say so
                self._lost.add((lease.job_id, lease.epoch))
                self._fenced(lease, "extend")

    def reclaim(self) -> list[repo.Reclaimed]:
        """003 §3.4 reclaim step; a lease lost on the last attempt fails the job, dead letter and alert included,
        in the same transaction (issue 13 item 3)."""
        now = self.clock.now()
        with self._begin() as conn:
            moved = repo.reclaim_expired(conn, now, self.settings.retry_max_attempts)
            for r in moved:
                if r.outcome == "fail":
                    self._record_final(conn, r.job_id, None, CONVERSION.apply(policy.LOST_LEASE), r.attempt, now)
        for r in moved:
            self.report.reclaimed += 1
            self.log("lease_expired", job_id=r.job_id, attempt=r.attempt, status="failed" if r.outcome == "fail" else "queued",
                     leased_by=r.leased_by, epoch=r.epoch, level=logging.WARNING)
            if r.outcome == "fail":
                self.report.failed += 1
        if any(r.outcome == "fail" for r in moved):
            self.reliability.try_dispatch()
        return moved

    def sweep_staged(self) -> int:
        """Issue 13 item 9: staged results whose lease is no longer held (a killed worker's) are removed.

        A file is kept while its job is ``processing`` under the epoch in its name: its writer may still
        complete. Any other epoch can never complete again (fencing), so its file is an orphan.
        """
        staged = self.files.staged_files(legacy=not self._legacy_swept)
        self._legacy_swept = True
        if not staged:
            return 0
        with self.engine.connect() as conn:
            current = repo.lease_epochs(conn, sorted({job_id for _, job_id, _ in staged}))
        removed = 0
        for path, job_id, epoch in staged:
            if current.get(job_id) == ("processing", epoch):
                continue
            path.unlink(missing_ok=True)
            removed += 1
        if removed:
            self.report.swept += removed
            self.log("staged_results_swept", count=removed, level=logging.WARNING)
        return removed

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

    # -- claim and lease ------------------------------------------------------------------------------

    def claim(self) -> repo.Lease | None:
        """One due job (tests and tools; the loop claims in batches inside its turn's statement)."""
        leases = self.claim_many(1)
        return leases[0] if leases else None

    def claim_many(self, limit: int) -> list[repo.Lease]:
        if self.shutdown.requested or limit <= 0:
            return []  # 003 §3.5: stop claiming
        now = self.clock.now()
        with self._begin() as conn:
            leases = repo.claim_many(conn, self.worker_id, now, self.settings.worker_lease_ttl_sec, BREAKER, limit)
        for lease in leases:
            self.report.claimed += 1
            self.log("job_claimed", job_id=lease.job_id, status="processing", attempt=lease.attempt, epoch=lease.epoch)
        return leases

    def extend(self, lease: repo.Lease) -> bool:
        return lease.job_id in self.extend_many([lease])

    def extend_many(self, leases: Sequence[repo.Lease]) -> set[str]:
        """Every lease in one fenced statement; the lost ones are logged and counted as refused writes."""
        now = self.clock.now()
        with self._begin() as conn:
            held = repo.extend_many(conn, leases, now, self.settings.worker_lease_ttl_sec)
        for lease in leases:
            if lease.job_id in held:
                self.log("lease_extended", job_id=lease.job_id, attempt=lease.attempt, epoch=lease.epoch)
            else:
                self._fenced(lease, "extend")
        return held

    # -- one attempt, in a slot thread ------------------------------------------------------------------

    def _attempt(self, lease: repo.Lease) -> Attempt:
        """Read the source, call the gateway, check and stage the XML (fsynced with RESULTS_SYNC=file); never raises."""
        start = time.perf_counter()  # durations are measurements, not decisions: the real clock
        call_ms: float | None = None
        try:
            try:
                pdf = self.files.read_source(lease.source_location)
            except FileNotFoundError:
                return Attempt(lease, None, 0, SOURCE_MISSING, None, _ms(start))
            call_start = time.perf_counter()
            try:
                # a job whose last attempt failed retries: its gateway call draws on the gateway's retry budget
                with upstreams.retrying(lease.attempt > 1):
                    xml = self.gateway.convert(pdf)
            except upstreams.RetryDeferred as held:
                return Attempt(lease, None, 0, None, None, _ms(start), deferred=held)
            finally:
                call_ms = round((time.perf_counter() - call_start) * 1000, 2)
            policy.check_xml(xml)
            staged = self.files.stage_result(lease.job_id, lease.epoch, xml)
            return Attempt(lease, staged, len(xml), None, call_ms, _ms(start))
        except Exception as exc:  # noqa: BLE001 - every failure is classified, none escapes unnamed
            return Attempt(lease, None, 0, policy.classify(exc), call_ms, _ms(start))
        except BaseException as exc:  # noqa: BLE001 - a slot thread never dies silently with a lease held
            return Attempt(lease, None, 0, policy.classify(exc), call_ms, _ms(start))

    def process(self, lease: repo.Lease) -> Outcome:
        """One claimed job start to finish in the calling thread (tests): attempt, then the turn's write."""
        self.in_flight[(lease.job_id, lease.epoch)] = lease
        return self._write_one(self._attempt(lease))

    def _write_one(self, attempt: Attempt) -> Outcome:
        outcomes: dict[str, Outcome] = {}
        self._write([attempt], 0, outcomes)
        return outcomes[attempt.lease.job_id]

    # -- the turn's writes -------------------------------------------------------------------------------

    def _write(self, finished: Sequence[Attempt], claim: int,
               outcomes: dict[str, Outcome] | None = None) -> list[repo.Lease]:
        """Write the finished attempts and claim up to ``claim`` jobs; returns the new leases.

        Failures first, one careful transaction each (so a breaker they open stops this very claim);
        then the successes, their breaker calls and the claim in one statement, the results published
        under the row locks, one COMMIT.
        """
        outcomes = {} if outcomes is None else outcomes
        self.keeper.release([a.lease.job_id for a in finished])
        successes = []
        for attempt in finished:
            if attempt.failure is None and attempt.deferred is None:
                successes.append(attempt)
            else:
                outcomes[attempt.lease.job_id] = self._failed(attempt) if attempt.deferred is None else \
                    self._deferred(attempt)
                self.in_flight.pop((attempt.lease.job_id, attempt.lease.epoch), None)
                self._lost.discard((attempt.lease.job_id, attempt.lease.epoch))
                if attempt in self._unwritten:  # written: a retried turn must not write it again
                    self._unwritten.remove(attempt)
        if self.shutdown.requested:
            claim = 0  # 003 §3.5: stop claiming
        if not successes and claim <= 0:
            return []
        if successes:
            self.files.sync_staged()  # RESULTS_SYNC=turn: one syncfs makes them all durable, before any is written done
        now = self.clock.now()
        done = [repo.Completion(a.lease, a.staged.location, a.call_ms,  # type: ignore[union-attr]
                                {"worker": a.lease.worker, "epoch": a.lease.epoch, "duration_ms": a.duration_ms,
                                 "gateway_status": 200, "bytes": a.size}) for a in successes]
        cycle = self.hot.cycle(done, claim, now, self.worker_id,
                               now + timedelta(seconds=self.settings.worker_lease_ttl_sec))
        try:
            self.files.publish_all([a.staged for a in successes if a.lease.job_id in cycle.completed])  # type: ignore[misc]
            self.hot.commit()
        except BaseException:
            self.hot.reset()
            raise
        if cycle.call_ids is not None and prune_due(*cycle.call_ids):
            with self._begin() as conn:
                prune_if_due(conn, BREAKER, *cycle.call_ids)
        refused = [a for a in successes if a.lease.job_id not in cycle.completed]
        if refused:
            with self.engine.connect() as conn:
                ours = repo.completed_before(conn, [a.lease for a in refused])
        for attempt in successes:
            lease = attempt.lease
            self.in_flight.pop((lease.job_id, lease.epoch), None)
            self._lost.discard((lease.job_id, lease.epoch))
            if lease.job_id in cycle.completed or (refused and lease.job_id in ours):
                outcomes[lease.job_id] = "succeeded"
                self.report.succeeded += 1
                self.log("job_completed", job_id=lease.job_id, status="succeeded", attempt=lease.attempt,
                         duration_ms=attempt.duration_ms, gateway_status=200)
                if lease.has_dead_letter:
                    self.reliability.succeeded(PIPELINE, lease.job_id)  # a retried or replayed job closes its letter
            else:
                self.files.discard(attempt.staged)  # type: ignore[arg-type]
                self._fenced(lease, "complete")
                outcomes[lease.job_id] = "fenced"
        return cycle.claimed

    def _record_call(self, conn: sa.Connection, failure: Failure | None, call_ms: float | None) -> Transition | None:
        """The gateway call into the breaker's window, in the same transaction as the job's final write.

        4xx answers and bad XML count as a healthy gateway; 5xx, timeouts and network errors do not.
        """
        if call_ms is None:
            return None
        ok = failure is None or not counts_as_failure(failure)
        return record_call(conn, BREAKER, ok, call_ms, self.clock.now(), self.breaker.policy)

    def _complete(self, lease: repo.Lease, xml: bytes, duration_ms: float, call_ms: float | None) -> Outcome:
        """A finished conversion's write on its own (tests): stage, then the same turn write as the loop's."""
        staged = self.files.stage_result(lease.job_id, lease.epoch, xml)
        self.in_flight[(lease.job_id, lease.epoch)] = lease
        return self._write_one(Attempt(lease, staged, len(xml), None, call_ms, duration_ms))

    @property
    def budget(self) -> Budget:
        """003 §3.2: RETRY_MAX_ATTEMPTS attempts under the configured backoff."""
        return Budget(self.settings.retry_max_attempts, self.backoff)

    def _failed(self, attempt: Attempt) -> Outcome:
        """The core settles it: ``queued`` with ``retryAfter``, or ``failed`` with its dead letter and alert in
        one transaction (issue 13 item 3); the gateway call enters the breaker's window in that transaction."""
        lease, failure, duration_ms = attempt.lease, attempt.failure, attempt.duration_ms
        assert failure is not None
        meta = {"worker": lease.worker, "epoch": lease.epoch, "duration_ms": duration_ms,
                "gateway_status": failure.upstream_status}
        transitions: list[Transition | None] = []

        def retry(conn: sa.Connection, verdict: Verdict) -> bool:
            transitions.append(self._record_call(conn, failure, attempt.call_ms))
            return repo.schedule_retry(conn, lease, failure.code, verdict.message[:300], verdict.due_at,  # type: ignore[arg-type]
                                       verdict.now, {**meta, "delay_ms": round(verdict.wait * 1000, 1)})

        def fail(conn: sa.Connection, verdict: Verdict) -> bool:
            transitions.append(self._record_call(conn, failure, attempt.call_ms))
            return repo.fail(conn, lease, failure.code, verdict.message[:300], verdict.now,
                             {**meta, "reason": verdict.decision.reason})

        settled = settle(self.reliability, pipeline=PIPELINE, stage=STAGE, entity_ref=lease.job_id, failure=failure,
                         attempt=lease.attempt, budget=self.budget, on_retry=retry, on_final=fail,
                         final=lambda verdict: self._final_failure(verdict, lease.owner))
        if transitions and transitions[0] is not None:
            self._breaker_opened(transitions[0], failure)
        verdict = settled.verdict
        if settled.outcome == "refused":
            self._fenced(lease, "retry" if verdict.decision.retry else "fail")
            return "fenced"
        if settled.outcome == "retried":
            self.report.retried += 1
            self.log("job_retry_scheduled", job_id=lease.job_id, status="queued", attempt=lease.attempt,
                     duration_ms=duration_ms, gateway_status=failure.upstream_status, error_code=failure.code,
                     retry_in_ms=round(verdict.wait * 1000, 1), level=logging.WARNING)
            return "retry"
        self.report.failed += 1
        self.log("job_failed", job_id=lease.job_id, status="failed", attempt=lease.attempt, duration_ms=duration_ms,
                 gateway_status=failure.upstream_status, error_code=failure.code, reason=verdict.decision.reason,
                 level=logging.ERROR)
        return "failed"

    def _deferred(self, attempt: Attempt) -> Outcome:
        """The gateway's retry budget held this retry back before it was sent (issue 26 §4): ``queued`` again
        about a budget window later (spread by jitter), its attempt given back, so a flapping gateway never
        spends jobs' attempts; the breaker's window is untouched (no call was made)."""
        lease, now = attempt.lease, self.clock.now()
        spread = self.reliability.rng_for(f"{PIPELINE}:{lease.job_id}:deferred:{now.isoformat()}")
        due_at = now + timedelta(seconds=attempt.deferred.due_after(spread))  # type: ignore[union-attr]
        with self._begin() as conn:
            ok = repo.requeue(conn, lease, now, reason="retry budget of the PDF gateway", retry_after=due_at)
        if not ok:
            self._fenced(lease, "defer")
            return "fenced"
        self.report.deferred += 1
        self.log("job_retry_deferred", job_id=lease.job_id, status="queued", attempt=lease.attempt - 1,
                 retry_in_ms=round((due_at - now).total_seconds() * 1000, 1), level=logging.WARNING)
        return "deferred"

    @staticmethod
    def _final_failure(verdict: Verdict, owner: str | None) -> FinalFailure:
        """The dead letter of a job failed for good."""
        job_id, code = verdict.entity_ref, verdict.failure.code
        return verdict.final_failure(tenant=owner, context={"job_id": job_id, "error_code": code},
                                     payload_ref={"table": "conversion_jobs", "id": job_id})

    def _record_final(self, conn: sa.Connection, job_id: str, owner: str | None, failure: Failure, attempts: int,
                      now: datetime) -> None:
        """The dead letter and its alert, inside the caller's transaction (the job's own `failed` write)."""
        self.reliability.fail_for_good(FinalFailure(
            pipeline=PIPELINE, stage=STAGE, entity_ref=job_id, failure=failure, attempts=attempts, at=now,
            tenant=owner, context={"job_id": job_id, "error_code": failure.code},
            payload_ref={"table": "conversion_jobs", "id": job_id},
        ), conn=conn)

    # -- giving jobs back -----------------------------------------------------------------------------

    def _abandon(self, reason: str) -> None:
        """The loop is cut short: write what already finished, requeue what is still in flight (003 §3.5)."""
        self.slots.take_unstarted()  # claimed ahead: no slot starts them now; requeued below with the rest
        try:
            finished = self._unwritten + self._collect(block=False)
            self._unwritten = []
            if finished:
                self._write(finished, 0)
        except Exception:  # noqa: BLE001 - the database may be the reason; their leases expire and are reclaimed
            self.log("final_write_error", in_flight=len(self.in_flight), level=logging.ERROR)
        for (job_id, epoch), lease in sorted(self.in_flight.items()):
            self.keeper.release([job_id])
            self.abandoned.add((job_id, epoch))
            try:
                self.requeue(lease, reason)
            except Exception:  # noqa: BLE001 - the lease expires and the reclaim takes it over
                self.log("requeue_error", job_id=job_id, level=logging.ERROR)
        self.in_flight.clear()

    def requeue(self, lease: repo.Lease, reason: str) -> bool:
        """003 §3.5: the in-flight job cannot finish — back to ``queued``, lease cleared, attempt given back."""
        with self._begin() as conn:
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
        with self._begin() as conn:
            repo.record_fenced(conn, lease, write, self.clock.now())
        self.log("lease_lost_write_refused", job_id=lease.job_id, attempt=lease.attempt, epoch=lease.epoch,
                 write=write, level=logging.WARNING)


def _ewma(average: float, sample: float, weight: float = 0.2) -> float:
    return sample if average <= 0 else average + weight * (sample - average)


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 1)


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
    gateway = HttpGateway(conv.gateway_base_url(core), conv.gateway_timeout_ms / 1000,
                          in_flight=conv.worker_concurrency)
    shutdown = Shutdown(conv.worker_shutdown_grace_sec)
    wid = worker_id or new_worker_id()
    return Worker(reliability, gateway, file_store(conv), conv, worker_id=wid,
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
    logs.configure()
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
        if not worker.abandoned:  # a slot still inside an abandoned call keeps its client; the process ends anyway
            worker.gateway.close()
        worker.engine.dispose()  # 003 §3.5: disconnect only after the final status write


if __name__ == "__main__":
    worker_app()
