"""Upstreams with latency and provider limits: what the shared limiter costs and what throughput it reaches.

    python -m bench upstreams                          # both parts
    BENCH_UPSTREAMS_ENTITIES=2000 python -m bench upstreams
    python -m bench upstreams --part limiter           # or in-flight, drain, scale-out, outage

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
The drains are plain processes here; part 2c runs the pipelines through the deployed topology.

Part 1b, in flight (`--part in-flight`): one drain process against a slow LLM (p50 8 s, p99 30 s) with no limits, 8, 64 and 256
entities in flight, a plain handler (a thread each) against a coroutine handler (a task each), interleaved:
answers/s over the middle 60 % of the run against in-flight ÷ mean latency, and the process's peak threads,
resident memory and CPU per entity.

Part 2b, scale-out (`--part scale-out`): the same LLM latency with its limits raised out of the way, 1, 2 and 4
drain processes at 8 entities in flight each (four fit this machine's cores) and at the criticizer's 64: answers/s
against one process's, and how busy the machine's cores were, which names the cores when they ran out.

Part 2c, through `make serve`'s topology (`--part deployed`): the criticizer, review notifications and evidence
(drained from the work queue), conversion (through its API and 2 worker processes) and matching (000's ingestion,
SQS, the queue sensor's drain runs), 10,000 entities each (`BENCH_UPSTREAMS_DEPLOYED_ENTITIES`,
`BENCH_UPSTREAMS_DEPLOYED_PIPELINES`), against the sandbox as all of the issue's providers (the PDF gateway too),
with the limiter set for them: entities/s at the route that binds each pipeline against what it allows, every
route's peaks and refusals, lost work, duplicate effects, and what capped it (the machine's cores, one run's core,
the limiter's rate share, or too few in flight).

Part 2d, CPU an entity (`--part cpu`): on an instant upstream, each pipeline through the topology against a bare
loop in this process doing the same upstream calls and the pipeline's own writes with no engine; machine CPU, rotated
rounds, medians and the ratio (target ≤ 2×). At two or more sizes (`BENCH_UPSTREAMS_CPU_SIZES`, default 2,000 and
8,000) it also splits each contender's CPU into what each more entity costs (the line through the sizes' medians) and
what the run costs whatever its size (the deployment's start, its runs' start-up): the first is the verdict's.
Evidence runs once per file job (its partition), so it holds their number across sizes (10,
`BENCH_EVIDENCE_FILE_JOBS`): a file job's run cost then falls in the second part, and it is printed apart.

Part 3, an outage (`outage_part`): the LLM answers 503 to everything for 60 s at full load; the retries sent
stay within the retry budget, throughput comes back within 30 s, nothing is lost or called twice, one alert.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import multiprocessing as mp
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import psutil
import sqlalchemy as sa

from bench._support import machine_cpu, scratch_database
from devstack.sandbox import SandboxClient
from devstack.stack import exported
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
RATE_SHARE = float(os.environ.get("BENCH_UPSTREAMS_RATE_SHARE", "0.95"))
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


@contextlib.contextmanager
def _queued(name: str, n: int) -> Iterator[str]:
    """A scratch database with n due entities of the bench's pipeline; its URL."""
    with scratch_database(name) as url:
        with engine_for(url).begin() as conn:
            work.enqueue_many(conn, "bench_upstreams", [(f"e-{i}", None) for i in range(n)], now=SystemClock().now())
        yield url


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
        with _queued(f"bench_upstreams_drain_{n}", ENTITIES) as url:
            engine = engine_for(url)
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
        stamps = sorted(datetime.fromisoformat(e["at"]) for e in calls)
        span = (stamps[-1] - stamps[0]).total_seconds()
        whole = (len(calls) - 1) / span if span > 0 else float("nan")
        rate = steady_rate(stamps)  # the middle 60 %: the ramp-up and the slow tail's last answers left out
        meter = sandbox.meters("llm")
        reasons: dict[str, int] = {}
        for record in sandbox.requests("llm"):
            if record["step"].startswith("limited:"):
                reasons[record["step"]] = reasons.get(record["step"], 0) + 1
        row = {"processes": n, "in_flight_per_process": per_process, "done": done, "llm_calls": len(calls),
               "entities_per_s": rate, "whole_run_per_s": whole, "ratio_to_allowed": rate / allowed, "peak_concurrency":
               meter["peak_concurrency"], "peak_rate": meter["peak_rate_per_second"],
               "refused_429": meter["limited"], "cpu_ms_per_entity": cpu / max(1, done) * 1000,
               "deferred": sum(r["deferred"] for r in reports), "lease_lost": sum(r["lease_lost"] for r in reports)}
        rows.append(row)
        print(f"  {n} process(es) × {per_process} in flight: {done}/{ENTITIES} done, {rate:5.1f} entities/s = "
              f"{rate / allowed:4.2f} of allowed (whole run, ramp and tail included: {whole:5.1f}/s); sandbox peak {meter['peak_concurrency']} concurrent, "
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
            with _queued(f"bench_upstreams_inflight_{handler}_{level}", n) as url:
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


SCALE_OUT_LEVELS = tuple(int(n) for n in os.environ.get("BENCH_UPSTREAMS_SCALE_OUT_IN_FLIGHT", "8,64").split(","))
SCALE_OUT_RUN = int(os.environ.get("BENCH_UPSTREAMS_SCALE_OUT_RUN", "30"))  # entities a process, × its in-flight level
# the LLM's limits raised out of the way: the provider enforces none, the limiter holds these (its round trips stay)
RAISED = UpstreamLimits(max_concurrent=10_000, rate_per_second=10_000, lease_seconds=60)
CPU_RAN_OUT = 0.8  # share of the machine's cores busy at which the cores, not the engine, cap a run


def scale_out(rates: dict[int, float], busy: dict[int, float], cores: int) -> dict[int, str]:
    """Pure: per number of processes, its throughput against one process's, and what capped it: the machine's
    cores when they were ≥ CPU_RAN_OUT busy, else nothing of this machine (the engine's own scaling)."""
    one = rates.get(1) or float("nan")
    return {n: f"{rate / one:4.2f}× one process; " + (
        f"the machine's {cores} cores ran out ({busy[n]:.0%} busy)" if busy[n] >= CPU_RAN_OUT
        else f"cores {busy[n]:.0%} busy") for n, rate in rates.items()}


def scale_out_part(processes: tuple[int, ...] = (1, 2, 4), levels: tuple[int, ...] = SCALE_OUT_LEVELS
                   ) -> list[dict[str, Any]]:
    """1, 2 and 4 drain processes (coroutine handler, as the criticizer's) against the LLM at p50 1 s / p99 4 s
    with its limits raised out of the way: answers/s over the middle 60 % against one process's, and how busy the
    machine's cores were, at a level the machine holds four of and at the criticizer's default of 64."""
    sandbox = SandboxClient(os.environ["SANDBOX_URL"], timeout=30)
    ctx = mp.get_context("spawn")
    cores = psutil.cpu_count() or 1
    rows = []
    print(f"\nscale-out: 1, 2, 4 drain processes, the LLM p50 {LLM_P50} s, p99 {LLM_P99} s with no provider limits "
          f"(limiter at {RAISED.max_concurrent} slots, {RAISED.rate_per_second:.0f}/s); {SCALE_OUT_RUN} × in-flight "
          "entities a process")
    for level in levels:
        rates, busy = {}, {}
        for n in processes:
            sandbox.reset()
            sandbox.set_profile("llm", p50=LLM_P50, p99=LLM_P99, seed=26)
            total = n * level * SCALE_OUT_RUN
            with _queued(f"bench_upstreams_scale_{level}_{n}", total) as url:
                out = ctx.Queue()
                procs = [ctx.Process(target=_drain_process, args=(url, sandbox.base_url, f"scale-{n}-{i}", level,
                                                                  out, RAISED)) for i in range(n)]
                cpu, started = machine_cpu(), time.perf_counter()
                for p in procs:
                    p.start()
                reports = [out.get(timeout=1800) for _ in procs]
                for p in procs:
                    p.join(30)
                wall, cpu = time.perf_counter() - started, machine_cpu() - cpu
            answered = [datetime.fromisoformat(e["at"]) for e in sandbox.effects("llm.call")]
            rates[n], busy[n] = steady_rate(answered), cpu / (wall * cores)
            done = sum(r["done"] for r in reports)
            rows.append({"in_flight_per_process": level, "processes": n, "entities": total, "done": done,
                         "llm_calls": len(answered), "entities_per_s": rates[n], "cores_busy": busy[n],
                         "cpu_ms_per_entity": cpu / max(1, done) * 1000,
                         "peak_concurrency": sandbox.meters("llm")["peak_concurrency"]})
            print(f"  {level:>3} in flight × {n} process(es): {done}/{total} done, {len(answered)} LLM calls, "
                  f"{rates[n]:6.1f} entities/s, machine CPU {rows[-1]['cpu_ms_per_entity']:.1f} ms/entity, "
                  f"cores {busy[n]:.0%} busy, LLM peak {rows[-1]['peak_concurrency']} at once", flush=True)
        for n, verdict in scale_out(rates, busy, cores).items():
            print(f"    {level} in flight, {n} process(es): {verdict}")
            next(r for r in rows if r["in_flight_per_process"] == level and r["processes"] == n)["verdict"] = verdict
    return rows


DEPLOYED_ENTITIES = int(os.environ.get("BENCH_UPSTREAMS_DEPLOYED_ENTITIES", "10000"))
DEPLOYED_PIPELINES = tuple(p for p in os.environ.get(
    "BENCH_UPSTREAMS_DEPLOYED_PIPELINES", "criticizer,review_notifications,evidence,conversion,matching").split(",")
    if p)
# conversion and matching are not drained from the work queue: they come in through their front doors (the
# conversion API; 000's ingestion, then SQS), submitted as the chaos run submits them, and settle in their own tables
FRONT_DOORS = ("conversion", "matching")
# the providers, by sandbox route: latency and the limits the provider enforces (429 + Retry-After beyond)
PROVIDERS: dict[str, dict[str, Any]] = {
    "llm": {"p50": LLM_P50, "p99": LLM_P99, "max_concurrent": LLM_CONCURRENT, "rate_per_second": LLM_RATE},
    "store": {"latency": 0.05},
    "mail.send": {"latency": 0.3, "rate_per_second": 20},
    "mail.lookup": {"latency": 0.3, "rate_per_second": 20},
    "case.attach": {"latency": 0.2, "max_concurrent": 32},
    "case.lookup": {"latency": 0.2, "max_concurrent": 32},
    "pdf.convert": {"latency": 0.2, "max_concurrent": 32},
}
# the deployment's limiter, one setting per upstream: the provider's concurrency and a share of its rate; 95 %, as
# docs/operating.md advises for a host with CPU to spare: the rate-bound pipelines (criticizer, review) keep this
# machine's cores under 70 % busy; 90 % (2026-11-28) left them at 0.89–0.90, with nothing refused at either
DEPLOYED_RATE_SHARE = float(os.environ.get("BENCH_UPSTREAMS_DEPLOYED_RATE_SHARE", "0.95"))
PROVIDER_LIMITS = {
    "REDRIVE_UPSTREAM_LLM": {"max_concurrent": LLM_CONCURRENT, "rate_per_second": LLM_RATE * DEPLOYED_RATE_SHARE},
    "REDRIVE_UPSTREAM_MAIL": {"rate_per_second": 20 * DEPLOYED_RATE_SHARE},
    "REDRIVE_UPSTREAM_CASE_API": {"max_concurrent": 32},
    "REDRIVE_UPSTREAM_PDF_GATEWAY": {"max_concurrent": 32},
}
# sized as docs/operating.md says: in flight over all runs at least the provider's slots, and enough runs that their
# processes' cores carry the rate. The criticizer: 2 runs × 48 (one run's process carries ~40 entities/s on its
# one core); review 8 in one run (26/s at 300 ms, above the mail's 20/s); evidence 8 in each of up to 8 file-job
# runs (a row holds a database connection across its case API call: 32 a run would take 8 × 32 of PostgreSQL's)
DEPLOYED_IN_FLIGHT = json.loads(os.environ.get("BENCH_UPSTREAMS_DEPLOYED_IN_FLIGHT", '{"criticizer": 48}'))
DEPLOYED_RUNS = json.loads(os.environ.get("BENCH_UPSTREAMS_DEPLOYED_RUNS", '{"criticizer": 2}'))
# the front doors' own sizing, as docs/operating.md says: conversion 2 worker processes × 16 jobs in flight (the
# gateway's 32 slots); matching one drain run with 70 documents in flight (the LLM's 64 slots), received in
# batches of 10
FRONT_DOOR_ENV = {
    "conversion": {"WORKER_CONCURRENCY": "16"},
    "matching": {"MATCHING_BATCH_SIZE": "10", "MATCHING_IN_FLIGHT": "70",
                 "MATCHING_SENSOR_INTERVAL_SECONDS": "5"},
}
FRONT_DOOR_WORKERS = {"conversion": 2}
# the route each pipeline calls once per entity and whose limits bind it (its throughput is measured there)
BINDING = {"criticizer": "llm", "review_notifications": "mail.send", "evidence": "case.attach",
           "conversion": "pdf.convert", "matching": "llm"}
EFFECT = {"llm": "llm.call", "mail.send": "mail.send", "case.attach": "case.attach", "pdf.convert": "pdf.convert"}


def allowed_per_second(profile: dict[str, Any]) -> float:
    """Pure: what a provider's route allows a second: the smaller of concurrency ÷ mean latency and its rate."""
    latency = profile.get("latency") or mean_lognormal(profile["p50"], profile["p99"])
    return min(profile.get("max_concurrent", math.inf) / latency, profile.get("rate_per_second", math.inf))


def deployed_cap(ratio: float, cores_busy: float, rate_bound: bool, share: float = RATE_SHARE,
                 run_busy: float = 0.0) -> str:
    """Pure: what capped a pipeline below 0.9 of what its provider allows, in the order it binds."""
    if ratio >= 0.9:
        return "met"
    if cores_busy >= CPU_RAN_OUT:
        return f"this machine's cores ({cores_busy:.0%} busy)"
    if run_busy >= CPU_RAN_OUT:
        return (f"a drain run's process: one core ({run_busy:.0%} of it; Python runs one thread at a time) — "
                "more drain runs (REDRIVE_DRAIN_RUNS), or less CPU an entity")
    if rate_bound and ratio >= share - 0.05:
        return f"the limiter's rate share (it grants {share:.0%} of the provider's rate)"
    return f"our engine: runs × in flight too few for the provider (cores {cores_busy:.0%} busy)"


def run_front_door(name: str, settings: Any, n: int, session: str, pg_pids: list[int], timeout: float, *,
                   upstreams: Callable[[SandboxClient], None], env: dict[str, str]) -> Any:
    """Conversion or matching through `make serve`'s topology (the API, the conversion workers, the daemon and its
    matching drain runs): `n` entities in through the pipeline's front door as the chaos run submits them, until each
    is settled in its own table; the `bench.scale.Outcome` of a drained pipeline, its lost ones those left open."""
    import random

    import dagster as dg

    from bench import chaos
    from bench._workload import RunWorkers, cpu_of, deployment
    from bench.scale import _DEFS, Outcome
    from devstack.topology import SERVICES

    sandbox = SandboxClient(os.environ["SANDBOX_URL"])
    sandbox.reset()
    upstreams(sandbox)
    engine = engine_for(settings.database_url or "")
    home = settings.redrive_data_dir / "bench-upstreams" / session
    only = ("code-server", "daemon", "conversion-api", "conversion-worker") if name == "conversion" else \
        ("code-server", "daemon")
    assert set(only) <= {s.name for s in SERVICES}
    load = chaos.LOADS[name]
    files = {"UPLOADS_DIR": str(home / "uploads"), "RESULTS_DIR": str(home / "results")}  # go with the run
    with deployment(settings, home, only=only, workers=FRONT_DOOR_WORKERS.get(name, 1),
                    env={**env, **FRONT_DOOR_ENV.get(name, {}), **files}) as topology:
        ctx = chaos.Context(engine, sandbox, session, chaos.Canaries.from_seed(26), _DEFS[-1], random.Random(26),
                            topology=topology)
        ledger = chaos.Ledger(name)
        instance = dg.DagsterInstance.from_config(str(home))
        pids = [p.proc.pid for p in topology.processes.values()]
        cpu0, pg0, machine0, started = cpu_of(pids), cpu_of(pg_pids), machine_cpu(), time.perf_counter()
        with RunWorkers(pids) as workers:
            load.submit(ctx, n, ledger)
            chaos.wait_settled(ctx, {name: ledger}, timeout)
        seconds = time.perf_counter() - started
        cpu, machine = cpu_of(pids) - cpu0 + cpu_of(pg_pids) - pg0, machine_cpu() - machine0
        busy = workers.busiest()
        if name == "conversion":  # its workers are the topology's own processes, not Dagster runs: their share
            busy = max([busy, *(cpu_of([p.proc.pid]) / (time.time() - psutil.Process(p.proc.pid).create_time())
                                for k, p in topology.processes.items() if k.startswith("conversion-worker"))])
        runs = FRONT_DOOR_WORKERS["conversion"] if name == "conversion" else instance.get_runs_count()
        total, left = chaos.progress(ctx, name)
        with engine.connect() as conn:
            duplicates = load.own_duplicates(conn, ctx) if load.own_duplicates else 0
    shutil.rmtree(home, ignore_errors=True)  # the PDFs and results of 10,000 jobs
    return Outcome(n, seconds, cpu, runs, left + max(0, n - total), n + duplicates, n, machine, busy)


def llm_answers(sandbox: SandboxClient) -> None:
    """The LLM route's answers: a critique for the criticizer, matching's own for its prompt."""
    from bench.chaos import MATCH_FIRST, MATCHING_PROMPT
    from bench.scale import CRITIQUE

    sandbox.set_default("llm", content=json.dumps(CRITIQUE))
    sandbox.set_default("llm", content=MATCH_FIRST, when=MATCHING_PROMPT)


def submit_at_the_front_door(name: str, engine: sa.Engine, sandbox: SandboxClient, session: str, defs: Any,
                             n: int) -> None:
    """`n` entities in as `run_front_door` submits them (the chaos run's loads), for a loop with no topology."""
    import random

    from bench import chaos

    ctx = chaos.Context(engine, sandbox, session, chaos.Canaries.from_seed(26), defs, random.Random(26))
    chaos.LOADS[name].submit(ctx, n, chaos.Ledger(name))


def deployed_part(pipelines: tuple[str, ...] = DEPLOYED_PIPELINES, n: int = DEPLOYED_ENTITIES) -> list[dict[str, Any]]:
    """Each drained pipeline through `make serve`'s topology (daemon, gRPC code server, run queue, run workers)
    against the issue's providers, with the limiter set for them: its entities/s at the route that binds it (middle
    60 %) against what that route allows, every route's peaks and refusals, lost work and duplicate effects."""
    from bench.scale import _DEFS, LOADS, run_deployed
    from bench._workload import migrated_database, postgres_pids
    from orchestration.definitions import build_definitions
    from redrive.settings import Settings

    cores = psutil.cpu_count() or 1
    env = {**{name: json.dumps(value) for name, value in PROVIDER_LIMITS.items()},
           "REDRIVE_DRAIN_IN_FLIGHT": json.dumps(DEPLOYED_IN_FLIGHT), "REDRIVE_DRAIN_RUNS": json.dumps(DEPLOYED_RUNS)}

    def providers(sandbox: SandboxClient) -> None:
        llm_answers(sandbox)
        for route, profile in PROVIDERS.items():
            latency = {"latency": profile["latency"]} if "latency" in profile else \
                {"p50": profile["p50"], "p99": profile["p99"]}
            sandbox.set_profile(route, **latency, max_concurrent=profile.get("max_concurrent"),
                                rate_per_second=profile.get("rate_per_second"), seed=26)

    print(f"\nthrough make serve's topology, {n} entities a pipeline, the issue's providers "
          f"({', '.join(f'{r}: {p}' for r, p in PROVIDERS.items())}); the limiter: {env}")
    rows = []
    for name in pipelines:
        session = uuid.uuid4().hex[:6]
        with migrated_database(f"bench_upstreams_deployed_{name}") as url:
            settings = Settings(database_url=url, redrive_time_scale=1.0)
            _DEFS.append(build_definitions(settings))
            if name in FRONT_DOORS:
                outcome = run_front_door(name, settings, n, session, postgres_pids(url), timeout=3600,
                                         upstreams=providers, env=env)
            else:
                outcome = run_deployed(LOADS[name], settings, n, session, postgres_pids(url), timeout=3600,
                                       upstreams=providers, env=env)
        sandbox = SandboxClient(os.environ["SANDBOX_URL"], timeout=30)
        route = BINDING[name]
        allowed = allowed_per_second(PROVIDERS[route])
        rate = steady_rate([datetime.fromisoformat(e["at"]) for e in sandbox.effects(EFFECT[route])])
        meters = sandbox.meters()
        busy = (outcome.machine_cpu_seconds or 0.0) / (outcome.seconds * cores)
        ratio = rate / allowed
        row = {"pipeline": name, "entities": n, "runs": outcome.runs, "lost": outcome.open_left,
               "duplicate_effects": outcome.effects - outcome.distinct_effects, "end_to_end_per_s": outcome.per_second,
               "binding_route": route, "entities_per_s": rate, "allowed_per_s": allowed, "ratio_to_allowed": ratio,
               "cores_busy": busy, "machine_cpu_ms_per_entity": 1000 * (outcome.machine_cpu_seconds or 0.0) / n,
               "refused_429": sum(m["limited"] for m in meters.values()),
               "routes": {r: {k: m[k] for k in ("admitted", "limited", "limited_by", "limited_after_a_stall",
                                                "peak_concurrency", "peak_rate_per_second")}
                          for r, m in meters.items() if m.get("admitted") or m.get("limited")},
               "sandbox_loop": sandbox.loop(),
               "run_worker_busy": outcome.run_worker_busy,
               "cap": deployed_cap(ratio, busy, "rate_per_second" in PROVIDERS[route], share=DEPLOYED_RATE_SHARE,
                                   run_busy=outcome.run_worker_busy or 0.0)}
        rows.append(row)
        print(f"  {name}: {n - outcome.open_left}/{n} settled in {outcome.seconds:.0f} s by {outcome.runs} "
              f"{'worker processes' if name == 'conversion' else 'runs'}; at "
              f"{route}: {rate:.1f} entities/s = {ratio:.2f} of the {allowed:.1f}/s it allows ({row['cap']}); "
              f"machine CPU {row['machine_cpu_ms_per_entity']:.1f} ms/entity, cores {busy:.0%} busy, the busiest "
              f"run's process {outcome.run_worker_busy or 0:.0%} of a core; refused "
              f"{row['refused_429']}; lost {row['lost']}, duplicate effects {row['duplicate_effects']}", flush=True)
        for r, m in row["routes"].items():
            why = f" {m['limited_by']}, {m['limited_after_a_stall']} within 1 s after a stall of the sandbox's own loop" \
                if m["limited"] else ""
            print(f"    {r}: {m['admitted']} admitted, {m['limited']} refused{why}, peak {m['peak_concurrency']} at "
                  f"once, {m['peak_rate_per_second']} in 1 s", flush=True)
        loop = row["sandbox_loop"]
        print(f"    the sandbox's own event loop (the provider's clock, on this machine's cores): {loop['stalls']} stalls "
              f"of 50 ms or more, {loop['stalls_over_100ms']} of 100 ms or more, the longest {loop['longest_stall_ms']} "
              f"ms; its garbage collector's pauses of 50 ms or more: {loop['collections_over_50ms']}, the longest "
              f"{loop['longest_collection_ms']} ms", flush=True)
    return rows


CPU_SIZES = tuple(int(n) for n in os.environ.get("BENCH_UPSTREAMS_CPU_SIZES", "2000,8000").split(",") if n)
CPU_ROUNDS = int(os.environ.get("BENCH_UPSTREAMS_CPU_ROUNDS", "2"))
# evidence's file jobs at every size of `--part cpu` (`BENCH_EVIDENCE_FILE_JOBS`): 200 rows each at 2,000, 800 at 8,000
EVIDENCE_CPU_FILE_JOBS = 10


def marginal_cost(cpu_seconds: dict[int, float]) -> tuple[float, float]:
    """Pure: (ms of CPU each more entity costs, CPU seconds a run costs whatever its size) from the CPU seconds
    measured at several sizes, by the least-squares line through them. With one size, all of it is per entity."""
    if len(cpu_seconds) < 2:
        (n, cpu), = cpu_seconds.items()
        return 1000 * cpu / n, 0.0
    slope, intercept = statistics.linear_regression(list(cpu_seconds), list(cpu_seconds.values()))
    return 1000 * slope, intercept


def _bare_criticizer(runtime: Any, resources: Any, session: str, n: int) -> None:
    """Each request's fetch → llm → notify and its own writes, one after another: no drain, no checkpoints."""
    from assets.criticizer import policy, repository

    http, llm = resources["criticizer_http"], resources["llm"]
    slack = http.results_channel() or runtime.channels.get("slack")
    for i in range(n):
        request_id = f"scale-{session}-{i}"
        with runtime.engine.begin() as conn:
            request = repository.start(conn, request_id, runtime.now())
        fetched = policy.fetched(http.fetch_artifact(request.artifact_url))
        messages = policy.critique_messages(request.rubric, request.artifact_url, fetched["text"])
        critiqued = policy.critiqued(llm.chat_json(messages, policy.Critique), messages)
        critique, sha = critiqued["critique"], critiqued["critique_sha256"]
        key = policy.idempotency_key(request_id, sha)
        status = http.post_webhook(request.webhook_url,
                                   policy.webhook_payload(request_id, request.artifact_url, critique, sha),
                                   {**request.delivery_headers(), "Idempotency-Key": key})
        with runtime.engine.begin() as conn:
            repository.record_delivery(conn, request_id, repository.WEBHOOK, key, status, runtime.now())
        if slack is not None:
            subject, text = policy.slack_message(request_id, critique)
            slack.send(subject, text, key)
            with runtime.engine.begin() as conn:
                repository.record_delivery(conn, request_id, repository.SLACK, key, None, runtime.now())
        with runtime.engine.begin() as conn:
            repository.complete(conn, request_id, critique, sha, runtime.now())


def _bare_review(runtime: Any, resources: Any, session: str, n: int) -> None:
    """Each job: in progress, send-and-mark its recipient (`Deliverer`, the pipeline's own), finalize."""
    from assets.review_notifications import api, delivery, policy, repository

    with resources["review_mail"].provider() as mail:
        deliverer = delivery.Deliverer(runtime.engine, mail, runtime, row_attempts=1)
        for i in range(n):
            with runtime.engine.begin() as conn:
                job = repository.job_by_key(conn, f"CL-{session}-{i}:v1")
                repository.set_job_status(conn, job.id, policy.IN_PROGRESS)
            delivery.raise_for_job(deliverer.deliver(job))
            with runtime.engine.begin() as conn:
                api.finalize(conn, job.id, runtime.now())


def _bare_evidence(runtime: Any, resources: Any, session: str, n: int) -> None:
    """The file jobs ingested (as the inbox's run does), then each row's attach under its lock, then the
    merchant's notification: `AttachWorker` and `NotificationSender`, the pipeline's own, with no drain."""
    from bench.scale import _evidence_direct
    from assets.evidence import repository as repo
    from assets.evidence import worker

    _evidence_direct(runtime.engine, None, session, n)  # type: ignore[arg-type]
    with runtime.engine.connect() as conn:
        rows = conn.execute(sa.select(repo.file_job_row.c.file_job_id, repo.file_job_row.c.id)
                            .order_by(repo.file_job_row.c.file_job_id, repo.file_job_row.c.line_no)).all()
    with resources["case_api"].session() as api, resources["merchant_mail"].session() as mail:
        attach = worker.AttachWorker(runtime, api, max_attempts=resources["evidence_options"].max_attempts)
        for job_id, row_id in rows:
            attach.process_row(job_id, row_id, mode="initial")
        sender = worker.NotificationSender(runtime, mail)
        for job_id in {job for job, _ in rows}:
            sender.send_pending(job_id)


def _bare_matching(runtime: Any, resources: Any, session: str, n: int) -> None:
    """Each batch as it is received, through 000's flow (`Worker.admit`, the pipeline's own: the batch marked and
    its candidates retrieved in one statement each), then each delivery (its LLM call, its write phase, its delete)
    one after another: no drain loop, no threads, no run, no Dagster. Its write phases commit one at a time, where
    the worker's group commit takes those that finish together in one transaction; so this loop is no floor, and
    its cost grows with a tenant's documents (70 ms an entity at 1,000, 161 ms at 4,000; the deployed 89 and 83).
    The deliveries are the worker's coroutines, awaited one at a time on one loop (one loop's LLM clients)."""
    import asyncio

    import dagster as dg

    from assets.matching.pipeline import build_worker
    from redrive import aio

    work = build_worker(dg.build_op_context(), resources["reliability"], resources["matching"], resources["llm"])
    work.log = logging.getLogger("assets.matching.worker")  # the process log: an op context would print every line
    queue, size = work.queue, resources["matching"].batch_size

    async def one_after_another() -> None:
        try:
            while messages := queue.receive(size, 0):
                for deliver in work.admit(messages):
                    await deliver()
        finally:
            await aio.close_loop_locals()

    asyncio.run(one_after_another())


BARE = {"criticizer": _bare_criticizer, "review_notifications": _bare_review, "evidence": _bare_evidence,
        "matching": _bare_matching}


def cpu_part(pipelines: tuple[str, ...] = DEPLOYED_PIPELINES, sizes: tuple[int, ...] = CPU_SIZES,
             rounds: int = CPU_ROUNDS) -> list[dict[str, Any]]:
    """On an instant upstream: each pipeline's machine CPU an entity (every process on the machine counted)
    through `make serve`'s topology, against a bare loop in this process doing the same upstream calls and the
    pipeline's own writes with no drain, no Dagster, no work queue. Rotated rounds; medians and their ratio, at
    each size; across sizes, what each more entity costs apart from what a run costs whatever its size."""
    instant = llm_answers

    # the drain runs and entities in flight `--part deployed` publishes, so this measures the deployment it does (no
    # provider limits: nothing limits an instant upstream)
    drain = {"REDRIVE_DRAIN_IN_FLIGHT": json.dumps(DEPLOYED_IN_FLIGHT), "REDRIVE_DRAIN_RUNS": json.dumps(DEPLOYED_RUNS)}

    # conversion's own loop is its worker: `python -m bench conversion` sets it against pgqueuer, procrastinate and a
    # pgbench ceiling doing the same claims and writes
    pipelines = tuple(p for p in pipelines if p in BARE)
    print(f"\nCPU an entity on an instant upstream: make serve's topology against a bare loop ({', '.join(pipelines)}), "
          f"{' and '.join(map(str, sizes))} entities, {rounds} rounds each")
    rows = []
    for name in pipelines:
        medians: dict[str, dict[int, float]] = {"deployed": {}, "bare": {}}  # CPU seconds, by size
        # evidence's run is per file job (its partition), so their number holds across sizes: a file job's run cost
        # then sits with the deployment's start in the cost whatever the size, and a row's is the line's slope
        file_jobs = int(os.environ.get("BENCH_EVIDENCE_FILE_JOBS") or EVIDENCE_CPU_FILE_JOBS)
        held = {"BENCH_EVIDENCE_FILE_JOBS": str(file_jobs)} if name == "evidence" else {}
        with exported(held):
            _measure_sizes(name, sizes, rounds, medians, drain, instant)
        (deployed, fixed), (bare, bare_fixed) = marginal_cost(medians["deployed"]), marginal_cost(medians["bare"])
        largest = max(sizes)
        whole = medians["deployed"][largest] / medians["bare"][largest]
        rows.append({"pipeline": name, "sizes": sizes, "deployed_cpu_ms": deployed, "bare_cpu_ms": bare,
                     "deployed_fixed_s": fixed, "bare_fixed_s": bare_fixed, "ratio": deployed / bare,
                     "whole_run_ratio": whole, "met": deployed <= 2 * bare})
        runs = f" ({file_jobs} file-job runs: {(fixed - bare_fixed) / file_jobs:.1f} CPU-s each more than the bare " \
               "loop's file job)" if held and len(sizes) > 1 else ""
        print(f"  {name}: each more entity costs {deployed:.1f} ms deployed, {bare:.1f} ms in the bare loop: "
              f"{deployed / bare:.2f}× (target ≤ 2×: {'met' if deployed <= 2 * bare else 'NOT met'}); a deployed "
              f"run costs {fixed:.1f} CPU-s whatever its size (the bare loop {bare_fixed:.1f}){runs}; the whole run "
              f"at {largest}: {whole:.2f}×", flush=True)
    return rows


def _measure_sizes(name: str, sizes: tuple[int, ...], rounds: int, medians: dict[str, dict[int, float]],
                   drain: dict[str, str], instant: Any) -> None:
    """`cpu_part`'s rotated rounds of one pipeline at each size: machine CPU seconds, medians into `medians`."""
    from bench.scale import _DEFS, LOADS, run_deployed
    from bench._workload import migrated_database, postgres_pids
    from orchestration.definitions import build_definitions
    from redrive.settings import Settings

    for n in sizes:
        taken: dict[str, list[float]] = {"deployed": [], "bare": []}
        for r in range(rounds):
            for how in (("bare", "deployed") if r % 2 == 0 else ("deployed", "bare")):
                session = uuid.uuid4().hex[:6]
                with migrated_database(f"bench_upstreams_cpu_{name}_{how}") as url:
                    settings = Settings(database_url=url, redrive_time_scale=1.0)
                    defs = build_definitions(settings)
                    _DEFS.append(defs)
                    if how == "deployed":
                        outcome = run_front_door(name, settings, n, session, postgres_pids(url), timeout=3600,
                                                 upstreams=instant, env={}) if name in FRONT_DOORS else \
                            run_deployed(LOADS[name], settings, n, session, postgres_pids(url), timeout=3600,
                                         upstreams=instant, env=drain)
                        cpu, wall, left = outcome.machine_cpu_seconds or 0.0, outcome.seconds, outcome.open_left
                    else:
                        sandbox = SandboxClient(os.environ["SANDBOX_URL"], timeout=30)
                        sandbox.reset()
                        instant(sandbox)
                        runtime = defs.resources["reliability"].runtime()
                        engine = engine_for(url)
                        cpu, started = machine_cpu(), time.perf_counter()
                        if name in FRONT_DOORS:  # in through the front door as `run_front_door` submits
                            submit_at_the_front_door(name, engine, sandbox, session, defs, n)
                        elif name != "evidence":  # evidence's file jobs are ingested by its loop
                            LOADS[name].submit(engine, sandbox, session, n)
                        BARE[name](runtime, defs.resources, session, n)
                        wall, cpu, left = time.perf_counter() - started, machine_cpu() - cpu, 0
                taken[how].append(cpu)
                print(f"  {name} {how:<8} {n} round {r + 1}: {1000 * cpu / n:6.1f} ms machine CPU an entity, "
                      f"{n / wall:6.1f} entities/s{f', {left} left open' if left else ''}", flush=True)
        for how in taken:
            medians[how][n] = statistics.median(taken[how])
        deployed, bare = 1000 * medians["deployed"][n] / n, 1000 * medians["bare"][n] / n
        print(f"  {name} at {n}: deployed {deployed:.1f} ms, bare loop {bare:.1f} ms an entity (medians): "
              f"{deployed / bare:.2f}× the bare loop", flush=True)


# fresh work runs out early in the outage, then only retries are due; sized for the drain's ~46 entities/s (at 1,500,
# sized for the 28/s before the rate reservations, too few were left after recovery to show a rate again)
OUTAGE_ENTITIES = int(os.environ.get("BENCH_UPSTREAMS_OUTAGE_ENTITIES", "2300"))
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
    # the budget's formula over the outage: 10 % of its calls plus the floor for each of its seconds, those with no
    # grant at all included (counting only the ledger's seconds left out the seconds every retry was deferred)
    allowed = BUDGET.retry_share * sent + BUDGET.retry_floor_per_second * (up_again - down).total_seconds()  # type: ignore[operator]
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
    parser.add_argument("--part", choices=["limiter", "in-flight", "drain", "scale-out", "deployed", "cpu", "outage", "all"], default="all")
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
    if args.part in ("scale-out", "all"):
        rows = scale_out_part()
        bad = [r for r in rows if r["done"] != r["entities"] or r["llm_calls"] != r["entities"]]
        if bad:
            print(f"FAILED: entities not done, or called twice: {bad}")
            return 1
    if args.part in ("deployed", "all"):
        rows = deployed_part()
        bad = [r for r in rows if r["refused_429"] or r["lost"] or r["duplicate_effects"]]
        if bad:
            print(f"FAILED: requests refused, work lost or effects duplicated: {bad}")
            return 1
    if args.part in ("cpu", "all"):
        cpu_part()
    if args.part in ("outage", "all") and not outage_part()["ok"]:
        print("FAILED: the outage's retries, recovery, outcome or alert (see above)")
        return 1
    return 0
