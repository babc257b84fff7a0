"""The upstream limiter across real processes, witnessed by the sandbox's meter."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import sqlalchemy as sa

from redrive import upstreams as up
from redrive.clock import SystemClock
from redrive.db import engine_for
from redrive.upstreams import UpstreamLimits, Upstreams

LIMIT = 3


def _worker(db_url: str, sandbox_url: str, calls: int, threads: int, done: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    limits = {"llm": UpstreamLimits(max_concurrent=LIMIT, rate_per_second=40, lease_seconds=30)}
    upstreams = Upstreams(engine_for(db_url), limits, clock=SystemClock())
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def one(_: int) -> int:
        with httpx.Client(timeout=10) as client:
            def post() -> int:
                answer = client.post(f"{sandbox_url}/llm/v1/chat/completions", json=body,
                                     headers={"Authorization": "Bearer k"})
                answer.raise_for_status()
                return answer.status_code
            return upstreams.call("llm", post)

    with ThreadPoolExecutor(threads) as pool:
        done.put(list(pool.map(one, range(calls))))


def _holder(db_url: str, held: multiprocessing.Event) -> None:  # type: ignore[type-arg]
    upstreams = Upstreams(engine_for(db_url), {"llm": UpstreamLimits(max_concurrent=1, lease_seconds=2)},
                          clock=SystemClock())
    upstreams.acquire("llm", upstreams.limits["llm"])
    held.set()
    time.sleep(60)  # killed long before


def test_four_processes_never_exceed_the_shared_limits(db_url: str, sandbox) -> None:  # type: ignore[no-untyped-def]
    """4 processes × 4 threads, each wanting more than the 3 concurrent the provider accepts: every call
    succeeds, the sandbox never refused one, and its peak concurrency is the limit, not 16."""
    sandbox.set_profile("llm", latency=0.2, max_concurrent=LIMIT, rate_per_second=45)
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(db_url, sandbox.base_url, 12, 4, done)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [done.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert [s for r in results for s in r] == [200] * 48
    meter = sandbox.meters("llm")
    assert meter["limited"] == 0 and meter["admitted"] == 48
    assert meter["offered_peak_concurrency"] <= LIMIT and meter["offered_peak_rate_per_second"] <= 45
    assert meter["peak_concurrency"] == LIMIT  # the limit was used, not just respected


def test_a_sigkilled_holders_slot_comes_back_when_its_lease_ends(db_url: str) -> None:
    """A process holding the only slot is SIGKILLed; another process's acquire waits, then gets the slot
    once the 2 s lease has ended (not before)."""
    ctx = multiprocessing.get_context("spawn")
    held = ctx.Event()
    holder = ctx.Process(target=_holder, args=(db_url, held))
    holder.start()
    assert held.wait(60)
    granted_at = time.monotonic()
    os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]
    holder.join(10)
    engine = engine_for(db_url)
    waiter = Upstreams(engine, {"llm": UpstreamLimits(max_concurrent=1, lease_seconds=2)}, clock=SystemClock())
    with engine.connect() as conn:
        lease_until = conn.execute(sa.select(up.upstream_slots.c.lease_until)).scalar_one()
    grant = waiter.acquire("llm", waiter.limits["llm"])
    assert grant.slot == 1
    assert SystemClock().now() >= lease_until
    assert time.monotonic() - granted_at < 10
