"""Conversion worker throughput side by side with procrastinate, pgqueuer and pgbench's minimal ceiling (issue 14).

    python -m bench conversion                                   # under the bench stack (make bench runs all)
    BENCH_CONVERSION_JOBS=500 python -m bench.conversion         # smaller, standalone
    BENCH_CONVERSION_WORKERS=4 BENCH_CONVERSION_GATEWAY_JOBS=0 python -m bench.conversion   # 4 workers, no 200 ms case

Needs the ``bench`` extra (``pip install -e ".[bench]"``: procrastinate, pgqueuer, asyncpg, psycopg).
Every contender burns down the same number of jobs on the same embedded server, in the same database,
interleaved round by round (medians of BENCH_CONVERSION_ROUNDS, so a shared machine's noise hits all alike),
each released right after ``sync`` and a ``CHECKPOINT`` (no contender pays for the one before it):

- **redrive/c**: the conversion worker as ``n`` processes with WORKER_CONCURRENCY=c jobs in flight each (a row
  for each c of BENCH_CONVERSION_CONCURRENCY, default 16 and 64) and a gateway that answers at once. It still
  does its whole per-job path: the fenced lease, reading the source, the breaker's call record, the XML staged
  and made durable (RESULTS_SYNC, default ``turn``: one syncfs a turn), the fenced completion, the atomic publish.
- **redrive/c/file**: the same at the largest c with RESULTS_SYNC=file (an fsync per result), for comparison.
- **procrastinate** 3.x: ``n`` worker processes (its default concurrency 1), a no-op async task.
- **pgqueuer** 1.x: ``n`` QueueManager processes, default batch size (10), drain mode, a no-op entrypoint.
- **pgbench minimal**: ``n`` clients running the least a SKIP LOCKED queue can do per job (claim one row,
  mark it done, each its own transaction) on a two-column table: the ceiling for this server.

The 200 ms case puts a delaying HTTP server (an asyncio process of its own) in front of both: one redrive
process with WORKER_CONCURRENCY=32 against pgqueuer in one async process holding 32 jobs at most in flight,
and beside them the server's own ceiling: a plain client, 32 threads on one httpx pool, no queue at all.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from assets.conversion import repository as repo
from assets.conversion.files import FileStore
from assets.conversion.settings import ConversionSettings, file_store
from bench._support import machine_cpu, scratch_database
from redrive.db import engine_for

BENCH_DB = "redrive_bench_conversion"
JOBS = int(os.environ.get("BENCH_CONVERSION_JOBS", "1000"))
GATEWAY_JOBS = int(os.environ.get("BENCH_CONVERSION_GATEWAY_JOBS", "640"))
WORKERS = tuple(int(w) for w in os.environ.get("BENCH_CONVERSION_WORKERS", "1,2,4").split(","))
ROUNDS = int(os.environ.get("BENCH_CONVERSION_ROUNDS", "3"))
# redrive's WORKER_CONCURRENCY in the no-op case: a row each (pgqueuer fetches 10 at a time, no cap on tasks in flight)
CONCURRENCIES = tuple(int(c) for c in os.environ.get("BENCH_CONVERSION_CONCURRENCY", "16,64").split(","))
CONCURRENCY = CONCURRENCIES[0]
GATEWAY_DELAY = 0.2
GATEWAY_IN_FLIGHT = 32
XML = b'<document sha256="bench" bytes="0"><page n="1">instant</page></document>'
PDF = b"%PDF-1.4\n4 0 obj << /Length 20 >> stream\nBT (bench) Tj ET\nendstream endobj\n%%EOF\n"
PER_FILE = f"redrive/{max(CONCURRENCIES)}/file"  # the same worker with RESULTS_SYNC=file: an fsync per result
REDRIVE = (*(f"redrive/{c}" for c in CONCURRENCIES), PER_FILE)
CONTENDERS = (*REDRIVE, "procrastinate", "pgqueuer", "pgbench", "files")


class InstantGateway:
    """A converter that answers at once: the benchmark measures the queue's path, not a converter's."""

    def convert(self, pdf: bytes) -> bytes:
        return XML

    def healthy(self) -> bool:
        return True

    def close(self) -> None:
        pass


def _delaying_gateway(delay: float, port: Any, stop: Any) -> None:
    """The 200 ms converter's process: asyncio, keep-alive, a listen backlog for every connection at once.

    Its own process, so it neither shares a GIL with the bench's polling nor with a contender; a few
    tens of microseconds of Python per call, so at 32 in flight the wait is the 200 ms and not the server.
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
                await reader.readexactly(int(length.group(1)) if length else 0)
                await asyncio.sleep(delay)
                writer.write(ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
        port.send(server.sockets[0].getsockname()[1])
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        server.close()

    asyncio.run(main())


ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: application/xml\r\nContent-Length: " + str(len(XML)).encode()
          + b"\r\n\r\n" + XML)


