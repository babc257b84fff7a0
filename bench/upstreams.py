"""Upstreams with latency and provider limits: what the shared limiter costs and what throughput it reaches.

    python -m bench upstreams                          # both parts
    BENCH_UPSTREAMS_ENTITIES=2000 python -m bench upstreams
    python -m bench upstreams --part limiter           # or --part drain, --part outage

Part 1, the limiter's hot path (`redrive.upstreams`), per call, medians of rotated rounds in one thread:
a call with no limits (no round trip), one bare `SELECT 1` transaction (the floor of any database round
trip; BEGIN, SELECT and COMMIT are three), the same in autocommit (one), and acquire + release with a slot, with a slot and the rate ring, and with the retry budget too.
Wall time and the machine's CPU per call (PostgreSQL's backends included).

Part 2, a drain against the sandbox as the issue's provider: the LLM route answers after a lognormal
latency (p50 1 s, p99 4 s) and enforces 64 concurrent and 50 requests/s (429 + Retry-After beyond).
N entities of a core drain (one LLM call and one checkpoint each) are worked by 1, 2 and 4 drain
processes sharing the queue (SKIP LOCKED) and the limits (`REDRIVE_UPSTREAM_LLM`). It reports entities/s
against what the provider allows (the smaller of concurrency ÷ mean latency and the rate), the sandbox's
peak concurrency and peak requests in any 1 s window, and how many requests it refused (must be 0).
Not yet through `make serve`'s topology (daemon, run queue): the drains are plain processes here.

Part 1b, in flight (`--part in-flight`): one drain process against a slow LLM (p50 8 s, p99 30 s) with no limits, 8, 64 and 256
entities in flight, a plain handler (a thread each) against a coroutine handler (a task each), interleaved:
answers/s over the middle 60 % of the run against in-flight ÷ mean latency, and the process's peak threads,
resident memory and CPU per entity.

Part 3, an outage (`outage_part`): the LLM answers 503 to everything for 60 s at full load; the retries sent
stay within the retry budget, throughput comes back within 30 s, nothing is lost or called twice, one alert.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import psutil
import sqlalchemy as sa

from bench._support import machine_cpu, scratch_database
from devstack.sandbox import SandboxClient
from redrive import upstreams as up
from redrive import work
from redrive.clock import SystemClock
from redrive.db import engine_for
from redrive.upstream_policy import UpstreamLimits

CALLS = int(os.environ.get("BENCH_UPSTREAMS_CALLS", "1500"))
ROUNDS = 3
ENTITIES = int(os.environ.get("BENCH_UPSTREAMS_ENTITIES", "1000"))
LLM_P50, LLM_P99, LLM_CONCURRENT, LLM_RATE = 1.0, 4.0, 64, 50
# the limiter's own setting for the LLM: the provider's concurrency, its rate a few percent under (the
# limiter counts grants, the provider arrivals; docs/operating.md "Upstream limits")
RATE_SHARE = float(os.environ.get("BENCH_UPSTREAMS_RATE_SHARE", "0.9"))
LIMITS = UpstreamLimits(max_concurrent=LLM_CONCURRENT, rate_per_second=LLM_RATE * RATE_SHARE, lease_seconds=60)


# ------------------------------------------------------------------------------------------ limiter


def _contenders(engine: sa.Engine) -> dict[str, Callable[[], None]]:
    big = {"max_concurrent": 64, "lease_seconds": 60}  # one thread holds one slot at a time
    made = {
        "slot": Upstreams_for(engine, UpstreamLimits(**big)),  # type: ignore[arg-type]
        "slot + rate": Upstreams_for(engine, UpstreamLimits(**big, rate_per_second=10_000)),  # type: ignore[arg-type]
        "slot + rate + retry budget": Upstreams_for(engine, UpstreamLimits(**big, rate_per_second=10_000,
                                                                           retry_share=0.1)),  # type: ignore[arg-type]
    }
    bare = up.Upstreams(engine, {}, clock=SystemClock())

    def select_one() -> None:
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT 1"))

    auto = engine.execution_options(isolation_level="AUTOCOMMIT")

    def select_one_autocommit() -> None:
        with auto.connect() as conn:
            conn.execute(sa.text("SELECT 1"))

    out: dict[str, Callable[[], None]] = {
        "no limits (straight through)": lambda: bare.call("llm", _noop),
        "one SELECT 1 transaction (floor)": select_one,
        "one SELECT 1, autocommit (1 round trip)": select_one_autocommit,
    }
    for name, limiter in made.items():
        out[f"acquire + release: {name}"] = (lambda u: lambda: u.call("llm", _noop))(limiter)
    return out


def Upstreams_for(engine: sa.Engine, limits: UpstreamLimits) -> up.Upstreams:  # noqa: N802 - a factory
    name = f"llm-{uuid.uuid4().hex[:6]}"
    limiter = up.Upstreams(engine, {name: limits}, clock=SystemClock())
    limiter.configure()
    return _Renamed(limiter, name)  # type: ignore[return-value]


class _Renamed:
    """Calls "llm" on a limiter configured under a unique name (each contender has its own rows)."""

    def __init__(self, limiter: up.Upstreams, name: str) -> None:
        self.limiter, self.name = limiter, name

    def call(self, _: str, fn: Callable[[], Any]) -> Any:
        return self.limiter.call(self.name, fn)


def _noop() -> None:
    return None


def limiter_part() -> dict[str, tuple[float, float]]:
    with scratch_database("bench_upstreams_limiter") as url:
        engine = engine_for(url)
        contenders = _contenders(engine)
        for run in contenders.values():  # warm-up: connections, plans
            for _ in range(50):
                run()
        walls: dict[str, list[float]] = {n: [] for n in contenders}
        cpus: dict[str, list[float]] = {n: [] for n in contenders}
        names = list(contenders)
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[: r % len(names)]:
                run = contenders[name]
                cpu, started = machine_cpu(), time.perf_counter()
                for _ in range(CALLS):
                    run()
                walls[name].append((time.perf_counter() - started) / CALLS)
                cpus[name].append((machine_cpu() - cpu) / CALLS)
    result = {n: (statistics.median(walls[n]), statistics.median(cpus[n])) for n in names}
    print(f"limiter hot path, {CALLS} calls × {ROUNDS} rounds, one thread (medians per call):")
    floor = result["one SELECT 1 transaction (floor)"][0]
    for name, (wall, cpu) in result.items():
        print(f"  {name:<44} {wall * 1e6:8.0f} µs wall  {cpu * 1e6:8.0f} µs machine CPU  "
              f"{wall / floor:5.2f}× a SELECT 1")
    return result


# -------------------------------------------------------------------------------------------- drain


def _drain_process(db_url: str, sandbox_url: str, owner: str, concurrency: int, out: Any,
                   limits: UpstreamLimits | None = LIMITS, linger: float = 1.0, handler: str = "coroutine") -> None:
    """One drain process: each entity one LLM call (its ref in the prompt, so the sandbox's effect log tells
    a second call of the same entity apart) and one checkpoint; the retry budget's alert is the core's.
    `handler`: "coroutine" (the criticizer's kind: no thread per entity in flight) or "thread" (a plain one)."""
    from redrive.backoff import FixedSchedule
    from redrive.drain import Attempt, Drain
    from redrive.reliability import Reliability
    from redrive.stages import StagePolicy
    from resources.http import shared_async_client, shared_client

    engine = engine_for(db_url)
    runtime = Reliability(engine=engine)
    if limits is not None:
        up.install(up.Upstreams(engine, {"llm": limits}, clock=SystemClock(),
                                on_exhausted=runtime.retry_budget_exhausted))
    url = f"{sandbox_url}/llm/v1/chat/completions"

    def body(entity: str) -> dict[str, Any]:
        return {"model": "m", "messages": [{"role": "user", "content": f"critique {entity}"}]}

    def post(entity: str) -> Any:
        answer = shared_client().post(url, json=body(entity), headers={"Authorization": "Bearer k"}, timeout=120)
        answer.raise_for_status()
        return answer.json()["id"]

    async def apost(entity: str) -> Any:
        answer = await shared_async_client().post(url, json=body(entity), headers={"Authorization": "Bearer k"},
                                                  timeout=120)
        answer.raise_for_status()
        return answer.json()["id"]

    def handle_on_a_thread(attempt: Attempt) -> None:
        attempt.stage("llm", lambda: {"id": up.guarded("llm", lambda: post(attempt.entity_ref))})

    async def handle_as_a_task(attempt: Attempt) -> None:
        async def call() -> dict[str, Any]:
            return {"id": await up.aguarded("llm", lambda: apost(attempt.entity_ref))}

        await attempt.astage("llm", call)

    handle = handle_as_a_task if handler == "coroutine" else handle_on_a_thread

    drain = Drain(reliability=runtime, pipeline="bench_upstreams", owner=owner, concurrency=concurrency,
                  batch_size=min(concurrency, 100), linger_seconds=linger, max_seconds=900,
                  policies={"llm": StagePolicy(max_attempts=5, backoff=FixedSchedule((1.0, 2.0, 4.0)))})
    report = drain.run(handle)
    out.put(report.as_metadata())


def mean_lognormal(p50: float, p99: float) -> float:
    sigma = math.log(p99 / p50) / 2.3263478740408408
    return p50 * math.exp(sigma * sigma / 2)


def drain_part(processes: tuple[int, ...] = tuple(int(n) for n in os.environ.get(
        "BENCH_UPSTREAMS_PROCESSES", "1,2,4").split(","))) -> list[dict[str, Any]]:
    sandbox = SandboxClient(os.environ["SANDBOX_URL"], timeout=30)
    allowed = min(LLM_CONCURRENT / mean_lognormal(LLM_P50, LLM_P99), LLM_RATE)
    rows = []
    print(f"\ndrain against the LLM as a provider (p50 {LLM_P50} s, p99 {LLM_P99} s, {LLM_CONCURRENT} concurrent, "
          f"{LLM_RATE}/s), {ENTITIES} entities; the provider allows {allowed:.1f}/s; "
          f"limiter: {LIMITS.max_concurrent} slots, {LIMITS.rate_per_second:.0f}/s")
    ctx = mp.get_context("spawn")
    for n in processes:
        sandbox.reset()
        sandbox.set_profile("llm", p50=LLM_P50, p99=LLM_P99, max_concurrent=LLM_CONCURRENT,
                            rate_per_second=LLM_RATE, seed=26)
        with scratch_database(f"bench_upstreams_drain_{n}") as url:
            engine = engine_for(url)
            with engine.begin() as conn:
                work.enqueue_many(conn, "bench_upstreams", [(f"e-{i}", None) for i in range(ENTITIES)],
                                  now=SystemClock().now())
            per_process = math.ceil(LLM_CONCURRENT * 1.25 / n)  # a little more than the slots: waiting is cheap
            out = ctx.Queue()
            cpu = machine_cpu()
            procs = [ctx.Process(target=_drain_process, args=(url, sandbox.base_url, f"bench-{n}-{i}",
                                                              per_process, out)) for i in range(n)]
            for p in procs:
                p.start()
            reports = [out.get(timeout=1800) for _ in procs]
            for p in procs:
                p.join(30)
            cpu = machine_cpu() - cpu
            with engine.connect() as conn:
                done = conn.execute(sa.text("SELECT count(*) FROM work_items WHERE status = 'done'")).scalar_one()
        calls = sandbox.effects("llm.call")
        stamps = sorted(e["at"] for e in calls)
        span = (datetime.fromisoformat(stamps[-1]) - datetime.fromisoformat(stamps[0])).total_seconds()
        rate = (len(calls) - 1) / span if span > 0 else float("nan")
        meter = sandbox.meters("llm")
        reasons: dict[str, int] = {}
        for record in sandbox.requests("llm"):
            if record["step"].startswith("limited:"):
                reasons[record["step"]] = reasons.get(record["step"], 0) + 1
        row = {"processes": n, "in_flight_per_process": per_process, "done": done, "llm_calls": len(calls),
               "entities_per_s": rate, "ratio_to_allowed": rate / allowed, "peak_concurrency":
               meter["peak_concurrency"], "peak_rate": meter["peak_rate_per_second"],
               "refused_429": meter["limited"], "cpu_ms_per_entity": cpu / max(1, done) * 1000,
               "deferred": sum(r["deferred"] for r in reports), "lease_lost": sum(r["lease_lost"] for r in reports)}
        rows.append(row)
        print(f"  {n} process(es) × {per_process} in flight: {done}/{ENTITIES} done, {rate:5.1f} entities/s = "
              f"{rate / allowed:4.2f} of allowed; sandbox peak {meter['peak_concurrency']} concurrent, "
              f"{meter['peak_rate_per_second']} in 1 s; refused {meter['limited']} {reasons or ''}; "
              f"machine CPU {row['cpu_ms_per_entity']:.1f} ms/entity", flush=True)
    print(f"  what caps it: the provider's rate ({LLM_RATE}/s; the limiter grants {LIMITS.rate_per_second:.0f}/s) — concurrency ÷ latency "
          f"({LLM_CONCURRENT / mean_lognormal(LLM_P50, LLM_P99):.1f}/s) is above it")
    return rows


IN_FLIGHT_LEVELS = tuple(int(n) for n in os.environ.get("BENCH_UPSTREAMS_IN_FLIGHT", "8,64,256").split(","))
# an LLM answering a long prompt: slow enough that 256 in flight (~27 answers/s) stay under what this 2-core machine
# can work (~35 entities/s with the sandbox and PostgreSQL on it), so what is measured is the engine, not the CPU
SLOW_P50, SLOW_P99 = (float(x) for x in os.environ.get("BENCH_UPSTREAMS_IN_FLIGHT_LATENCY", "8,30").split(","))
RUN_LENGTH = 6  # entities a run, in multiples of the in-flight level


def steady_rate(answered: list[datetime], share: float = 0.6) -> float:
    """Pure: answers a second over the middle `share` of them (the sandbox stamps an answer when it is sent), so the
    ramp-up and the tail of a slow upstream's last answers do not count as the engine's."""
    stamps = sorted(answered)
    lo, hi = int(len(stamps) * (1 - share) / 2), int(len(stamps) * (1 + share) / 2) - 1
    span = (stamps[hi] - stamps[lo]).total_seconds() if hi > lo else 0.0
    return (hi - lo) / span if span > 0 else float("nan")


def in_flight_part(levels: tuple[int, ...] = IN_FLIGHT_LEVELS) -> list[dict[str, Any]]:
    """One drain process, a slow LLM (p50 8 s, p99 30 s) with no limits:
    entities/s against `in flight ÷ mean latency`, and the process's peak threads and resident memory, for a
    plain handler (a thread per entity in flight) and a coroutine handler (a task), interleaved per level."""
    sandbox = SandboxClient(os.environ["SANDBOX_URL"], timeout=30)
    mean = mean_lognormal(SLOW_P50, SLOW_P99)
    ctx = mp.get_context("spawn")
    rows = []
    print(f"\nin flight in one drain run: the LLM p50 {SLOW_P50} s, p99 {SLOW_P99} s (mean {mean:.2f} s), no limits; "
          f"{RUN_LENGTH} × in-flight entities a run")
    for i, level in enumerate(levels):
        for handler in (("thread", "coroutine") if i % 2 == 0 else ("coroutine", "thread")):
            n = level * RUN_LENGTH
            sandbox.reset()
            sandbox.set_profile("llm", p50=SLOW_P50, p99=SLOW_P99, seed=26)
            with scratch_database(f"bench_upstreams_inflight_{handler}_{level}") as url:
                engine = engine_for(url)
                with engine.begin() as conn:
                    work.enqueue_many(conn, "bench_upstreams", [(f"e-{j}", None) for j in range(n)],
                                      now=SystemClock().now())
                out = ctx.Queue()
                proc = ctx.Process(target=_drain_process, args=(url, sandbox.base_url, f"inflight-{handler}", level,
                                                                out, None, 0.5, handler))
                started = time.perf_counter()
                proc.start()
                watched = psutil.Process(proc.pid)
                threads = rss = 0
                cpu = 0.0
                while proc.is_alive():
                    try:
                        threads = max(threads, watched.num_threads())
                        rss = max(rss, watched.memory_info().rss)
                        times = watched.cpu_times()
                        cpu = times.user + times.system
                    except psutil.Error:
                        break
                    time.sleep(0.1)
                report = out.get(timeout=1800)
                proc.join(30)
                wall = time.perf_counter() - started
            rate = steady_rate([datetime.fromisoformat(e["at"]) for e in sandbox.effects("llm.call")])
            ideal = level / mean
            row = {"handler": handler, "in_flight": level, "entities": n, "done": report["done"],
                   "entities_per_s": rate, "ideal_per_s": ideal, "ratio_to_ideal": rate / ideal,
                   "peak_concurrency": sandbox.meters("llm")["peak_concurrency"], "peak_threads": threads,
                   "peak_rss_mb": rss / 2**20, "wall_s": wall, "cpu_ms_per_entity": cpu / max(1, n) * 1000}
            rows.append(row)
            print(f"  {handler:<9} × {level:>3} in flight: {report['done']}/{n} done, {rate:6.1f} entities/s = "
                  f"{rate / ideal:4.2f} of {ideal:.1f}/s; LLM peak {row['peak_concurrency']} at once; process peak "
                  f"{threads} threads, {rss / 2**20:.0f} MB resident, {row['cpu_ms_per_entity']:.1f} ms CPU an entity",
                  flush=True)
    return rows


OUTAGE_ENTITIES = int(os.environ.get("BENCH_UPSTREAMS_OUTAGE_ENTITIES", "1500"))  # fresh work runs out early in the outage
OUTAGE_AFTER, OUTAGE_SECONDS = 20.0, 60.0
BUDGET = UpstreamLimits(max_concurrent=LLM_CONCURRENT, rate_per_second=LLM_RATE * RATE_SHARE, lease_seconds=60,
                        retry_share=0.1, retry_floor_per_second=1.0, retry_window_seconds=10)


def recovery_seconds(ok_per_second: dict[int, int], before: tuple[int, int], recovered: int,
                     share: float = 0.9, window: int = 5) -> tuple[float, float | None]:
    """Pure: the median of successful calls a second over `before` (first, last second), and how many seconds
    after `recovered` a `window`-second mean first reaches `share` of it (None: never)."""
    baseline = statistics.median(ok_per_second.get(t, 0) for t in range(*before))
    last = max(ok_per_second, default=recovered)
    for t in range(recovered, last - window + 2):
        if statistics.fmean(ok_per_second.get(t + i, 0) for i in range(window)) >= share * baseline:
            return baseline, float(t - recovered)
    return baseline, None


def outage_part(processes: int = 2) -> dict[str, Any]:
    """The LLM route answers 503 to everything for 60 s at full load (the sandbox's random faults at rate 1),
    20 s into a drain of OUTAGE_ENTITIES by `processes` drain processes under the retry budget (10 % of calls
    plus 1/s over 10 s). Retries sent, from the limiter's own per-second ledger (`upstream_calls`), must stay
    within the budget; successful calls a second, from the sandbox's effect log, must be back to 0.9 of the
    pre-outage median within 30 s of recovery; every entity done or dead-lettered, none called twice after
    success, one `retry_budget_exhausted` alert."""
    sandbox = SandboxClient(os.environ["SANDBOX_URL"], timeout=60)
    sandbox.reset()
    sandbox.set_profile("llm", p50=LLM_P50, p99=LLM_P99, max_concurrent=LLM_CONCURRENT, rate_per_second=LLM_RATE,
                        seed=26)
    print(f"\noutage: {OUTAGE_ENTITIES} entities, {processes} drain processes, the LLM as above; 503 to every "
          f"request from {OUTAGE_AFTER:.0f} s for {OUTAGE_SECONDS:.0f} s; retry budget 10 % of calls + 1/s over 10 s")
    ctx = mp.get_context("spawn")
    with scratch_database("bench_upstreams_outage") as url:
        engine = engine_for(url)
        with engine.begin() as conn:
            work.enqueue_many(conn, "bench_upstreams", [(f"e-{i}", None) for i in range(OUTAGE_ENTITIES)],
                              now=SystemClock().now())
        out = ctx.Queue()
        per_process = math.ceil(LLM_CONCURRENT * 1.25 / processes)
        procs = [ctx.Process(target=_drain_process, args=(url, sandbox.base_url, f"outage-{i}", per_process, out,
                                                          BUDGET, 30.0)) for i in range(processes)]
        for p in procs:
            p.start()
        time.sleep(OUTAGE_AFTER)  # the drains reach full load
        down = datetime.now().astimezone()
        sandbox.random_faults("llm", seed=26, rates={"503": 1.0})
        time.sleep(OUTAGE_SECONDS)  # the outage lasts this long, in real time, as a provider's would
        sandbox.stop_random_faults("llm")
        up_again = datetime.now().astimezone()
        reports = [out.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join(30)
        with engine.connect() as conn:
            states = dict(conn.execute(sa.text("SELECT status, count(*) FROM work_items GROUP BY 1")).all())
            ledger = conn.execute(sa.text("SELECT second, calls, retries FROM upstream_calls WHERE upstream = 'llm' "
                                          "ORDER BY second")).all()
            alerts = conn.execute(sa.text("SELECT count(*) FROM alerts WHERE kind = 'retry_budget_exhausted'"))\
                .scalar_one()
    calls = sandbox.effects("llm.call")
    prompts = [e["messages_sha256"] for e in calls]
    twice = len(prompts) - len(set(prompts))
    start = datetime.fromisoformat(sorted(e["at"] for e in calls)[0])
    ok_per_second: dict[int, int] = {}
    for e in calls:
        t = int((datetime.fromisoformat(e["at"]) - start).total_seconds())
        ok_per_second[t] = ok_per_second.get(t, 0) + 1
    went_down, came_back = int((down - start).total_seconds()), int((up_again - start).total_seconds())
    baseline, back_after = recovery_seconds(ok_per_second, (5, went_down), came_back)
    outage = [r for r in ledger if down.timestamp() <= r.second < up_again.timestamp()]
    sent, retried = sum(r.calls for r in outage), sum(r.retries for r in outage)
    allowed = 0.1 * sent + 1.0 * len(outage)
    done, dead = states.get("done", 0), states.get("dead", 0)
    deferred = sum(r["deferred"] for r in reports)
    row = {"sent_during_outage": sent, "retries_during_outage": retried, "retry_allowance": allowed,
           "baseline_ok_per_s": baseline, "back_to_90pct_after_s": back_after, "done": done, "dead": dead,
           "called_twice": twice, "alerts": alerts, "deferred": deferred}
    print(f"  during the outage: {sent} requests sent, of them {retried} retries (the budget allowed "
          f"{allowed:.0f}: 10 % of calls + 1/s); {deferred} retries deferred in all, spending no attempt")
    print(f"  before: {baseline:.1f} successful calls/s (median); back to 90 % of it "
          f"{'never' if back_after is None else f'{back_after:.0f} s'} after recovery (target ≤ 30 s)")
    print(f"  {done} done, {dead} dead-lettered of {OUTAGE_ENTITIES}; entities called twice after success: {twice}; "
          f"retry_budget_exhausted alerts: {alerts}")
    row["ok"] = (retried <= allowed and back_after is not None and back_after <= 30 and done + dead == OUTAGE_ENTITIES
                 and twice == 0 and alerts == 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench upstreams")
    parser.add_argument("--part", choices=["limiter", "in-flight", "drain", "outage", "all"], default="all")
    args = parser.parse_args(argv or [])
    print(f"machine: {psutil.cpu_count()} cores")
    if args.part in ("limiter", "all"):
        limiter_part()
    if args.part in ("in-flight", "all"):
        in_flight_part()
    if args.part in ("drain", "all"):
        rows = drain_part()
        bad = [r for r in rows if r["refused_429"] or r["done"] != ENTITIES]
        if bad:
            print(f"FAILED: refused requests or entities not done: {bad}")
            return 1
    if args.part in ("outage", "all") and not outage_part()["ok"]:
        print("FAILED: the outage's retries, recovery, outcome or alert (see above)")
        return 1
    return 0
