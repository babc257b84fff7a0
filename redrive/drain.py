"""Drain: claim due entities in batches, work each under its stages' policies, settle each one.

The one core mechanism for per-entity work at volume. A run (or a worker) pays its start-up
once and then drains: it leases due rows of the work queue (`redrive.work`, SKIP LOCKED,
fenced by epoch), works up to `concurrency` entities at a time, and settles every entity:
- success → the row is done (with the pipeline's own completion in the same transaction)
  and a replayed dead letter is closed (002 §8.5 post-replay verification);
- a retryable failure with budget left → the row falls due again after the stage's backoff
  (the seeds' schedules become due times on rows, not runs or sleeping workers);
- permanent or out of budget → the row is dead, and its dead letter, its alert and the
  pipeline's own `failed` state are written in one transaction (a crash leaves all or none).
Stages are checkpointed, so a retry or a replay resumes at the failed stage. A run lingers
for work falling due within `linger_seconds` and ends when none is left; the sensor starts
the next round when more falls due. Nothing here imports Dagster: `redrive.drain_ops` adapts it.

The run is the core's per-entity engine (`redrive.engine`, issue 26 §2) over this work queue
(`_WorkQueue`): an entity is a task, claims and settlements run on a few I/O threads. A coroutine
handler (`async def`, its upstream calls through async clients) holds no OS thread while it waits on
an upstream, so a run holds hundreds of entities in flight for the cost of their tasks; a plain
handler gets a thread of its own per entity in flight.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, TypeVar

import sqlalchemy as sa

from redrive import checkpoints, deadletters, liveness, logs, observations, upstreams, work
from redrive.engine import Engine
from redrive.failures import Code, Failure, classify_exception
from redrive.reliability import Reliability
from redrive.sanitize import sanitize_exception, sanitize_text
from redrive.settle import Verdict, settle
from redrive.stages import StagePolicy
from redrive.work import WorkItem

log = logging.getLogger(__name__)
T = TypeVar("T")

FROM_START = "start"
# an attempt lost to our own database (away, out of connections, a lock conflict) is not the entity's: it is
# counted apart under this key of the row's attempts, up to OURS_MAX times, and spends none of a stage's
OURS = "infrastructure"
OURS_MAX = 10


def ours_wait(lost: int, roll: float) -> float:
    """Pure: seconds until an entity whose attempt our own database lost is due again: 2, 4, 8 … up to 60 s
    by the times it was lost, spread ×0.5–1.5 (`roll` in [0, 1)) so a recovered database is not stormed."""
    return min(60.0, 2.0 ** max(1, lost)) * (0.5 + roll)


class StageError(Exception):
    """A stage's work failed; carries the stage name and the original exception to the settlement."""

    def __init__(self, stage: str, cause: BaseException, seconds: float | None = None) -> None:
        super().__init__(stage)
        self.stage, self.cause, self.seconds = stage, cause, seconds


class LeaseLost(Exception):
    """The row was reclaimed by another holder (our lease expired): write nothing."""