class DelayingGateway:
    """A local HTTP converter that answers every POST after ``delay`` seconds, in a process of its own.

    (The sandbox can hold a call and then fail it, never hold it and then succeed, so the 200 ms case
    brings its own converter; :func:`gateway_ceiling` measures what it can serve.)
    """

    def __init__(self, delay: float) -> None:
        ctx = mp.get_context("spawn")
        receive, send = ctx.Pipe(duplex=False)
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_delaying_gateway, args=(delay, send, self._stop), daemon=True)
        self._proc.start()
        if not receive.poll(60):
            raise SystemExit("the delaying gateway did not start")
        self.port = receive.recv()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop.set()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()


def _plain_client_child(gateway_url: str, in_flight: int, jobs: int, out: Any, ready: Any, go: Any) -> None:
    """``in_flight`` threads sharing one httpx client (pool as large), POSTing ``jobs`` calls: no queue at all."""
    import httpx

    client = httpx.Client(timeout=10.0, limits=httpx.Limits(max_connections=in_flight,
                                                            max_keepalive_connections=in_flight))
    left = iter(range(jobs))
    lock = threading.Lock()

    def call() -> None:
        while True:
            with lock:
                if next(left, None) is None:
                    return
            client.post(f"{gateway_url}/convert", content=PDF).raise_for_status()

    client.post(f"{gateway_url}/convert", content=PDF).raise_for_status()  # connect before the clock starts
    threads = [threading.Thread(target=call) for _ in range(in_flight)]
    ready.release()
    go.wait()
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.send(jobs / (time.perf_counter() - started))


def gateway_ceiling(url: str, in_flight: int = GATEWAY_IN_FLIGHT, jobs: int = GATEWAY_JOBS) -> float:
    """What the delaying gateway serves to a plain client with ``in_flight`` calls at once: the 200 ms case's
    honest ceiling on this machine now (the ideal is ``in_flight / delay``)."""
    ctx = mp.get_context("spawn")
    ready, go = ctx.Semaphore(0), ctx.Event()
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_plain_client_child, args=(url, in_flight, jobs, send, ready, go))
    proc.start()
    if not ready.acquire(timeout=120):
        raise SystemExit("the plain client did not start")
    go.set()
    if not receive.poll(300):
        raise SystemExit("the plain client did not finish")
    rate = float(receive.recv())
    proc.join(timeout=30)
    return rate


# ------------------------------------------------------------------------------------------- connection


def _parts(url: str) -> dict[str, Any]:
    parsed = sa.engine.make_url(url)
    return {"host": parsed.query.get("host") or parsed.host or "localhost", "port": parsed.port or 5432,
            "user": parsed.username or "postgres", "password": parsed.password, "database": parsed.database}


def _conninfo(url: str) -> str:
    p = _parts(url)
    info = f"host={p['host']} port={p['port']} dbname={p['database']} user={p['user']}"
    return info + (f" password={p['password']}" if p["password"] else "")


# ---------------------------------------------------------------------------------------------- redrive


