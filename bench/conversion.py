"""Conversion claim-and-complete throughput: the worker with 1, 2 and 4 processes against pgbench's ceiling.

    python -m bench conversion                                   # under the bench stack (make bench runs all)
    BENCH_CONVERSION_JOBS=500 python -m bench.conversion         # smaller, standalone

The gateway answers at once (an in-process instant converter), so what is measured is the worker's
whole per-job path: breaker check, the SKIP LOCKED claim, reading the source, recording the call in
the breaker's window, staging the XML, the fenced completion and the atomic publish. The baseline,
in the same session on the same database and the same rows, is pgbench running the *very same*
claim and complete SQL (`repository.CLAIM_SQL`, `repository.COMPLETE_SQL`) with as many clients —
the ceiling for this schema and server. The ratio is how much of that ceiling the worker keeps.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from assets.conversion import repository as repo
from assets.conversion.files import FileStore
from assets.conversion.settings import ConversionSettings
from bench._support import scratch_database
from redrive.db import engine_for

BENCH_DB = "redrive_bench_conversion"
JOBS = int(os.environ.get("BENCH_CONVERSION_JOBS", "2000"))
WORKERS = tuple(int(w) for w in os.environ.get("BENCH_CONVERSION_WORKERS", "1,2,4").split(","))
ROUNDS = int(os.environ.get("BENCH_CONVERSION_ROUNDS", "3"))  # interleaved; medians damp a shared machine's noise
XML = b'<document sha256="bench" bytes="0"><page n="1">instant</page></document>'
PDF = b"%PDF-1.4\n4 0 obj << /Length 20 >> stream\nBT (bench) Tj ET\nendstream endobj\n%%EOF\n"


class InstantGateway:
    """A converter that answers at once: the benchmark measures our path, not a converter's."""

    def convert(self, pdf: bytes) -> bytes:
        return XML

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        pass


def _child(url: str, uploads: str, results: str, name: str, ready: Any, go: Any, done: Any) -> None:
    import logging

    from assets.conversion.worker import JsonLog, Shutdown, Worker
    from redrive.reliability import Reliability

    logging.getLogger("redrive.conversion.worker").setLevel(logging.ERROR)  # one JSON line per job is the log, not the load
    settings = ConversionSettings(uploads_dir=Path(uploads), results_dir=Path(results), worker_idle_sleep_sec=0.02)
    worker = Worker(Reliability(engine_for(url)), InstantGateway(), FileStore(Path(uploads), Path(results)), settings,
                    worker_id=name, shutdown=Shutdown(0), log=JsonLog(name))
    worker.engine.connect().close()  # warm the pool before the clock starts
    ready.release()
    go.wait()
    report = worker.run(until_idle=0.3)
    done.put(report.as_dict())


def _reset(engine: sa.Engine, results: Path) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE conversion_job_events, circuit_breaker_calls"))
        conn.execute(sa.text("DELETE FROM circuit_breakers"))
        conn.execute(sa.text(
            "UPDATE conversion_jobs SET status = 'queued', attempt_count = 0, lease_epoch = 0, leased_by = NULL, "
            "lease_expires_at = NULL, result_location = NULL, completed_at = NULL, started_at = NULL, "
            "last_attempt_at = NULL, retry_after = NULL"))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE conversion_jobs"))
        conn.execute(sa.text("VACUUM ANALYZE conversion_job_events"))
    for p in results.iterdir():
        p.unlink()


