"""A real-time soak: every long-running process of `make serve` for an hour of steady traffic (issue 28).

    python -m bench live                                  # 10 min warm-up, then 60 min, about one entity a second
    python -m bench live --warmup 5 --minutes 20 --rate 2

`make serve`'s topology (devstack.topology: code server, webserver, daemon, conversion API, two conversion
workers, metrics endpoint, dead-letter console) runs on a scratch database in real time (no time scale). Each
minute the harness submits that minute's traffic through the pipelines' front doors, as bench.chaos does but
without faults: criticizer requests, review jobs, evidence ZIPs in the S3 inbox, PDFs through the conversion
API, matching documents through SQS; the daemon's sensors, drain runs and the conversion workers do the work.
Matchmaking is left out: its runs are daily partitions, not a stream.

Every minute it samples each service's long-running process (the one the service started): resident memory,
open files, threads and how many children it has alive (a code server's run workers come and go; a growing
number would be a leak), the database connections of the two databases (`pg_stat_activity`), and scrapes
`/metrics` once through the metrics service. The verdicts are the issue's: after the warm-up, each process's
resident memory grows at most 10 % (the median of the last ten samples against the median of the first ten
after the warm-up); open files and connections stay flat (the last ten samples' highest at most 10 % above, or
two above, the first ten's highest); and at the end every submitted entity is done or dead-lettered (0 lost).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import psutil
import sqlalchemy as sa

from bench import chaos
from bench._workload import deployment, migrated_database
from redrive.db import engine_for
from redrive.settings import Settings

IN_MAKE_BENCH = False  # an hour and more: run it by name

# entities a minute per pipeline at --rate 1 (about one a second in all); matching comes in orders of three
SHARES = {"criticizer": 0.25, "review_notifications": 0.15, "evidence": 0.25, "conversion": 0.2, "matching": 0.15}
WINDOW = 10  # samples (minutes) each verdict compares


@dataclass
class Sample:
    minute: float
    rss_mb: dict[str, float]
    fds: dict[str, int]
    threads: dict[str, int]
    children: dict[str, int]
    connections: int
    scrape_ms: float


@dataclass
class Series:
    samples: list[Sample] = field(default_factory=list)

    def of(self, metric: str, service: str | None = None) -> list[float]:
        out = []
        for s in self.samples:
            value = getattr(s, metric)
            out.append(float(value[service] if service is not None else value))
        return out


def grows_at_most(values: Sequence[float], warmup: int, ratio: float) -> tuple[float, bool]:
    """Pure: the median of the last WINDOW samples over the median of the first WINDOW after the warm-up."""
    after = list(values[warmup:])
    if len(after) < 2 * WINDOW:
        after = list(values)
    first, last = statistics.median(after[:WINDOW]), statistics.median(after[-WINDOW:])
    growth = last / first if first else 1.0
    return growth, growth <= ratio


def stays_flat(values: Sequence[float], warmup: int, share: float = 0.10, slack: float = 2) -> tuple[str, bool]:
    """Pure: the last WINDOW samples' highest against the first WINDOW's after the warm-up (10 % or 2 more)."""
    after = list(values[warmup:]) if len(values) - warmup >= 2 * WINDOW else list(values)
    first, last = max(after[:WINDOW]), max(after[-WINDOW:])
    return f"{first:g} → {last:g}", last <= max(first * (1 + share), first + slack)


def sample(topology: object, engine: sa.Engine, databases: list[str], minute: float) -> Sample:
    rss, fds, threads, children = {}, {}, {}, {}
    for name, process in topology.processes.items():  # type: ignore[attr-defined]
        try:
            leader = psutil.Process(process.proc.pid)
            with leader.oneshot():
                rss[name] = leader.memory_info().rss / 2**20
                fds[name] = leader.num_fds()
                threads[name] = leader.num_threads()
            children[name] = len(leader.children(recursive=True))
        except psutil.NoSuchProcess:
            rss[name], fds[name], threads[name], children[name] = 0.0, 0, 0, 0
    with engine.connect() as conn:
        connections = conn.execute(sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = ANY(:d)"),
                                   {"d": databases}).scalar_one()
    started = time.perf_counter()
    httpx.get(f"{topology.metrics_url}/metrics", timeout=30).raise_for_status()  # type: ignore[attr-defined]
    return Sample(minute, rss, fds, threads, children, int(connections) - 1,  # less the sampler's own
                  (time.perf_counter() - started) * 1000)


def submit_minute(ctx: chaos.Context, rate: float, minute: int, ledgers: dict[str, chaos.Ledger]) -> chaos.Context:
    """One minute's traffic; each minute's entities are named apart (the submit functions key them by session).
    Returns the minute's context (its session), by which its entities are found."""
    this = dataclasses.replace(ctx, session=f"{ctx.session}m{minute}")
    for name, share in SHARES.items():
        n = max(1, round(60 * rate * share))
        if name == "matching":
            n = max(3, n - n % 3)
        if name == "evidence":  # a ZIP of `rows` rows per file job, at least chaos's minimum of jobs
            n = max(n, chaos.EVIDENCE_MIN_JOBS)
        chaos.LOADS[name].submit(this, n, ledgers[name])
    return this


