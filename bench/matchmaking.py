"""Benchmark: one matchmaking partition end to end (claim, score, select, write) at 100,000 users.

    .venv/bin/python -m bench.matchmaking                    # 10k, 30k, 100k users + a 2,000-user baseline
    .venv/bin/python -m bench.matchmaking --sizes 5000 --baseline 500     # quick

Each size is one (date, timezone) partition of synthetic users in metro regions of ~2,000 users
(the candidate pool of a user is their region), run by the same `PartitionRun` the asset uses,
against PostgreSQL. Wall and CPU time (this process: load, score, build rows; PostgreSQL's own work
shows in wall time only) come from a first run; peak memory from a second run of the same
partition (jobs deleted in between) under tracemalloc, which sees NumPy's buffers as well as
Python objects. The baseline is the ADR written as a straightforward per-user loop — claim, a
candidate query, Python scoring, an insert and an update per user — on a smaller pool with the
same region size, measured in the same session; its offers must equal the vectorized run's.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc
from datetime import date

import sqlalchemy as sa

from assets.matchmaking import batch, policy, repository, synthetic
from assets.matchmaking.batch import Knobs, PartitionRun
from assets.matchmaking.policy import BUILTIN_WEIGHTS, Partition
from redrive.reliability import Reliability

DAY = date(2026, 3, 8)
REGION_SIZE = 2000
ZONES = ["America/New_York", "Europe/Berlin", "Asia/Kolkata", "Asia/Tokyo", "Europe/London", "America/Chicago"]


def bench_database():
    """A fresh database with the matchmaking branch migrated (see bench._support)."""
    from bench._support import scratch_database

    return scratch_database("redrive_bench_matchmaking", heads="matchmaking@head")


def populate(engine: sa.Engine, n: int, timezone: str) -> None:
    rows = synthetic.users(n, timezone=timezone, tag=f"bench-{timezone}", regions=max(1, n // REGION_SIZE))
    with engine.begin() as conn:
        synthetic.insert(conn, rows, batch=10_000)


def reset(engine: sa.Engine, partition: Partition) -> None:
    with engine.begin() as conn:
        jobs = repository.matchmaking_jobs
        conn.execute(sa.delete(jobs).where(jobs.c.timezone == partition.timezone))  # offers go with them


def vectorized(engine: sa.Engine, partition: Partition, knobs: Knobs) -> tuple[float, float, batch.Outcome]:
    """(wall seconds, this process's CPU seconds, outcome) of one partition run."""
    runtime = Reliability(engine=engine)
    started, cpu = time.perf_counter(), time.process_time()
    pool = batch.load_pool(engine, partition)
    outcome = PartitionRun(runtime, partition, knobs, BUILTIN_WEIGHTS).run(pool)
    return time.perf_counter() - started, time.process_time() - cpu, outcome


def traced_peak(engine: sa.Engine, partition: Partition, knobs: Knobs) -> float:
    reset(engine, partition)
    tracemalloc.start()
    try:
        vectorized(engine, partition, knobs)
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


_CANDIDATES_SQL = sa.text("""
    SELECT c.id::text FROM matchmaking_users c, matchmaking_users u
     WHERE u.id = :u AND c.timezone = u.timezone AND c.region = u.region AND c.active AND c.id <> u.id
       AND c.gender = ANY(u.seeking) AND u.gender = ANY(c.seeking)
       AND date_part('year', age(CAST(:day AS date), c.birth_date)) BETWEEN u.age_min AND u.age_max
       AND date_part('year', age(CAST(:day AS date), u.birth_date)) BETWEEN c.age_min AND c.age_max
""")


def per_user_loop(engine: sa.Engine, partition: Partition, knobs: Knobs) -> float:
    """ADR-0004 as written, one user at a time: claim, getEligibleCandidates, score, select, insert, complete."""
    started = time.perf_counter()
    pool = batch.load_pool(engine, partition)  # features for the Python scorer (the ADR's computeCompatibility)
    index = pool.index()
    day_key = policy.date_key(knobs.seed, partition.date)
    offered_at, expires_at = partition.offer_window(knobs.offer_hour)
    for u in range(len(pool)):
        user_id = str(pool.ids[u])
        with engine.begin() as conn:
            if not repository.claim(conn, partition.date, partition.timezone, [user_id]):
                continue
        with engine.connect() as conn:
            candidates = [index[c] for (c,) in conn.execute(_CANDIDATES_SQL, {"u": user_id, "day": partition.date})]
        scored = []
        for c in candidates:
            s = policy.reference_pair_score(pool, u, c, day_key=day_key, weights=BUILTIN_WEIGHTS)
            if s is not None:
                scored.append((c, s))
        selected = policy.select_top(pool, scored, knobs.daily_offer_count)
        rows = [policy.OfferRow(policy.offer_id(partition.date, user_id, str(pool.ids[c])), user_id, str(pool.ids[c]),
                                rank, s / policy.SCORE_SCALE) for c, rank, s in selected]
        with engine.begin() as conn:
            repository.complete(conn, partition.date, partition.timezone, {user_id: rows},
                                {user_id: policy.offers_document(rows)},
                                algorithm_version=BUILTIN_WEIGHTS.algorithm_version, offered_at=offered_at,
                                expires_at=expires_at)
    return time.perf_counter() - started


def offer_rows(engine: sa.Engine, partition: Partition) -> list[tuple]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(
            "SELECT id, user_id, candidate_id, rank, compatibility_score, offered_at, expires_at "
            "FROM matchmaking_offers WHERE timezone = :tz ORDER BY id"), {"tz": partition.timezone})]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,30000,100000", help="users per partition, comma-separated")
    parser.add_argument("--baseline", type=int, default=2000, help="users in the per-user baseline's partition")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if len(sizes) + 1 > len(ZONES):
        parser.error(f"at most {len(ZONES) - 1} sizes")
    knobs = Knobs()

    from redrive.db import engine_for

    with bench_database() as url:
        engine = engine_for(url)
        print(f"matchmaking benchmark: one partition end to end (claim, score, select, write); "
              f"regions of ~{REGION_SIZE:,} users, {knobs.daily_offer_count} offers per user, "
              f"chunks of {knobs.chunk_size:,}", flush=True)
        base_zone, zones = ZONES[0], ZONES[1:]
        base = Partition(DAY, base_zone)
        populate(engine, args.baseline, base_zone)
        loop_seconds = per_user_loop(engine, base, knobs)
        loop_rows = offer_rows(engine, base)
        reset(engine, base)
        check_seconds, _, _ = vectorized(engine, base, knobs)
        same = offer_rows(engine, base) == loop_rows

        results = []
        for n, zone in zip(sizes, zones, strict=False):
            partition = Partition(DAY, zone)
            populate(engine, n, zone)
            seconds, cpu, outcome = vectorized(engine, partition, knobs)
            assert outcome.completed == n and not outcome.failed, outcome.metadata()
            peak = traced_peak(engine, partition, knobs)
            results.append((n, max(1, n // REGION_SIZE), seconds, cpu, peak, outcome.offers_written))

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\n{'users':>9} {'regions':>8} {'wall s':>8} {'users/s':>9} {'µs/user':>8} {'py cpu s':>9} "
          f"{'peak MiB':>9} {'offers':>9}")
    for n, regions, seconds, cpu, peak, written in results:
        print(f"{n:>9,} {regions:>8} {seconds:>8.2f} {n / seconds:>9,.0f} {seconds / n * 1e6:>8.0f} {cpu:>9.2f} "
              f"{peak:>9.1f} {written:>9,}")
    loop_rate = args.baseline / loop_seconds
    print(f"\nbaseline, per-user loop: {args.baseline:,} users in {loop_seconds:.2f} s = {loop_rate:,.0f} users/s "
          f"(vectorized on the same pool: {check_seconds:.2f} s; identical offers: {'yes' if same else 'NO'})")
    for n, _, seconds, _, _, _ in results:
        print(f"speed-up at {n:,} users: {n / seconds / loop_rate:,.1f}× the per-user loop's throughput")
    if len(results) > 1:
        (n0, _, s0, c0, _, _), (n1, _, s1, c1, _, _) = results[0], results[-1]
        print(f"growth: {n1 / n0:.1f}× the users took {s1 / s0:.1f}× the wall time, {c1 / c0:.1f}× the CPU time of "
              f"this process (PostgreSQL's work is in the wall time only)")
    print(f"process peak RSS: {rss:,.0f} MiB (interpreter, libraries and both runs)")
    return 0 if same else 1


if __name__ == "__main__":
    from devstack.stack import local_stack

    with local_stack("bench", migrate=False):
        sys.exit(main())