def _succeeded(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM conversion_jobs WHERE status = 'succeeded'")).scalar())


def worker_rate(url: str, engine: sa.Engine, uploads: Path, results: Path, n: int) -> float:
    """Jobs per second with ``n`` worker processes, from the start signal to the last completion."""
    _reset(engine, results)
    ctx = mp.get_context("spawn")
    ready, go, done = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(url, str(uploads), str(results), f"bench-{i}", ready, go, done))
             for i in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.acquire()
    started = time.perf_counter()
    go.set()
    while _succeeded(engine) < JOBS:
        time.sleep(0.02)
    elapsed = time.perf_counter() - started
    reports = [done.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sum(r["succeeded"] for r in reports) == JOBS, reports
    assert sorted(p.name for p in results.iterdir()) == sorted(f"{i}.xml" for i in _ids(engine))
    return JOBS / elapsed


def _ids(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return [str(i) for i in conn.execute(sa.text("SELECT id FROM conversion_jobs")).scalars()]


def pgbench_script() -> str:
    """The repository's claim and complete statements, as pgbench runs them (bind values → SQL; ids via \\gset)."""
    def as_pgbench(sql: str) -> str:
        return (sql.replace(":lease_expires_at", "now() + interval '90 seconds'").replace(":now", "now()")
                .replace(":worker", "'pgbench'").replace(":result_location", "'pgbench.xml'")
                .replace(":meta", "'{}'").replace(":breaker", "'pdf-gateway'"))

    return f"{as_pgbench(repo.CLAIM_SQL)} \\gset\n{as_pgbench(repo.COMPLETE_SQL)};\n"


def _pgbench_binary() -> str:
    embedded = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages" / "pgserver" / "pginstall" / "bin" / "pgbench"
    found = str(embedded) if embedded.exists() else shutil.which("pgbench")
    if not found:
        raise SystemExit("pgbench not found (the embedded server ships one; Debian: postgresql-client)")
    return found


def pgbench_rate(url: str, engine: sa.Engine, results: Path, n: int, script: Path) -> float:
    """Claim+complete transactions per second from pgbench with ``n`` clients over the same rows."""
    _reset(engine, results)
    parsed = sa.engine.make_url(url)
    host = parsed.query.get("host") or parsed.host or "localhost"
    args = [_pgbench_binary(), "-n", "-M", "extended", "-c", str(n), "-j", str(n), "-t", str(JOBS // n),
            "-f", str(script), "-h", str(host), "-U", parsed.username or "postgres"]
    if parsed.port:
        args += ["-p", str(parsed.port)]
    env = {**os.environ, **({"PGPASSWORD": parsed.password} if parsed.password else {})}
    out = subprocess.run([*args, parsed.database or ""], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise SystemExit(f"pgbench failed: {out.stderr.strip().splitlines()[-1:]}")
    tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    assert tps, out.stdout
    assert _succeeded(engine) == (JOBS // n) * n
    return float(tps.group(1))


def run(url: str) -> list[tuple[int, float, float]]:
    engine = engine_for(url)
    folder = Path(tempfile.mkdtemp(prefix="bench-conversion-"))
    files = FileStore(folder / "uploads", folder / "results")
    rows = []
    for i in range(JOBS):
        job_id = str(uuid.uuid4())
        rows.append({"id": job_id, "owner": "bench", "filename": f"{i}.pdf",
                     "source_location": files.save_source(job_id, PDF), "source_bytes": len(PDF),
                     "source_sha256": "bench"})
    with engine.begin() as conn:
        conn.execute(sa.insert(repo.conversion_jobs), rows)
    script = folder / "claim_complete.sql"
    script.write_text(pgbench_script())
    samples: dict[int, tuple[list[float], list[float]]] = {n: ([], []) for n in WORKERS}
    try:
        for _ in range(ROUNDS):
            for n in WORKERS:
                samples[n][0].append(worker_rate(url, engine, files.uploads, files.results, n))
                samples[n][1].append(pgbench_rate(url, engine, files.results, n, script))
        figures = [(n, statistics.median(ours), statistics.median(ceiling)) for n, (ours, ceiling) in samples.items()]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return figures


def main() -> int:
    with scratch_database(BENCH_DB) as url:
        figures = run(url)
    print(f"conversion: claim-and-complete throughput, {JOBS} jobs, instant gateway, median of {ROUNDS} rounds "
          f"(baseline: pgbench running the same claim + complete SQL on the same database)")
    print(f"  {'workers':>7}  {'worker jobs/s':>13}  {'pgbench jobs/s':>14}  {'ratio':>6}")
    for n, ours, ceiling in figures:
        print(f"  {n:>7}  {ours:>13.0f}  {ceiling:>14.0f}  {ours / ceiling:>6.2f}")
    return 0


if __name__ == "__main__":
    from devstack.stack import local_stack

    with local_stack("bench", migrate=False):
        sys.exit(main())