def _redrive_child(url: str, uploads: str, results: str, name: str, concurrency: int, gateway_url: str | None,
                   sync: str | None, ready: Any, go: Any) -> None:
    import logging

    from assets.conversion.worker import JsonLog, Shutdown, Worker
    from redrive.reliability import Reliability
    from resources.conversion import HttpGateway

    logging.getLogger("redrive.conversion.worker").setLevel(logging.ERROR)  # the log is not the load
    settings = ConversionSettings(uploads_dir=Path(uploads), results_dir=Path(results), worker_idle_sleep_sec=0.02,
                                  worker_concurrency=concurrency, **({"results_sync": sync} if sync else {}))
    gateway = HttpGateway(gateway_url, 10.0, in_flight=concurrency) if gateway_url else InstantGateway()
    worker = Worker(Reliability(engine_for(url)), gateway, file_store(settings), settings,
                    worker_id=name, shutdown=Shutdown(0), log=JsonLog(name))
    worker.engine.connect().close()  # warm the pool before the clock starts
    ready.release()
    go.wait()
    worker.run(until_idle=0.3)


def redrive_rate(ctx: Bench, n: int, *, concurrency: int = CONCURRENCY, gateway_url: str | None = None,
                 jobs: int = JOBS, sync: str | None = None) -> float:
    ctx.reset_redrive(jobs)
    return ctx.timed(n, _redrive_child, lambda i: (ctx.url, str(ctx.files.uploads), str(ctx.files.results),
                                                   f"bench-{i}", concurrency, gateway_url, sync),
                     "SELECT count(*) FROM conversion_jobs WHERE status = 'succeeded'", jobs)


# ---------------------------------------------------------------------------------------- procrastinate


def _procrastinate_app(conninfo: str) -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=conninfo))

    @app.task(name="noop", queue="bench")
    async def noop() -> None:
        return None

    return app


def _procrastinate_child(conninfo: str, ready: Any, go: Any) -> None:
    app = _procrastinate_app(conninfo)

    async def main() -> None:
        async with app.open_async():
            ready.release()
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            await app.run_worker_async(queues=["bench"], wait=False, concurrency=1, install_signal_handlers=False)

    asyncio.run(main())


def procrastinate_rate(ctx: Bench, n: int) -> float:
    app = _procrastinate_app(_conninfo(ctx.url))

    async def enqueue() -> None:
        async with app.open_async():
            await app.tasks["noop"].batch_defer_async(*[{} for _ in range(JOBS)])

    ctx.sql("TRUNCATE procrastinate_jobs, procrastinate_events CASCADE")
    asyncio.run(enqueue())
    ctx.vacuum("procrastinate_jobs")
    return ctx.timed(n, _procrastinate_child, lambda i: (_conninfo(ctx.url),),
                     "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'", JOBS)


# --------------------------------------------------------------------------------------------- pgqueuer


def _pgqueuer_child(parts: dict[str, Any], gateway_url: str | None, max_tasks: int | None, ready: Any,
                    go: Any) -> None:
    async def main() -> None:
        import asyncpg
        import httpx
        from pgqueuer import AsyncpgDriver, Queries, QueueManager
        from pgqueuer.types import QueueExecutionMode

        conn = await asyncpg.connect(**parts)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))
        client = httpx.AsyncClient(timeout=10.0, limits=httpx.Limits(max_connections=64)) if gateway_url else None

        @qm.entrypoint("noop")
        async def noop(job: Any) -> None:
            if client is not None:
                (await client.post(f"{gateway_url}/convert", content=PDF)).raise_for_status()

        ready.release()
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        await qm.run(mode=QueueExecutionMode.drain, max_concurrent_tasks=max_tasks)  # default batch_size (10)
        await conn.close()

    asyncio.run(main())


def _pgqueuer(url: str, action: Callable[[Any], Any]) -> Any:
    async def main() -> Any:
        import asyncpg
        from pgqueuer import AsyncpgDriver, Queries

        conn = await asyncpg.connect(**_parts(url))
        try:
            return await action(Queries(AsyncpgDriver(conn)))
        finally:
            await conn.close()

    return asyncio.run(main())