def settled(engine: sa.Engine) -> dict[str, tuple[int, int]]:
    """Per pipeline: (entities finished — done or dead-lettered —, entities still open), from the database."""
    with engine.connect() as conn:
        work = conn.execute(sa.text(
            "SELECT pipeline, count(*) FILTER (WHERE status IN ('done', 'dead')), "
            "count(*) FILTER (WHERE status NOT IN ('done', 'dead')) FROM work_items GROUP BY pipeline")).all()
        conversion = conn.execute(sa.text(
            "SELECT count(*) FILTER (WHERE status IN ('succeeded', 'failed')), "
            "count(*) FILTER (WHERE status NOT IN ('succeeded', 'failed')) FROM conversion_jobs")).one()
        matching = conn.execute(sa.text(
            "SELECT count(*) FILTER (WHERE matching_status IN ('succeeded', 'failed')), "
            "count(*) FILTER (WHERE matching_status IS DISTINCT FROM 'succeeded' "
            "AND matching_status IS DISTINCT FROM 'failed') FROM document")).one()
    out = {r[0]: (int(r[1]), int(r[2])) for r in work}
    out["conversion"] = (int(conversion[0]), int(conversion[1]))
    out["matching"] = (int(matching[0]), int(matching[1]))
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench live")
    parser.add_argument("--warmup", type=float, default=10.0, help="minutes before the verdicts' first sample")
    parser.add_argument("--minutes", type=float, default=60.0, help="minutes measured after the warm-up")
    parser.add_argument("--rate", type=float, default=1.0, help="entities a second across the pipelines")
    parser.add_argument("--settle", type=float, default=15.0, help="minutes to wait for the last traffic")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from devstack.postgres import create_database, drop_database, with_database
    from devstack.sandbox import SandboxClient
    from devstack.topology import SERVICES
    from orchestration.definitions import build_definitions
    from redrive.db import normalize_url

    args = parse(list(argv or []))
    session = uuid.uuid4().hex[:6]
    total = args.warmup + args.minutes
    print(f"  live soak: {args.warmup:g} min warm-up + {args.minutes:g} min, {args.rate:g} entities/s, every "
          f"service of make serve; load before {os.getloadavg()[0]:.2f}", flush=True)
    with migrated_database(f"live_{session}") as url:
        settings = Settings(database_url=url, redrive_time_scale=1.0)
        defs = build_definitions(settings)
        engine = engine_for(url)
        sandbox = SandboxClient(os.environ["SANDBOX_URL"])
        sandbox.reset()
        ctx = chaos.Context(engine, sandbox, session, chaos.Canaries.from_seed(0), defs, random.Random(0))
        admin = with_database(url, "postgres")
        create_database(admin, f"live_{session}_dagster")
        dagster_url = normalize_url(with_database(admin, f"live_{session}_dagster"))
        home = settings.redrive_data_dir / "live" / session
        env = {"UPLOADS_DIR": str(home / "uploads"), "RESULTS_DIR": str(home / "results"),
               "DAGSTER_PG_URL": dagster_url, "MATCHING_SENSOR_INTERVAL_SECONDS": "5"}
        ledgers = {name: chaos.Ledger(name) for name in SHARES}
        ctx.ledgers = ledgers
        series = Series()
        try:
            with deployment(settings, home, only=tuple(s.name for s in SERVICES), workers=2, env=env) as topology:
                ctx.topology = topology
                started = time.monotonic()
                minute = 0
                while (elapsed := (time.monotonic() - started) / 60) < total:
                    submit_minute(ctx, args.rate, minute, ledgers)
                    series.samples.append(sample(topology, engine, [f"live_{session}", f"live_{session}_dagster"],
                                                 elapsed))
                    if minute % 10 == 0:
                        print(f"  minute {elapsed:5.1f}: rss MB "
                              + ", ".join(f"{k} {v:.0f}" for k, v in series.samples[-1].rss_mb.items())
                              + f"; connections {series.samples[-1].connections}; finished/open "
                              + ", ".join(f"{k} {d}/{o}" for k, (d, o) in settled(engine).items()), flush=True)
                    minute += 1
                    time.sleep(max(0.0, started + minute * 60 - time.monotonic()))  # the next minute's traffic
                deadline = time.monotonic() + args.settle * 60
                while time.monotonic() < deadline:
                    state = settled(engine)
                    if all(state.get(n, (0, 0))[0] >= ledgers[n].expected and state.get(n, (0, 1))[1] == 0
                           for n in SHARES):
                        break
                    time.sleep(5.0)  # polling the deployment's progress; not a timing assertion
                state = settled(engine)
                exited = topology.exited()
        finally:
            engine.dispose()
            drop_database(admin, f"live_{session}_dagster")
    return report(series, ledgers, state, exited, warmup=int(args.warmup))