@dataclass
class Attempt:
    """One claimed entity in this run; the handler runs its stages through it.

    The handler fills `tenant`, `payload_ref` and `context` (what a dead letter shows) as it
    learns them, and registers `on_success` / `on_failure` writes that must share the
    settlement's transaction (the entity's own `done` or `failed` state).
    """

    item: WorkItem
    drain: Drain
    tenant: str | None = None
    payload_ref: dict[str, Any] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)
    current_stage: str | None = None
    # Set by a handler whose entity is not finished but has more work on its own schedule (evidence's
    # per-artifact retries): it settles as due again then, with `on_success` in that transaction. With
    # `retry_error_class` set, this attempt failed in part and is counted as a retry of that class.
    due_again_at: datetime | None = None
    retry_error_class: str | None = None
    # (stage, seconds) of the last `stage(..., observe=False)`: counted when the entity settles
    unobserved: tuple[str, float] | None = None
    on_success: list[Callable[[sa.Connection], None]] = field(default_factory=list)
    # (conn, failure, final): runs for a retry and for the final failure, before the dead letter is
    # built, so it may add to `context` (e.g. when the failure episode began)
    on_failure: list[Callable[[sa.Connection, Failure, bool], None]] = field(default_factory=list)
    report: DrainReport | None = None
    report_lock: threading.Lock | None = None
    # writes waiting for the entity's next transaction (`write_later`): its next stage's, or its settlement's
    riders: list[Callable[[sa.Connection], None]] = field(default_factory=list)
    _checkpoints: dict[str, dict[str, Any]] | None = field(default=None, repr=False)  # read once an attempt

    @property
    def entity_ref(self) -> str:
        return self.item.entity_ref

    @property
    def replay_of(self) -> int | None:
        return self.item.payload.get("replay_of")

    @property
    def first_lease(self) -> bool:
        """The entity's first lease (epoch 1): nothing of it has run before, so there is nothing to recover
        (no checkpoint, no partial delivery); a retried, reclaimed, replayed or rerun entity has a later epoch."""
        return self.item.lease_epoch <= 1

    def stage(self, name: str, work_fn: Callable[[], Mapping[str, Any]], *, checkpoint: bool = True,
              observe: bool = True, durable: bool = True) -> dict[str, Any]:
        """The stage's checkpoint if it has one; else run it once and checkpoint its output.

        ``observe=False``: the attempt's outcome is not known when the work returns (evidence's row may
        have failed artifacts to retry); it is counted when the entity settles — ok, or a retry of
        ``retry_error_class`` when the handler sets one.
        ``durable=False``: the checkpoint and the observation ride the entity's next write (`write_later`) instead
        of a transaction of their own: for a stage a crash may make us redo at little cost and no harm (an
        idempotent read), or the last stage, whose settlement follows at once."""
        if checkpoint and (done := self.drain._patiently(lambda: self._checkpoint(name))) is not None:
            return done
        self.current_stage = name
        started = time.perf_counter()
        try:
            output = dict(work_fn())
        except Exception as exc:  # noqa: BLE001 - settled by the drain under the stage's policy
            raise StageError(name, exc, time.perf_counter() - started) from None
        self._finished(name, output, time.perf_counter() - started, checkpoint, observe, durable)
        return output

    async def astage(self, name: str, work_fn: Callable[[], Awaitable[Mapping[str, Any]]], *,
                     checkpoint: bool = True, observe: bool = True, durable: bool = True) -> dict[str, Any]:
        """`stage` for a coroutine handler: the work is awaited on the run's loop (an upstream call holds no
        thread); the checkpoint's read and write run on the run's I/O threads."""
        drain = self.drain
        if checkpoint:
            done = await self.blocking(lambda: drain._patiently(lambda: self._checkpoint(name))) \
                if self._checkpoints is None and not self.first_lease else self._checkpoint(name)
            if done is not None:
                return done
        self.current_stage = name
        started = time.perf_counter()
        try:
            output = dict(await work_fn())
        except Exception as exc:  # noqa: BLE001 - settled by the drain under the stage's policy
            raise StageError(name, exc, time.perf_counter() - started) from None
        seconds = time.perf_counter() - started
        if durable:
            await self.blocking(lambda: self._finished(name, output, seconds, checkpoint, observe, durable))
        else:  # nothing to write now: no thread
            self._finished(name, output, seconds, checkpoint, observe, durable)
        return output

    def write_later(self, write: Callable[[sa.Connection], None]) -> None:
        """`write(conn)` in the entity's next transaction (its next durable stage's, `write_now`'s, or its
        settlement's, whatever the outcome) rather than one of its own. A crash before then loses it: only for a
        record whose loss costs a harmless redo (a read done again, a post whose receiver keeps one effect per
        Idempotency-Key). A settlement refused by its fence (another run holds the entity) writes none of it."""
        self.riders.append(write)

    def write_now(self, write: Callable[[sa.Connection], None]) -> None:
        """`write(conn)` in a transaction of its own, with whatever waits for the entity's next write."""
        def both() -> None:
            with self.drain.engine.begin() as conn:
                self._ride(conn)
                write(conn)
            self.riders.clear()

        self.drain._patiently(both)

    def _ride(self, conn: sa.Connection) -> None:
        """The writes waiting for this transaction (`write_later`); the caller clears them once it commits."""
        for write in self.riders:
            write(conn)

    async def blocking(self, fn: Callable[[], T]) -> T:
        """`fn()` (a database write) on the run's I/O threads, off the loop."""
        return await self.drain.blocking(fn)

    async def call(self, fn: Callable[[], T]) -> T:
        """`fn()`, a fast upstream's call through its synchronous client, on the run's call threads: a sync client
        costs a fraction of the CPU of an async one, and these threads are apart from the I/O threads, so an
        upstream that turns slow holds up other calls, never the run's database writes. A slow upstream (an LLM's
        seconds) is awaited through its async client instead."""
        return await self.drain.call(fn)

    def _checkpoint(self, name: str) -> dict[str, Any] | None:
        """The stage's checkpoint: every stage's read in one query, once an attempt; none read at all on the
        entity's first lease (epoch 1), when no stage of it has run yet (a reclaimed, retried or replayed
        entity has a later epoch)."""
        if self._checkpoints is None:
            if self.first_lease:
                self._checkpoints = {}
            else:
                with self.drain.engine.connect() as conn:
                    self._checkpoints = checkpoints.load_all(conn, self.drain.pipeline, self.entity_ref)
        return self._checkpoints.get(name)

    def _finished(self, name: str, output: dict[str, Any], seconds: float, checkpoint: bool, observe: bool,
                  durable: bool = True) -> None:
        """Count the stage's attempt and write its checkpoint and observation (now, or with the next write)."""
        drain = self.drain
        self.attempts[name] = self.attempts.get(name, 0) + 1
        if not observe:
            self.unobserved = (name, seconds)
        if checkpoint or observe:
            def save(conn: sa.Connection) -> None:
                if checkpoint:
                    checkpoints.save(conn, drain.pipeline, self.entity_ref, name, output)
                if observe:
                    observations.observe(conn, drain.pipeline, name, observations.OK, seconds=seconds)

            if durable:
                self.write_now(save)  # the stage succeeded: an outage now must not turn it into a failed attempt
            else:
                self.write_later(save)

    def observe_settled(self, conn: sa.Connection) -> None:
        """Count the attempt of an ``observe=False`` stage as it settles: a retry of its class, or ok."""
        if self.unobserved is None:
            return
        name, seconds = self.unobserved
        if self.due_again_at is not None and self.retry_error_class is not None:
            observations.observe(conn, self.drain.pipeline, name, observations.RETRY,
                                 error_class=self.retry_error_class, seconds=seconds)
        else:
            observations.observe(conn, self.drain.pipeline, name, observations.OK, seconds=seconds)

    def stage_attempts(self, failed_stage: str | None = None) -> dict[str, int]:
        """Attempts per stage so far: earlier runs' (the row) plus this run's successes (+1 for a failure)."""
        out = {**self.item.attempts, **{s: self.item.attempts.get(s, 0) + n for s, n in self.attempts.items()}}
        if failed_stage is not None:
            out[failed_stage] = self.item.attempts.get(failed_stage, 0) + 1
        return out