def pgqueuer_rate(ctx: Bench, n: int, *, gateway_url: str | None = None, max_tasks: int | None = None,
                  jobs: int = JOBS) -> float:
    async def refill(q: Any) -> None:
        await q.clear_queue()
        await q.clear_queue_log()
        await q.clear_statistics_log()
        await q.enqueue(["noop"] * jobs, [None] * jobs, [0] * jobs)

    _pgqueuer(ctx.url, refill)
    ctx.vacuum("pgqueuer")
    # pgqueuer deletes a job once done: the count left in its table is what is still to do
    return ctx.timed(n, _pgqueuer_child, lambda i: (_parts(ctx.url), gateway_url, max_tasks),
                     f"SELECT {jobs} - count(*) FROM pgqueuer", jobs)


# ------------------------------------------------------------------------------------ the files' floor


def _files_child(uploads: str, results: str, jobs: list[tuple[str, str]], concurrency: int, done: Any, ready: Any,
                 go: Any) -> None:
    """The worker's file work alone, shaped as in the worker: ``concurrency`` slot threads read the source and
    stage the XML; the main thread makes what finished durable and publishes it together (RESULTS_SYNC as the
    worker's: one syncfs, or an fsync per file in the slot threads; then the renames and one folder fsync).
    No database, no gateway."""
    import queue

    files = file_store(ConversionSettings(uploads_dir=Path(uploads), results_dir=Path(results)))
    todo: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
    for job in jobs:
        todo.put(job)
    finished: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def slot() -> None:
        while True:
            try:
                job_id, location = todo.get_nowait()
            except queue.Empty:
                finished.put(None)
                return
            files.read_source(location)
            finished.put(files.stage_result(job_id, 1, XML))

    threads = [threading.Thread(target=slot) for _ in range(concurrency)]
    ready.release()
    go.wait()
    for t in threads:
        t.start()
    ended = 0
    while ended < concurrency:
        batch = [finished.get()]
        while not finished.empty():
            batch.append(finished.get())
        ended += batch.count(None)
        staged = [s for s in batch if s is not None]
        if staged:
            files.sync_staged()
        files.publish_all(staged)
    done.release()  # timed to here, not to the process's exit


