"""The core's per-entity engine (`redrive.engine`) over an in-memory source: how many it holds in flight, when
it claims, that it finishes what it claimed whatever happens, and that a coroutine's entity holds no thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from redrive.engine import Engine, refill_of


class Listed:
    """A source of numbered items, all due now; records every claim's limit and what was held then."""

    def __init__(self, n: int, *, stop_after: int | None = None, fail_on_claim: int | None = None) -> None:
        self.todo = list(range(n))
        self.limits: list[int] = []
        self.held_at_claim: list[int] = []
        self.settled: list[int] = []
        self.kept: list[list[int]] = []
        self.stop_after, self.fail_on_claim = stop_after, fail_on_claim
        self.claimed = self.fruitful = 0

    def claim(self, limit: int, held: list[int]) -> list[int]:
        self.limits.append(limit)
        self.held_at_claim.append(len(held))
        if self.fail_on_claim is not None and len(self.limits) == self.fail_on_claim:
            raise ConnectionError("the queue is away")
        out, self.todo = self.todo[:limit], self.todo[limit:]
        self.claimed += len(out)
        self.fruitful += bool(out)
        return out

    def keep(self, held: list[int]) -> None:
        self.kept.append(sorted(held))

    def next_due_in(self) -> float | None:
        return None

    def stopped(self) -> bool:
        return self.stop_after is not None and self.claimed >= self.stop_after

    def released(self, item: int) -> None:
        self.settled.append(item)


def test_a_claim_never_asks_for_more_than_the_free_slots_and_every_item_is_worked_once() -> None:
    source, seen, at_once, peak = Listed(37), [], [0], [0]
    lock = threading.Lock()

    def work(item: int) -> None:
        with lock:
            at_once[0] += 1
            peak[0] = max(peak[0], at_once[0])
        seen.append(item)
        with lock:
            at_once[0] -= 1

    engine: Engine[int] = Engine(name="t", concurrency=6, batch_size=4, linger_seconds=0)
    batches = asyncio.run(engine.drain(source, work))
    assert sorted(seen) == list(range(37)) and sorted(source.settled) == list(range(37))
    assert all(limit <= 4 and limit + held <= 6 for limit, held in zip(source.limits, source.held_at_claim,
                                                                        strict=True))
    assert peak[0] <= 6
    assert batches == source.fruitful >= 37 // 4  # the claims that brought something


def test_a_coroutines_entities_wait_together_on_a_few_threads() -> None:
    """50 entities each waiting 0.3 s on an 'upstream': all 50 wait at once, and the process gains no thread per
    entity (its I/O threads only)."""
    n, waiting, peak = 50, [0], [0]
    threads = [threading.active_count(), threading.active_count()]

    async def work(item: int) -> None:
        waiting[0] += 1
        peak[0] = max(peak[0], waiting[0])
        threads[1] = max(threads[1], threading.active_count())
        await asyncio.sleep(0.3)
        waiting[0] -= 1

    engine: Engine[int] = Engine(name="t", concurrency=n, batch_size=n, linger_seconds=0)
    asyncio.run(engine.drain(Listed(n), work))
    assert peak[0] == n
    assert threads[1] - threads[0] <= Engine.io_threads < n


def test_a_stopped_source_is_claimed_no_more_and_what_it_gave_is_finished() -> None:
    source, seen = Listed(100, stop_after=10), []
    engine: Engine[int] = Engine(name="t", concurrency=4, batch_size=4, linger_seconds=0)
    asyncio.run(engine.drain(source, seen.append))
    assert source.claimed >= 10 and sorted(seen) == list(range(source.claimed)) and source.todo


def test_a_failing_claim_fails_the_run_after_what_is_in_flight_finished_and_closing_still_runs() -> None:
    source, seen, closed = Listed(20, fail_on_claim=3), [], []

    async def work(item: int) -> None:
        await asyncio.sleep(0.05)
        seen.append(item)

    engine: Engine[int] = Engine(name="t", concurrency=4, batch_size=2, linger_seconds=0)
    with pytest.raises(ConnectionError):
        asyncio.run(engine.drain(source, work, closing=lambda: closed.append(True)))
    assert sorted(seen) == sorted(source.settled) == list(range(source.claimed)) and source.claimed == 4
    assert closed == [True]


def test_what_is_in_flight_is_kept_while_it_is_worked() -> None:
    source, gate = Listed(3), threading.Event()

    def work(item: int) -> None:
        gate.wait(5)

    def open_gate_once_kept() -> None:
        while not source.kept:
            threading.Event().wait(0.01)
        gate.set()

    opener = threading.Thread(target=open_gate_once_kept, daemon=True)
    opener.start()
    engine: Engine[int] = Engine(name="t", concurrency=3, batch_size=3, keep_every=0.05, linger_seconds=0)
    asyncio.run(engine.drain(source, work))
    opener.join(5)
    assert source.kept and source.kept[0] == [0, 1, 2]


@pytest.mark.parametrize(("concurrency", "refill"), [(1, 1), (2, 1), (8, 4), (64, 8), (300, 8)])
def test_a_refill_is_half_the_slots_up_to_eight(concurrency: int, refill: int) -> None:
    assert refill_of(concurrency) == refill