# a plain function (a thread per entity in flight) or a coroutine function (a task per entity, no thread)
Handler = Callable[[Attempt], None] | Callable[[Attempt], Awaitable[None]]


@dataclass
class DrainReport:
    claimed: int = 0
    done: int = 0
    retried: int = 0
    dead_lettered: int = 0
    lease_lost: int = 0
    deferred: int = 0  # retries an upstream's retry budget held back: due later, no attempt spent
    infrastructure: int = 0  # attempts our own database lost: due again shortly, no stage attempt spent
    batches: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # failed attempts by error class
    # the first RETRY_LOG_LIMIT retries in detail (entity, stage, attempt, wait in seconds, error class)
    retry_log: list[dict[str, Any]] = field(default_factory=list)

    RETRY_LOG_LIMIT = 200

    def as_metadata(self) -> dict[str, int]:
        return {"claimed": self.claimed, "done": self.done, "retried": self.retried,
                "dead_lettered": self.dead_lettered, "lease_lost": self.lease_lost, "deferred": self.deferred,
                "infrastructure": self.infrastructure,
                "batches": self.batches}


@dataclass
class _WorkQueue:
    """The core's work queue as the engine's source: leases on one pipeline's due rows (of one group, if set)."""

    drain: Drain
    group_key: str | None
    report: DrainReport

    def claim(self, limit: int, held: list[WorkItem]) -> list[WorkItem]:
        drain = self.drain
        if drain.max_items is not None:
            limit = min(limit, drain.max_items - self.report.claimed)
        claimed = drain._patiently(lambda: drain._claim(limit, self.group_key, held))
        if claimed:
            self.report.batches += 1
            self.report.claimed += len(claimed)
        return claimed

    def keep(self, held: list[WorkItem]) -> None:
        """Extend the leases of entities still being worked (every third of a lease)."""
        drain = self.drain
        now = drain.reliability.now()
        with drain.engine.begin() as conn:
            work.extend(conn, held, lease_seconds=drain.lease_seconds, now=now)
        for item in held:
            drain._lease_ends[item.id] = now + timedelta(seconds=drain.lease_seconds)

    def next_due_in(self) -> float | None:
        return self.drain._patiently(lambda: self.drain._until_next_due(self.group_key))

    def stopped(self) -> bool:
        # a run the watchdog declared dead claims nothing more (its claims are refused anyway)
        drain = self.drain
        return liveness.fenced(drain.run_id) or (drain.max_items is not None and self.report.claimed >= drain.max_items)

    def released(self, item: WorkItem) -> None:
        self.drain._lease_ends.pop(item.id, None)