def files_rate(ctx: Bench, n: int, concurrency: int) -> float:
    """Jobs/s of the worker's file work alone (``_files_child``) in ``n`` processes: the floor a durable
    result file sets, which the peers do not pay."""
    with ctx.engine.connect() as conn:
        jobs = [(str(r.id), r.source_location) for r in conn.execute(sa.text(
            "SELECT id, source_location FROM conversion_jobs ORDER BY id LIMIT :n"), {"n": JOBS})]
    results = ctx.folder / f"files-{uuid.uuid4().hex[:8]}"  # fresh, as each redrive round's (reset_redrive)
    mpc = mp.get_context("spawn")
    ready, go, done = mpc.Semaphore(0), mpc.Event(), mpc.Semaphore(0)
    procs = [mpc.Process(target=_files_child, args=(str(ctx.files.uploads), str(results), jobs[i::n], concurrency,
                                                    done, ready, go)) for i in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise SystemExit("a benchmark process did not start")
    ctx.settle()
    started, cpu = time.perf_counter(), machine_cpu()
    go.set()
    for _ in procs:
        if not done.acquire(timeout=300):
            raise SystemExit("files: a process did not finish")
    elapsed = time.perf_counter() - started
    ctx.cpu_ms = (machine_cpu() - cpu) / len(jobs) * 1000
    for p in procs:
        p.join(timeout=60)
    if any(p.exitcode for p in procs) or sum(1 for _ in results.glob("*.xml")) != len(jobs):
        raise SystemExit("files: a process failed or results are missing")
    return len(jobs) / elapsed


# ---------------------------------------------------------------------------------------------- pgbench

MINIMAL_SCRIPT = """\
WITH c AS (SELECT id FROM bench_minimal WHERE status = 'queued' ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
UPDATE bench_minimal AS j SET status = 'processing' FROM c WHERE j.id = c.id RETURNING j.id AS job_id \\gset
UPDATE bench_minimal SET status = 'done' WHERE id = :job_id;
"""


def _pgbench_binary() -> str:
    import pgserver

    embedded = Path(pgserver.__file__).parent / "pginstall" / "bin" / "pgbench"
    found = str(embedded) if embedded.exists() else shutil.which("pgbench")
    if not found:
        raise SystemExit("pgbench not found (the embedded server ships one; Debian: postgresql-client)")
    return found


def pgbench_rate(ctx: Bench, n: int) -> float:
    """Claim + complete per job, each its own transaction, ``n`` clients: the least a SKIP LOCKED queue does."""
    ctx.sql("UPDATE bench_minimal SET status = 'queued'")
    ctx.vacuum("bench_minimal")
    p = _parts(ctx.url)
    args = [_pgbench_binary(), "-n", "-M", "prepared", "-c", str(n), "-j", str(n), "-t", str(JOBS // n),
            "-f", str(ctx.script), "-h", str(p["host"]), "-p", str(p["port"]), "-U", p["user"], p["database"]]
    env = {**os.environ, **({"PGPASSWORD": p["password"]} if p["password"] else {})}
    ctx.settle()
    cpu = machine_cpu()
    out = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    ctx.cpu_ms = (machine_cpu() - cpu) / JOBS * 1000
    if out.returncode != 0:
        raise SystemExit(f"pgbench failed: {out.stderr.strip().splitlines()[-1:]}")
    tps = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    assert tps, out.stdout
    assert ctx.count("SELECT count(*) FROM bench_minimal WHERE status = 'done'") == (JOBS // n) * n
    return float(tps.group(1))


# ------------------------------------------------------------------------------------------------ bench


class Bench:
    """One scratch database holding every contender's tables, and the helpers the rounds share."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = engine_for(url)
        self.cpu_ms = 0.0  # machine CPU ms per job of the last contender timed
        self.folder = Path(tempfile.mkdtemp(prefix="bench-conversion-"))
        self.files = FileStore(self.folder / "uploads", self.folder / "results")
        self.script = self.folder / "minimal.sql"
        self.script.write_text(MINIMAL_SCRIPT)
        rows = []
        for i in range(max(JOBS, GATEWAY_JOBS)):
            job_id = str(uuid.uuid4())
            rows.append({"id": job_id, "owner": "bench", "filename": f"{i}.pdf",
                         "source_location": self.files.save_source(job_id, PDF), "source_bytes": len(PDF),
                         "source_sha256": "bench"})
        with self.engine.begin() as conn:
            conn.execute(sa.insert(repo.conversion_jobs), rows)
            conn.execute(sa.text("CREATE TABLE bench_minimal (id bigserial PRIMARY KEY, status text NOT NULL)"))
            conn.execute(sa.text("CREATE INDEX ON bench_minimal (id) WHERE status = 'queued'"))
            conn.execute(sa.text("INSERT INTO bench_minimal (status) SELECT 'queued' FROM generate_series(1, :n)"),
                         {"n": JOBS})
        asyncio.run(self._procrastinate_schema())
        _pgqueuer(url, lambda q: q.install())

    async def _procrastinate_schema(self) -> None:
        app = _procrastinate_app(_conninfo(self.url))
        async with app.open_async():
            await app.schema_manager.apply_schema_async()

    def sql(self, statement: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(statement))

    def count(self, query: str) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text(query)).scalar())

    def settle(self) -> None:
        """Before a contender's clock starts: the file system's dirty data written out and a checkpoint taken, so
        none pays for the one before it (a later syncfs or checkpoint would flush that data on its clock), and
        each starts with the same full-page-write state."""
        os.sync()
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("CHECKPOINT"))

    def vacuum(self, *tables: str) -> None:
        with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for table in tables:
                conn.execute(sa.text(f"VACUUM ANALYZE {table}"))

    def reset_redrive(self, jobs: int) -> None:
        """``jobs`` rows queued again (the rest parked as succeeded), no events, a closed breaker, no results."""
        self.sql("TRUNCATE conversion_job_events, circuit_breaker_calls")
        self.sql("DELETE FROM circuit_breakers")
        with self.engine.begin() as conn:
            conn.execute(sa.text(
                "UPDATE conversion_jobs SET status = 'succeeded', result_location = 'parked.xml', attempt_count = 0, "
                "lease_epoch = 0, leased_by = NULL, lease_expires_at = NULL, completed_at = NULL, started_at = NULL, "
                "last_attempt_at = NULL, retry_after = NULL"))
            conn.execute(sa.text(
                "UPDATE conversion_jobs SET status = 'queued', result_location = NULL WHERE id IN "
                "(SELECT id FROM conversion_jobs ORDER BY id LIMIT :n)"), {"n": jobs})
            conn.execute(sa.text("UPDATE conversion_jobs SET created_at = queued_at"))
        self.vacuum("conversion_jobs", "conversion_job_events")
        # A fresh results folder each round; the old ones go at the end (close). Deleting a round's files here
        # made every file the next round creates cost an inode search past them: ext4 skips recently deleted
        # inodes, and that search took ~23 % of the worker's CPU (perf, issue 14): housekeeping, not the work.
        self._round = getattr(self, "_round", 0) + 1
        self.files = FileStore(self.files.uploads, self.folder / f"results-{self._round}")
        self._parked = self.count("SELECT count(*) FROM conversion_jobs") - jobs

    def timed(self, n: int, target: Callable[..., None], args: Callable[[int], tuple], done_query: str,
              jobs: int) -> float:
        """Start ``n`` processes, wait until each is ready, release them at once; jobs/s until ``done_query``
        counts ``jobs`` (for redrive, the parked rows are subtracted)."""
        ctx = mp.get_context("spawn")
        ready, go = ctx.Semaphore(0), ctx.Event()
        procs = [ctx.Process(target=target, args=(*args(i), ready, go)) for i in range(n)]
        for p in procs:
            p.start()
        for _ in procs:
            if not ready.acquire(timeout=120):
                raise SystemExit("a benchmark process did not start")
        offset = self._parked if "conversion_jobs" in done_query else 0
        self.settle()
        started, cpu = time.perf_counter(), machine_cpu()
        go.set()
        while self.count(done_query) - offset < jobs:
            if not any(p.is_alive() for p in procs):
                if self.count(done_query) - offset < jobs:
                    raise SystemExit(f"{target.__name__}: processes ended with jobs left")
            time.sleep(0.01)
        elapsed = time.perf_counter() - started
        self.cpu_ms = (machine_cpu() - cpu) / jobs * 1000
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        return jobs / elapsed

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def run(url: str) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]], dict[str, float]]:
    ctx = Bench(url)
    noop: dict[int, dict[str, list[float]]] = {n: {c: [] for c in CONTENDERS} for n in WORKERS}
    cpu: dict[int, dict[str, list[float]]] = {n: {c: [] for c in CONTENDERS} for n in WORKERS}
    slow: dict[str, list[float]] = {"redrive": [], "pgqueuer": [], "ceiling": []}
    gateway = DelayingGateway(GATEWAY_DELAY)
    try:
        for r in range(ROUNDS):
            for n in WORKERS:
                rates: dict[str, Callable[[], float]] = {
                    **{f"redrive/{c}": lambda c=c: redrive_rate(ctx, n, concurrency=c) for c in CONCURRENCIES},
                    PER_FILE: lambda: redrive_rate(ctx, n, concurrency=max(CONCURRENCIES), sync="file"),
                    "procrastinate": lambda: procrastinate_rate(ctx, n), "pgqueuer": lambda: pgqueuer_rate(ctx, n),
                    "pgbench": lambda: pgbench_rate(ctx, n), "files": lambda: files_rate(ctx, n, max(CONCURRENCIES))}
                for contender, rate in rates.items():
                    noop[n][contender].append(rate())
                    cpu[n][contender].append(ctx.cpu_ms)
                print(f"  round {r + 1}, {n} worker(s): " + ", ".join(f"{c} {noop[n][c][-1]:.0f}" for c in CONTENDERS),
                      flush=True)
            if not GATEWAY_JOBS:  # BENCH_CONVERSION_GATEWAY_JOBS=0: the no-op rows only
                continue
            slow["ceiling"].append(gateway_ceiling(gateway.url))
            slow["redrive"].append(redrive_rate(ctx, 1, concurrency=GATEWAY_IN_FLIGHT, gateway_url=gateway.url,
                                                jobs=GATEWAY_JOBS))
            slow["pgqueuer"].append(pgqueuer_rate(ctx, 1, gateway_url=gateway.url, max_tasks=GATEWAY_IN_FLIGHT,
                                                  jobs=GATEWAY_JOBS))
            print(f"  round {r + 1}, 200 ms gateway: plain client {slow['ceiling'][-1]:.0f}, "
                  f"redrive {slow['redrive'][-1]:.0f}, pgqueuer {slow['pgqueuer'][-1]:.0f}", flush=True)
    finally:
        gateway.close()
        ctx.close()
    return ({n: {c: statistics.median(v) for c, v in by.items()} for n, by in noop.items()},
            {n: {c: statistics.median(v) for c, v in by.items()} for n, by in cpu.items()},
            {c: statistics.median(v) for c, v in slow.items() if v})


PEERS = ("procrastinate", "pgqueuer", "asyncpg", "psycopg")


def missing_peers() -> list[str]:
    """The peers' packages this environment lacks (the `bench` extra is not part of `make install`)."""
    import importlib.util

    return [name for name in PEERS if importlib.util.find_spec(name) is None]


def main() -> int:
    if missing := missing_peers():
        print(f"conversion: the peers' packages are not installed ({', '.join(missing)}); run `make bench` "
              "or `pip install -e \".[bench]\"` first", file=sys.stderr)
        return 2
    with scratch_database(BENCH_DB) as url:
        noop, cpu, slow = run(url)
    print(f"conversion: jobs/s, median of {ROUNDS} interleaved rounds on one embedded PostgreSQL")
    print(f"no-op gateway, {JOBS} jobs; redrive/c: WORKER_CONCURRENCY=c; procrastinate concurrency 1; "
          "pgqueuer batch 10; pgbench minimal claim + complete")
    print(f"  {'workers':>7}  {'redrive':>10}  {'jobs/s':>7}  {'procrast.':>9}  {'pgqueuer':>8}  {'pgbench':>8}  "
          f"{'r/procr.':>8}  {'r/pgq':>6}  {'r/pgbench':>9}")
    for n, m in noop.items():
        for c in REDRIVE:
            r = m[c]
            print(f"  {n:>7}  {c:>10}  {r:>7.0f}  {m['procrastinate']:>9.0f}  {m['pgqueuer']:>8.0f}  "
                  f"{m['pgbench']:>8.0f}  {r / m['procrastinate']:>8.2f}  {r / m['pgqueuer']:>6.2f}  "
                  f"{r / m['pgbench']:>9.2f}")
    print(f"machine CPU ms per job (every process: the workers, PostgreSQL, the kernel), and the worker's file work "
          f"alone ('files': read the source, stage the XML, make it durable as RESULTS_SYNC says, publish; "
          f"{max(CONCURRENCIES)} threads a process)")
    print(f"  {'workers':>7}  " + "  ".join(f"{c:>13}" for c in CONTENDERS))
    for n, m in cpu.items():
        print(f"  {n:>7}  " + "  ".join(f"{m[c]:>13.3f}" for c in CONTENDERS)
              + f"   files: {noop[n]['files']:.0f} jobs/s")
    if not slow:
        return 0
    print(f"{GATEWAY_DELAY * 1000:.0f} ms gateway, {GATEWAY_JOBS} jobs, one process, {GATEWAY_IN_FLIGHT} in flight: "
          f"redrive {slow['redrive']:.0f}, pgqueuer {slow['pgqueuer']:.0f}, ratio {slow['redrive'] / slow['pgqueuer']:.2f} "
          f"(target >= {0.8 * GATEWAY_IN_FLIGHT / GATEWAY_DELAY:.0f}); the gateway's own ceiling for a plain client with "
          f"{GATEWAY_IN_FLIGHT} threads: {slow['ceiling']:.0f} (ideal {GATEWAY_IN_FLIGHT / GATEWAY_DELAY:.0f}), "
          f"redrive / ceiling {slow['redrive'] / slow['ceiling']:.2f}")
    return 0


if __name__ == "__main__":
    from devstack.stack import local_stack

    with local_stack("bench", migrate=False):
        sys.exit(main())