def report(series: Series, ledgers: dict[str, chaos.Ledger], state: dict[str, tuple[int, int]],
           exited: dict[str, int], warmup: int) -> int:
    ok = not exited
    services = list(series.samples[0].rss_mb)
    print(f"\n  {len(series.samples)} samples, one a minute; verdicts compare the first and last {WINDOW} after "
          f"the {warmup}-minute warm-up")
    print(f"  {'service':<18} {'rss MB (warm → end)':>22} {'growth':>7} {'open files':>12} {'threads':>10} "
          f"{'children max':>12}")
    for name in services:
        rss = series.of("rss_mb", name)
        growth, grew_ok = grows_at_most(rss, warmup, 1.10)
        files, files_ok = stays_flat(series.of("fds", name), warmup)
        threads, _ = stays_flat(series.of("threads", name), warmup)
        after = rss[warmup:] or rss
        print(f"  {name:<18} {statistics.median(after[:WINDOW]):>10.1f} → {statistics.median(after[-WINDOW:]):>8.1f} "
              f"{growth:>7.3f} {files:>12} {threads:>10} {max(series.of('children', name)):>12.0f}"
              f"{'' if grew_ok and files_ok else '   ✗'}")
        ok = ok and grew_ok and files_ok
    connections, connections_ok = stays_flat(series.of("connections"), warmup)
    scrape = series.of("scrape_ms")
    print(f"  database connections (both databases): {connections} {'ok' if connections_ok else '✗'}")
    print(f"  /metrics scrape: first {statistics.median(scrape[warmup:][:WINDOW] or scrape):.1f} ms, "
          f"last {statistics.median(scrape[-WINDOW:]):.1f} ms (median of {WINDOW})")
    ok = ok and connections_ok
    for name, ledger in ledgers.items():
        finished, still_open = state.get(name, (0, 0))
        lost = max(0, ledger.expected - finished - still_open)  # submitted, and neither finished nor waiting
        print(f"  {name:<20} submitted {ledger.expected:>6}, finished {finished:>6}, still open {still_open:>4}, "
              f"lost {lost}")
        ok = ok and lost == 0 and still_open == 0
    if exited:
        print(f"  services that died: {exited}")
    print(f"  verdict: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