@dataclass
class Drain:
    """How one pipeline drains: its stage policies and the run's bounds."""

    reliability: Reliability
    pipeline: str
    policies: Mapping[str, StagePolicy]
    owner: str
    concurrency: int = 8  # entities in flight; a coroutine handler's hold no thread, so hundreds cost little
    io_threads: int = 8  # claims, settlements and a coroutine handler's database writes (the pool has 15)
    call_threads: int = 16  # a coroutine handler's calls of fast upstreams through sync clients (`Attempt.call`)
    batch_size: int = 50
    lease_seconds: float = 60.0  # a dead worker's rows come back within a minute; the heartbeat extends every 20 s
    linger_seconds: float = 5.0  # wait for work falling due this soon, rather than end the run
    max_seconds: float = 600.0  # a run ends after this; the sensor starts the next round
    max_items: int | None = None
    run_id: str | None = None
    sleep: Callable[[float], None] = time.sleep
    # the database away: settles and claims wait it out this long (real time) before the run gives up
    outage_patience_seconds: float = 300.0
    outage_sleep: Callable[[float], None] = time.sleep
    _lease_ends: dict[int, datetime] = field(default_factory=dict, init=False, repr=False)  # as last written
    _engine: Engine[WorkItem] | None = field(default=None, init=False, repr=False)  # the running run's

    @property
    def engine(self) -> sa.Engine:
        return self.reliability.engine

    def policy_for(self, stage: str) -> StagePolicy:
        return self.policies.get(stage) or next(iter(self.policies.values()))

    def run(self, handle: Handler, *, group_key: str | None = None) -> DrainReport:
        return asyncio.run(self._run(handle, group_key))

    async def blocking(self, fn: Callable[[], T]) -> T:
        """`fn()` on the run's I/O threads (its context, e.g. the retry flag, goes with it)."""
        assert self._engine is not None, "only while the drain runs"
        return await self._engine.blocking(fn)

    async def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the run's call threads (`Attempt.call`), its context with it."""
        assert self._engine is not None, "only while the drain runs"
        return await self._engine.call(fn)

    async def _run(self, handle: Handler, group_key: str | None) -> DrainReport:
        """The core's engine over this pipeline's work queue: each claimed entity worked and settled here."""
        report, lock = DrainReport(), threading.Lock()
        self._lease_ends.clear()
        self._engine = Engine(name=f"drain-{self.pipeline}", concurrency=self.concurrency, batch_size=self.batch_size,
                              io_threads=self.io_threads, call_threads=self.call_threads,
                              keep_every=self.lease_seconds / 3, linger_seconds=self.linger_seconds,
                              max_seconds=self.max_seconds, sleep=self.sleep)
        if inspect.iscoroutinefunction(handle):
            async def work(item: WorkItem) -> None:
                await self._awork_one(handle, item, report, lock)  # type: ignore[arg-type]
            await self._engine.drain(_WorkQueue(self, group_key, report), work,
                                     closing=self.reliability.try_dispatch)  # this run's dead letters' alerts
        else:
            await self._engine.drain(_WorkQueue(self, group_key, report),
                                     functools.partial(self._work_one, handle, report=report, lock=lock),
                                     closing=self.reliability.try_dispatch)
        return report

    # --- claiming and leases ---------------------------------------------------------------------

    def _claim(self, limit: int, group_key: str | None, held: list[WorkItem] | None = None) -> list[WorkItem]:
        """Lease due rows. Our own leases that ran out while this process was paused or cut off are extended
        first, in the same transaction (issue 26 §2): still ours unless another run took them (the epoch
        decides), so this claim never takes back our own in-flight work and makes its settle a lost lease."""
        if limit <= 0:
            return []
        now = self.reliability.now()
        margin = timedelta(seconds=self.lease_seconds / 3)
        lapsing = [i for i in held or () if self._lease_ends.get(i.id, now) <= now + margin]
        with self.engine.begin() as conn:
            if lapsing:
                work.extend(conn, lapsing, lease_seconds=self.lease_seconds, now=now)
            claimed = work.claim(conn, self.pipeline, owner=self.owner, limit=limit,
                                 lease_seconds=self.lease_seconds, now=now, group_key=group_key)
        until = now + timedelta(seconds=self.lease_seconds)
        for item in [*lapsing, *claimed]:
            self._lease_ends[item.id] = until
        return claimed

    def _patiently(self, write: Callable[[], Any]) -> Any:
        """`write()`, waiting out the database being away (a restart, a failover) up to the patience; a
        write refused by its fence (LeaseLost) or any other failure is raised at once."""
        deadline, tries = time.monotonic() + self.outage_patience_seconds, 0
        while True:
            try:
                return write()
            except LeaseLost:
                raise
            except Exception as exc:
                if classify_exception(exc).core != Code.DB_TRANSIENT or time.monotonic() >= deadline:
                    raise
                tries += 1
                if tries == 1:
                    log.warning("drain %s: database away; waiting for it before writing on", self.pipeline)
                self.outage_sleep(min(5.0, 0.05 * 2 ** min(tries, 7)))

    def _until_next_due(self, group_key: str | None) -> float | None:
        now = self.reliability.now()
        with self.engine.connect() as conn:
            backlog = work.backlog(conn, self.pipeline, now, group_key=group_key)
        if backlog.next_due_at is None:
            return None
        return (backlog.next_due_at - now).total_seconds()

    # --- one entity --------------------------------------------------------------------------------

    def _work_one(self, handle: Handler, item: WorkItem, *, report: DrainReport, lock: threading.Lock) -> None:
        """A plain handler's entity, on a thread of its own from claim to settlement."""
        attempt = Attempt(item=item, drain=self, report=report, report_lock=lock)
        try:
            if item.payload.get("replay_from") == FROM_START:
                self._clear_checkpoints(item)
            with upstreams.retrying(self._retrying(attempt)):
                handle(attempt)
        except Exception as exc:  # noqa: BLE001 - every failure is classified and settled, none escapes
            outcome = self._failed(attempt, exc)
        else:
            outcome = self._succeeded(attempt)
        self._count(report, lock, outcome)

    async def _awork_one(self, handle: Callable[[Attempt], Awaitable[None]], item: WorkItem, report: DrainReport,
                         lock: threading.Lock) -> None:
        """A coroutine handler's entity: a task; only its database writes take an I/O thread, briefly."""
        attempt = Attempt(item=item, drain=self, report=report, report_lock=lock)
        try:
            if item.payload.get("replay_from") == FROM_START:
                await self.blocking(lambda: self._clear_checkpoints(item))
            with upstreams.retrying(self._retrying(attempt)):
                await handle(attempt)
        except Exception as exc:  # noqa: BLE001 - every failure is classified and settled, none escapes
            outcome = await self.blocking(functools.partial(self._failed, attempt, exc))
        else:
            outcome = await self.blocking(lambda: self._succeeded(attempt))
        self._count(report, lock, outcome)

    @staticmethod
    def _retrying(attempt: Attempt) -> bool:
        """An entity whose last attempt failed retries: its first upstream call draws on the retry budget."""
        return attempt.item.stage is not None and attempt.replay_of is None

    def _clear_checkpoints(self, item: WorkItem) -> None:
        with self.engine.begin() as conn:
            checkpoints.clear(conn, self.pipeline, item.entity_ref)

    def _failed(self, attempt: Attempt, exc: Exception) -> str:
        """Settle a failed attempt under its stage's policy; the outcome's name."""
        item = attempt.item
        stage, cause = (exc.stage, exc.cause) if isinstance(exc, StageError) else \
            (attempt.current_stage or item.stage or next(iter(self.policies)), exc)
        seconds = exc.seconds if isinstance(exc, StageError) else None
        try:
            if isinstance(cause, upstreams.RetryDeferred):
                return self._patiently(lambda: self._defer_retry(attempt, stage, cause))
            ours = classify_exception(cause)
            if ours.core == Code.DB_TRANSIENT and item.attempts.get(OURS, 0) < OURS_MAX:
                return self._patiently(lambda: self._defer_ours(attempt, stage, ours))
            return self._patiently(lambda: self._settle_failure(attempt, stage, cause, seconds))
        except LeaseLost:
            return "lease_lost"
        except Exception as settle_exc:  # noqa: BLE001 - the row's lease expires and it is worked again
            log.error("drain %s: could not settle %s: %s", self.pipeline, item.entity_ref,
                      sanitize_text(str(settle_exc))[:300])
            return "unsettled"

    def _succeeded(self, attempt: Attempt) -> str:
        try:
            # what finished is written, waiting out an outage; the epoch decides whether it still counts
            return self._patiently(lambda: self._settle_success(attempt))
        except LeaseLost:
            return "lease_lost"
        except Exception as settle_exc:  # noqa: BLE001
            log.error("drain %s: could not complete %s: %s", self.pipeline, attempt.entity_ref,
                      sanitize_text(str(settle_exc))[:300])
            return "unsettled"

    @staticmethod
    def _count(report: DrainReport, lock: threading.Lock, outcome: str) -> None:
        with lock:
            if outcome in ("done", "retried", "dead_lettered", "lease_lost", "deferred", "infrastructure"):
                setattr(report, outcome, getattr(report, outcome) + 1)
            else:
                report.errors[outcome] = report.errors.get(outcome, 0) + 1

    def _settle_success(self, attempt: Attempt) -> str:
        now = self.reliability.now()
        with self.engine.begin() as conn:
            attempt._ride(conn)
            for write in attempt.on_success:
                write(conn)
            attempt.observe_settled(conn)
            if attempt.due_again_at is not None:
                if not work.defer(conn, attempt.item, due_at=attempt.due_again_at, attempts=attempt.stage_attempts(),
                                  now=now):
                    raise LeaseLost(attempt.entity_ref)
                return "retried"
            if not work.complete(conn, attempt.item, now=now, attempts=attempt.stage_attempts()):
                raise LeaseLost(attempt.entity_ref)
            if attempt.replay_of is not None or attempt.item.stage is not None:
                deadletters.close_after_success(conn, self.pipeline, attempt.entity_ref, now)
            last = attempt.current_stage or attempt.item.stage or next(iter(self.policies))
            observations.observe(conn, self.pipeline, last, observations.DONE)
        if log.isEnabledFor(logging.INFO):
            log.info("done", extra=logs.fields(  # the entity is a field of the line, not in its words too
                pipeline=self.pipeline, entity=attempt.entity_ref, stage=last, run_id=self.run_id,
                attempt=sum(attempt.stage_attempts().values())))
        return "done"

    def _defer_retry(self, attempt: Attempt, stage: str, deferred: upstreams.RetryDeferred) -> str:
        """The upstream's retry budget held this retry back before it was sent: the row falls due later
        (spread by jitter) with its attempts as they were, so an outage never spends entities' attempts."""
        item, now = attempt.item, self.reliability.now()
        spread = self.reliability.rng_for(f"{self.pipeline}:{item.entity_ref}:deferred:{now.isoformat()}")
        due_at = now + timedelta(seconds=deferred.due_after(spread))
        with self.engine.begin() as conn:
            if not work.reschedule(conn, item, due_at=due_at, stage=stage, attempts=attempt.stage_attempts(),
                                   error=f"{stage} of {item.entity_ref}: {deferred}", now=now):
                raise LeaseLost(item.entity_ref)
            attempt._ride(conn)
        return "deferred"

    def _defer_ours(self, attempt: Attempt, stage: str, failure: Failure) -> str:
        """Our own database lost this attempt: the row is due again shortly with its stages' attempts as they were
        (the loss counted apart, under OURS), so a database restart or a full connection pool never dead-letters
        work; the pipeline's failure writes run as for a retry, and the failure is observed with its class."""
        item, now = attempt.item, self.reliability.now()
        lost = item.attempts.get(OURS, 0) + 1
        roll = self.reliability.rng_for(f"{self.pipeline}:{item.entity_ref}:{OURS}:{lost}").random()
        due_at = now + timedelta(seconds=ours_wait(lost, roll) * self.reliability.time_scale)
        with self.engine.begin() as conn:
            if not work.reschedule(conn, item, due_at=due_at, stage=stage, attempts={**attempt.stage_attempts(),
                                   OURS: lost}, error=f"{stage} of {item.entity_ref}: {failure.code} (our database; "
                                   f"not counted as an attempt, {lost}/{OURS_MAX})", now=now):
                raise LeaseLost(item.entity_ref)
            attempt._ride(conn)
            for write in attempt.on_failure:
                write(conn, failure, False)
            observations.observe(conn, self.pipeline, stage, observations.RETRY, error_class=failure.code)
        return "infrastructure"

    def _settle_failure(self, attempt: Attempt, stage: str, exc: BaseException, seconds: float | None = None) -> str:
        item = attempt.item
        policy = self.policy_for(stage)
        stage_attempts = attempt.stage_attempts(stage)

        def retry(conn: sa.Connection, verdict: Verdict) -> bool:
            self._count_failure(attempt, verdict)
            if not work.reschedule(conn, item, due_at=verdict.due_at, stage=stage,  # type: ignore[arg-type]
                                   attempts=stage_attempts, error=verdict.public, now=verdict.now):
                raise LeaseLost(item.entity_ref)
            attempt._ride(conn)
            for write in attempt.on_failure:
                write(conn, verdict.failure, False)
            observations.observe(conn, self.pipeline, stage, observations.RETRY, error_class=verdict.failure.code,
                                 seconds=seconds)
            return True

        def bury(conn: sa.Connection, verdict: Verdict) -> bool:
            self._count_failure(attempt, verdict)
            if not work.bury(conn, item, stage=stage, attempts=stage_attempts, error=verdict.public,
                             now=verdict.now):
                raise LeaseLost(item.entity_ref)
            attempt._ride(conn)
            for write in attempt.on_failure:
                write(conn, verdict.failure, True)
            return True

        settled = settle(
            self.reliability, pipeline=self.pipeline, stage=stage, entity_ref=item.entity_ref,
            failure=policy.classify(exc, self.reliability.now()), attempt=item.attempts.get(stage, 0) + 1,
            budget=policy, on_retry=retry, on_final=bury, dispatch=False,  # sent once, at the end of the run
            final=lambda verdict: verdict.final_failure(
                tenant=attempt.tenant, stack=sanitize_exception(exc), payload_ref=attempt.payload_ref,
                context={**attempt.context, "decision": verdict.decision.reason, "dagster_run_id": self.run_id},
                stage_attempts=stage_attempts, run_id=self.run_id),
        )
        verdict = settled.verdict
        context = logs.fields(pipeline=self.pipeline, entity=item.entity_ref, stage=stage, attempt=verdict.attempt,
                              error_class=verdict.failure.code, run_id=self.run_id)
        if settled.outcome == "retried":
            if log.isEnabledFor(logging.INFO):
                due = verdict.due_at.isoformat()  # type: ignore[union-attr]
                log.info("%s; next attempt due %s", verdict.public, due, extra={**context, "due_at": due})
            return "retried"
        log.warning("%s; %s: dead letter %s", verdict.public, verdict.decision.reason, settled.dead_letter_id,
                    extra={**context, "dead_letter_id": settled.dead_letter_id})
        return "dead_lettered"

    def _count_failure(self, attempt: Attempt, verdict: Verdict) -> None:
        report, lock = attempt.report, attempt.report_lock
        if report is None or lock is None:
            return
        with lock:
            code = verdict.failure.code
            report.failures[code] = report.failures.get(code, 0) + 1
            if verdict.decision.retry and len(report.retry_log) < report.RETRY_LOG_LIMIT:
                report.retry_log.append({"entity": attempt.entity_ref, "stage": verdict.stage,
                                         "attempt": verdict.attempt, "wait": verdict.wait, "error_class": code})
