"""The per-entity engine: claim, keep up to `concurrency` entities in flight, collect them, claim again.

One engine for every queue a pipeline drains (issue 26 §2): the core's work queue (`redrive.drain`:
leases, SKIP LOCKED, fenced settlements) and SQS (`assets.matching.worker`: visibility timeouts and
receive counts) are each a `Source`; what an entity does and how it settles is the work function's.
The engine knows only how many are in flight and when to ask for more.

A run is one asyncio loop. A coroutine work function's entity is a task, so an entity waiting on an
upstream (an LLM's seconds) holds no OS thread and a run holds hundreds in flight for the cost of their
tasks; a plain function's entity gets a thread of its own. The source's claims, its keeping and a
coroutine's blocking calls (database writes, sync clients) run on a few I/O threads (`blocking`), a
coroutine's calls of fast upstreams through sync clients on call threads of their own (`call`).
Nothing here imports Dagster or knows a table.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from redrive import aio

log = logging.getLogger(__name__)
T = TypeVar("T")
I = TypeVar("I")  # noqa: E741 - an item the source claimed

# how soon a free slot is filled when fewer than a refill's worth are free: a slow upstream's slots are not left idle
CLAIM_AGAIN_SECONDS = 0.1


class Source(Protocol[I]):
    """What a queue gives the engine. `claim`, `keep` and `next_due_in` run on I/O threads and may block;
    `stopped` and `released` run on the loop and must not."""

    def claim(self, limit: int, held: list[I]) -> list[I]:
        """Up to `limit` items to work now (`held`: those still in flight); [] when none is due."""

    def keep(self, held: list[I]) -> None:
        """Keep what is held (extend its leases); called every `Engine.keep_every` seconds while any is."""

    def next_due_in(self) -> float | None:
        """Nothing in flight and nothing claimed: seconds until more falls due, None when none will in this run."""

    def stopped(self) -> bool:
        """Claim no more (a budget spent, the run fenced): the engine finishes what it holds and ends."""

    def released(self, item: I) -> None:
        """`item` is settled (its work function returned)."""


def refill_of(concurrency: int) -> int:
    """Pure: how many free slots make a claim worth a statement while entities finish fast (at most 8)."""
    return max(1, min(concurrency // 2, 8))


@dataclass
class Engine(Generic[I]):
    """How one run drains a source: its bounds and its threads."""

    name: str
    concurrency: int = 8  # entities in flight; a coroutine's hold no thread, so hundreds cost little
    batch_size: int = 50  # the most one claim asks for
    io_threads: int = 8  # claims, keeps and a coroutine's blocking calls
    call_threads: int = 16  # a coroutine's calls of fast upstreams through sync clients
    keep_every: float | None = None  # seconds between `Source.keep` calls; None: the source keeps nothing
    linger_seconds: float = 5.0  # wait for work falling due this soon, rather than end the run
    max_seconds: float = 600.0  # claim nothing more after this; what is in flight still finishes
    sleep: Callable[[float], None] = time.sleep
    batches: int = field(default=0, init=False)  # claims that brought something
    _io: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _calls: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)

    async def blocking(self, fn: Callable[[], T]) -> T:
        """`fn()` on the run's I/O threads (its context, e.g. the retry flag, goes with it)."""
        return await asyncio.get_running_loop().run_in_executor(self._io, contextvars.copy_context().run, fn)

    async def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the run's call threads, its context with it: apart from the I/O threads, so an upstream that
        turns slow holds up other calls, never the run's claims and writes."""
        if self._calls is None:
            self._calls = ThreadPoolExecutor(max_workers=self.call_threads, thread_name_prefix=f"{self.name}-call")
        return await asyncio.get_running_loop().run_in_executor(self._calls, contextvars.copy_context().run, fn)

    async def drain(self, source: Source[I], work: Callable[[I], Awaitable[None]] | Callable[[I], None], *,
                    closing: Callable[[], object] | None = None) -> int:
        """Work what `source` gives until it has nothing due within the linger, is stopped or the time is up;
        every item claimed is worked to its end, even when the run fails. `closing()` runs on an I/O thread
        after the last item (e.g. the run's alerts). Returns the number of claims that brought something."""
        started = time.monotonic()
        inflight: dict[asyncio.Future[None], I] = {}
        lock = threading.Lock()
        loop = asyncio.get_running_loop()
        self.batches = 0
        self._io = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix=f"{self.name}-io")
        loop.set_default_executor(self._io)  # `asyncio.to_thread` of clients and the limiter: the same threads
        coroutine = inspect.iscoroutinefunction(work)
        threads = None if coroutine else ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix=self.name)
        finished: collections.deque[asyncio.Future[None]] = collections.deque()
        arrived = asyncio.Event()

        def on_finished(task: asyncio.Future[None]) -> None:
            finished.append(task)
            arrived.set()

        refill, claimed_at = refill_of(self.concurrency), 0.0
        stop_keeping = threading.Event()
        keeper = None
        if self.keep_every is not None:
            keeper = threading.Thread(target=self._keep, args=(source, inflight, lock, stop_keeping), daemon=True)
            keeper.start()
        try:
            while True:
                stopping = time.monotonic() - started > self.max_seconds or source.stopped()
                free, full = self.concurrency - len(inflight), False
                # claim once `refill` are free (a statement for several while entities finish fast), or any free
                # slot when the last claim is CLAIM_AGAIN_SECONDS old
                if not stopping and free > 0 and \
                        (not inflight or free >= refill or time.monotonic() - claimed_at >= CLAIM_AGAIN_SECONDS):
                    limit = min(free, self.batch_size)
                    with lock:
                        held = list(inflight.values())
                    claimed = await self.blocking(lambda: source.claim(limit, held))
                    claimed_at = time.monotonic()
                    full = len(claimed) >= limit  # all it was asked for: more may be due right now
                    if claimed:
                        self.batches += 1
                    with lock:
                        for item in claimed:
                            if coroutine:
                                task = asyncio.ensure_future(work(item))  # type: ignore[arg-type]
                            else:
                                task = loop.run_in_executor(threads, work, item)
                            task.add_done_callback(on_finished)
                            inflight[task] = item
                if inflight:
                    if not finished and full and self.concurrency - len(inflight) >= refill:
                        continue  # a run's first claims fill its slots at once, not one batch per finished entity
                    if not finished:  # woken once per finished entity, not by a wait on every task in flight
                        try:
                            await asyncio.wait_for(arrived.wait(), timeout=1.0)
                        except TimeoutError:
                            continue
                    arrived.clear()
                    done = [finished.popleft() for _ in range(len(finished))]
                    with lock:
                        for task in done:
                            source.released(inflight.pop(task))
                            task.result()  # the work function settles everything; a raise here is a bug in it
                    continue
                if stopping:
                    break
                wait_for = await self.blocking(source.next_due_in)
                if wait_for is None or wait_for > self.linger_seconds or \
                        time.monotonic() - started + wait_for > self.max_seconds:
                    break
                self.sleep(max(wait_for, 0.05))  # nothing is in flight: holding the loop holds nobody up
        finally:
            if inflight:  # the run fails: what is in flight still settles (as a thread pool's shutdown waited)
                await asyncio.wait(list(inflight))
            stop_keeping.set()
            if keeper is not None:
                keeper.join(timeout=5)
            if threads is not None:
                threads.shutdown(wait=True)
            try:
                if closing is not None:
                    await self.blocking(closing)
                await aio.close_loop_locals()
            finally:
                self._io.shutdown(wait=True)
                if self._calls is not None:
                    self._calls.shutdown(wait=True)
                    self._calls = None
        return self.batches

    def _keep(self, source: Source[I], inflight: dict[asyncio.Future[None], I], lock: threading.Lock,
              stop: threading.Event) -> None:
        """`source.keep` of what is in flight, every `keep_every` seconds."""
        assert self.keep_every is not None
        while not stop.wait(self.keep_every):
            with lock:
                items = list(inflight.values())
            if not items:
                continue
            try:
                source.keep(items)
            except Exception:  # noqa: BLE001 - a missed extension only risks a reclaim, which fencing makes safe
                log.warning("%s: keeping %d in flight failed", self.name, len(items))
