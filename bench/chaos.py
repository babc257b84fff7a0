"""A chaos run: the pipelines under upstream faults, crashes and restarts, through the production topology.

    python -m bench chaos [--items N] [--seed S] [--kill-interval SECONDS] [--report PATH]
    make chaos                                   # 10,000 items, writes docs/chaos-report.md

It loads N items across the six pipelines (criticizer requests with secrets in their webhook
headers and PII in their rubric, review jobs of several recipients with a versioned rerun of some,
evidence file jobs, conversion jobs through the API, matching documents through SQS with PII in their text,
matchmaking users in several date × timezone partitions, backfilled as an operator does), lets the deployment of `make serve` work them (`dagster api grpc`, `dagster-daemon`
ticking the sensors, PostgreSQL run storage: `devstack.topology`), and meanwhile:
- the sandbox answers 20 % of calls with transient faults (429 with Retry-After, 500/503, slow 504s,
  malformed bodies, "accepted but the answer was lost") and 5 % with permanent ones (400), and the first
  calls of each route with error bodies that carry canary secrets;
- every `--kill-interval` seconds a random run worker is SIGKILLed, or the daemon (and restarted, as a
  process supervisor would), and PostgreSQL backends are terminated (`pg_terminate_backend`);
- the embedded PostgreSQL is restarted once, mid-run.
Waits are scaled by REDRIVE_TIME_SCALE (0.01 unless set). Once no work is open it gives the verdict per
pipeline (`bench._verdict`): lost, duplicate external effects at the sandbox's effect log, canaries found
in dead letters, alerts, Slack and mail effects, Dagster's event log and every process's log files, dead
letters `redrive dlq replay` could not replay (a dry check, rolled back), alerts per final failure ≠ 1.
Any of them non-zero: exit status 1. The report (command, seed, machine, fault schedule, table) is written
to `--report` (docs/chaos-report.md by default).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import signal
import string
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa

from bench import _verdict as v
from bench._workload import deployment, drop_evidence_zips, migrated_database, open_count, total_count
from devstack.sandbox import SandboxClient
from redrive.db import engine_for
from redrive.settings import PROJECT_ROOT, Settings

IN_MAKE_BENCH = False  # `make chaos` runs it; `make bench` runs the benchmarks
DEFAULT_REPORT = PROJECT_ROOT / "docs" / "chaos-report.md"
TIME_SCALE = float(os.environ.get("REDRIVE_TIME_SCALE") or 0.01)

# 20 % transient, 5 % permanent, per call of every faulted route (seeded per route)
TRANSIENT = {"429": 0.05, "503": 0.04, "500": 0.03, "timeout": 0.03, "malformed": 0.03, "effect_then_error": 0.02}
PERMANENT = {"400": 0.05}
SLOW_504_SECONDS = 1.0
ROUTES = ("llm", "store", "slack", "webhook", "mail.send", "case.attach", "pdf.convert")
CRITIQUE = '{"verdict": "approve", "score": 8, "summary": "Fine.", "findings": []}'
MATCHING_PROMPT = "You match business documents"  # the start of matching's system prompt: its own LLM answer
MATCH_FIRST = '{"matches": [{"candidate": 1, "confidence": 0.9, "reason": "same order"}]}'
MATCHMAKING_DAYS = ("2026-03-08", "2026-03-09")
MATCHMAKING_ZONES = 2  # the first timezones of MATCHMAKING_TIMEZONES: 2 days × 2 zones, 4 partition runs

# the share of items per pipeline (of --items)
SHARES = {"criticizer": 0.2, "review_notifications": 0.15, "evidence": 0.3, "conversion": 0.15, "matching": 0.1,
          "matchmaking": 0.1}
RECIPIENTS_PER_JOB = 3
# at least 3 file jobs even at CI size: a file job whose runs die before ingest is dead-lettered whole (its rows
# counted with it), so one job of 70 rows made the 200-item run's evidence verdict "0 done, 70 dead-lettered";
# not many more, since each file job is a Dagster run (seconds of start-up) in every round
EVIDENCE_ROWS_PER_JOB = 50
EVIDENCE_MIN_JOBS = 3


# --------------------------------------------------------------------------------------------- canaries

def _luhn_card(rng: random.Random) -> str:
    digits = [4] + [rng.randrange(10) for _ in range(14)]
    total = 0
    for i, d in enumerate(reversed(digits)):
        d2 = d * 2 if i % 2 == 0 else d
        total += d2 - 9 if d2 > 9 else d2
    return "".join(map(str, digits)) + str((10 - total % 10) % 10)


@dataclass(frozen=True)
class Canaries:
    """Secrets and PII planted in payloads, request headers and upstream error bodies; none may surface."""

    api_key: str
    bearer: str
    card: str
    email: str

    @classmethod
    def from_seed(cls, seed: int) -> Canaries:
        rng = random.Random(f"canaries-{seed}")

        def token(n: int) -> str:
            return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(n))

        return cls(api_key=f"sk-chaos-{token(24)}", bearer=f"chaosBearer{token(24)}", card=_luhn_card(rng),
                   email=f"canary.{token(8).lower()}@chaos-pii.example")

    def values(self) -> list[str]:
        return [self.api_key, self.bearer, self.card, self.email]


# ------------------------------------------------------------------------------------------------ loads

@dataclass
class Ledger:
    """What the harness submitted to one pipeline: the verdict counts from here, not from the system."""

    pipeline: str
    expected: int = 0
    known: set[str] = field(default_factory=set)
    groups: dict[str, int] = field(default_factory=dict)  # evidence: file job id → rows in its ZIP


@dataclass
class Load:
    """How to submit a pipeline's items, read their end state, and count its external effects."""

    pipeline: str
    submit: Callable[[Context, int, Ledger], None]
    effect_kind: str
    effect_key: Callable[[dict[str, Any]], Any]
    mine: Callable[[Context, dict[str, Any]], bool]
    # (conn, ctx) -> entity ref → "done" / "dead" / anything else (open); the core's work queue by default
    rows: Callable[[sa.Connection, Context], dict[str, str]] | None = None
    # (conn, ctx) -> effects beyond one per key that the sandbox does not see (results written, …)
    own_duplicates: Callable[[sa.Connection, Context], int] | None = None
    # what else a user or operator is shown (API answers), to scan for canaries
    user_texts: Callable[[Context], list[tuple[str, str]]] | None = None
    # (conn, ctx) -> entity refs that count as dead-lettered (default: the pipeline's active dead letters)
    letters: Callable[[sa.Connection, Context], set[str]] | None = None
    # every pipeline name its dead letters and alerts are filed under
    letter_pipelines: tuple[str, ...] = ()


@dataclass
class Context:
    engine: sa.Engine
    sandbox: SandboxClient
    session: str
    canaries: Canaries
    defs: Any
    rng: random.Random
    topology: Any = None
    api_token: str = ""
    ledgers: dict[str, Ledger] = field(default_factory=dict)


def _criticizer_submit(ctx: Context, n: int, ledger: Ledger) -> None:
    from assets.criticizer import api

    ctx.sandbox.put_store(f"chaos/{ctx.session}.txt", b"def f():\n    return 1\n" * 20, "text/plain")
    for i in range(n):
        sent = api.submit(ctx.engine, {
            "request_id": f"chaos-{ctx.session}-{i}",
            "artifact_url": f"{ctx.sandbox.base_url}/store/chaos/{ctx.session}.txt",
            "rubric": f"Is it fine? Questions to {ctx.canaries.email}, billing card {ctx.canaries.card}.",
            # the requester's own receiver, which honours the Idempotency-Key notify sends (a Slack incoming
            # webhook cannot: its results post is at-least-once and not counted here)
            "webhook_url": f"{ctx.sandbox.base_url}/webhook/chaos-{ctx.session}/{i}",
            "webhook_headers": {"Authorization": f"Bearer {ctx.canaries.bearer}", "X-Api-Key": ctx.canaries.api_key},
        }, allowed_artifact_prefixes=())
        ledger.expected += 1
        ledger.known.add(sent.request_id)


def _review_submit(ctx: Context, n: int, ledger: Ledger) -> None:
    """n review jobs of several recipients; every tenth changelist gets a versioned rerun (v2)."""
    from assets.review_notifications import api

    def job(i: int, version: int) -> None:
        sub = api.submit(ctx.engine, {
            "idempotency_key": f"chaos-{ctx.session}-{i}-v{version}", "changelist_id": f"CL-{ctx.session}-{i}",
            "review_version": version,
            "recipients": [f"reviewer-{i}-{r}@example.com" for r in range(RECIPIENTS_PER_JOB)],
            "summary": f"Ready. Ping {ctx.canaries.email} or use card {ctx.canaries.card} for the licence."})
        ledger.expected += 1
        ledger.known.add(sub.job.key)

    reruns = n // 11
    for i in range(n - reruns):
        job(i, 1)
    for i in range(reruns):
        job(i * 10, 2)


def _evidence_submit(ctx: Context, n: int, ledger: Ledger) -> None:
    from tests.evidence.helpers import standard_job  # the test suite's ZIP maker: manifest + one PDF per row

    jobs = max(EVIDENCE_MIN_JOBS, n // EVIDENCE_ROWS_PER_JOB)
    rows = max(1, n // jobs)
    zips = [(f"chaos-{ctx.session}-{j}.zip", standard_job(f"chaos-{ctx.session}-{j}", rows, 1)[0])
            for j in range(jobs)]
    from assets.evidence import policy

    for bucket, key, etag in drop_evidence_zips(ctx.defs, zips):
        ledger.groups[str(policy.file_job_id(bucket, key, etag))] = rows
    ledger.expected += jobs * rows


def _file_job_letters(conn: sa.Connection) -> set[str]:
    """Evidence letters of file jobs (a failed ingest run's): entity `{job}`, where a row's is `{job}/{row}`."""
    return {ref for ref in letter_refs(conn, "evidence") if "/" not in ref}


def _evidence_rows(conn: sa.Connection, ctx: Context) -> dict[str, str]:
    """The attach rows, and for a file job never ingested (its ingest run failed for good and was dead-lettered
    under evidence as the file job) its rows as dead-lettered with it: the operator replays the file job."""
    rows = work_rows(conn, "evidence")
    ingested = {ref.split("/", 1)[0] for ref in rows}
    job_letters = _file_job_letters(conn)
    for job, n in ctx.ledgers["evidence"].groups.items():
        if job not in ingested:
            status = v.DEAD if job in job_letters else "never-ingested"
            rows.update({f"{job}/not-ingested-{i}": status for i in range(n)})
    return rows


def _evidence_letters(conn: sa.Connection, ctx: Context) -> set[str]:
    job_letters = _file_job_letters(conn)
    return {ref for ref in letter_refs(conn, "evidence") if "/" in ref} | {f"{job}/not-ingested-{i}" for job, n in ctx.ledgers["evidence"].groups.items()
                                            if job in job_letters for i in range(n)}


def _pdf(text: str) -> bytes:
    stream = f"BT /F1 12 Tf 72 712 Td ({text}) Tj ET".encode()
    return (b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n4 0 obj << /Length " + str(len(stream)).encode()
            + b" >> stream\n" + stream + b"\nendstream endobj\n%%EOF\n")


def _conversion_submit(ctx: Context, n: int, ledger: Ledger) -> None:
    """n PDFs uploaded through the conversion API (as its users do), a canary key in a request header."""
    import httpx

    from assets.conversion import repository as repo

    with ctx.engine.begin() as conn:
        ctx.api_token = repo.create_token(conn, f"chaos-{ctx.session}", "chaos run")
    with httpx.Client(base_url=ctx.topology.api_url, timeout=30) as api:
        for i in range(n):
            answer = api.post("/api/jobs", content=_pdf(f"chaos {ctx.session} document {i}"),
                              headers={"Authorization": f"Bearer {ctx.api_token}", "X-Filename": f"doc-{i}.pdf",
                                       "X-Api-Key": ctx.canaries.api_key})
            answer.raise_for_status()
            ledger.expected += 1
            ledger.known.add(answer.json()["id"])


def _conversion_rows(conn: sa.Connection, ctx: Context) -> dict[str, str]:
    """A job is done when it succeeded with its result file published; failed when it failed."""
    from assets.conversion.repository import conversion_jobs
    from assets.conversion.settings import ConversionSettings

    results = Path(ctx.topology.env.get("RESULTS_DIR") or ConversionSettings().results_dir)
    rows = {}
    for job in conn.execute(sa.select(conversion_jobs.c.id, conversion_jobs.c.status,
                                      conversion_jobs.c.result_location).where(
            conversion_jobs.c.owner == f"chaos-{ctx.session}")):
        if job.status == "succeeded":
            rows[str(job.id)] = v.DONE if (results / job.result_location).is_file() else "succeeded-without-result"
        else:
            rows[str(job.id)] = v.DEAD if job.status == "failed" else job.status
    return rows


def _conversion_duplicates(conn: sa.Connection, ctx: Context) -> int:
    """Results per conversion job beyond one: its `complete` events (each one a published result)."""
    from assets.conversion.repository import conversion_job_events, conversion_jobs

    per_job = conn.execute(sa.select(sa.func.count()).select_from(conversion_job_events.join(
        conversion_jobs, conversion_jobs.c.id == conversion_job_events.c.job_id)).where(
        conversion_jobs.c.owner == f"chaos-{ctx.session}", conversion_job_events.c.event == "complete").group_by(
        conversion_job_events.c.job_id)).scalars()
    return sum(n - 1 for n in per_job if n > 1)


def _conversion_user_texts(ctx: Context) -> list[tuple[str, str]]:
    """What the conversion API shows the user: every job with its error message."""
    import httpx

    with httpx.Client(base_url=ctx.topology.api_url, timeout=30) as api:
        answer = api.get("/api/jobs", headers={"Authorization": f"Bearer {ctx.api_token}"})
    return [("conversion API GET /api/jobs", answer.text)]


def _matching_submit(ctx: Context, n: int, ledger: Ledger) -> None:
    """n documents ingested as 000's ingestion does (stored `pending`, then their ids published to SQS), in
    orders of three that share a reference, so the LLM is asked; PII canaries in their text."""
    from assets.matching import ingestion

    queue = ctx.defs.resources["matching"].queue()
    queue.ensure()
    docs = [{"id": f"chaos-{ctx.session}-{i}", "tenant": f"chaos-{ctx.session}", "doc_type": "invoice",
             "counterparty": f"Chaos Supplier {i // 3} GmbH", "references": [f"PO-{ctx.session}-{i // 3}"],
             "amount": "120.00", "currency": "EUR", "document_date": "2026-03-08",
             "text": f"order {i // 3}; contact {ctx.canaries.email}, card {ctx.canaries.card}"} for i in range(n)]
    for start in range(0, n, 100):
        report = ingestion.ingest(ctx.engine, queue, docs[start:start + 100])
        ledger.known.update(report.stored)
    ledger.expected += n


def _matching_rows(conn: sa.Connection, ctx: Context) -> dict[str, str]:
    """A document is done when it succeeded, dead when it failed (000: failed, admins told, message gone)."""
    from assets.matching.repository import document

    states = {"succeeded": v.DONE, "failed": v.DEAD}
    return {r.id: states.get(r.matching_status, r.matching_status or "none") for r in conn.execute(
        sa.select(document.c.id, document.c.matching_status).where(document.c.tenant == f"chaos-{ctx.session}"))}


def _matching_duplicates(conn: sa.Connection, ctx: Context) -> int:
    """Matching's effect is its write phase: an edge stored twice (either way round), and every document whose
    cluster id disagrees with the edges (a write phase that half-happened)."""
    from assets.matching import repository

    tenant = f"chaos-{ctx.session}"
    edges = [tuple(sorted(e)) for e in repository.edges_of(conn, tenant)]
    return (len(edges) - len(set(edges))) + len(repository.cluster_inconsistencies(conn, tenant))


def _matchmaking_partitions() -> list[str]:
    from assets.matchmaking.settings import MatchmakingSettings

    zones = MatchmakingSettings().timezones[:MATCHMAKING_ZONES]
    return [f"{day}|{zone}" for day in MATCHMAKING_DAYS for zone in zones]


def _matchmaking_submit(ctx: Context, n: int, ledger: Ledger) -> None:
    """Users in several timezones, and a backfill of their (date, timezone) partitions launched as an operator
    does (`dagster job backfill` against the deployment's workspace; the daemon runs it)."""
    import subprocess

    from assets.matchmaking import synthetic

    partitions = _matchmaking_partitions()
    zones = sorted({p.split("|")[1] for p in partitions})
    per_zone = max(4, n // len(partitions))
    with ctx.engine.begin() as conn:
        for zone in zones:
            rows = synthetic.users(per_zone, timezone=zone, tag=f"chaos-{ctx.session}-{zone}",
                                   regions=max(1, per_zone // 40))
            synthetic.insert(conn, rows)
            for day in MATCHMAKING_DAYS:
                ledger.known.update(f"{day}:{zone}:{row['id']}" for row in rows)
    ledger.expected += len(ledger.known)
    topology = ctx.topology
    env = {**os.environ, **topology.env, "DAGSTER_HOME": str(topology.home)}
    for attempt in range(1, 4):
        done = subprocess.run([sys.executable, "-m", "dagster", "job", "backfill", "-w",
                               str(topology.home / "workspace.yaml"), "-j", "matchmaking_job",
                               "--partitions", ",".join(partitions), "--noprompt"],
                              env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)
        # on a loaded host the CLI's call to the code server can time out before anything is submitted
        # (DEADLINE_EXCEEDED); an operator runs it again, and so does the harness
        if done.returncode == 0 or "DagsterUserCodeUnreachableError" not in done.stdout + done.stderr or attempt == 3:
            break
        print(f"chaos: dagster job backfill could not reach the code server (attempt {attempt}); again", flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"dagster job backfill failed: {done.stdout[-1500:]} {done.stderr[-1500:]}")


def _matchmaking_rows(conn: sa.Connection, ctx: Context) -> dict[str, str]:
    """A user's day is done when its job completed; dead when it failed. A partition whose run failed for
    good (its letter is `{date}:{tz}`) counts its unfinished users dead with it (replaying the letter runs the
    partition again, which takes up its pending and running jobs); a user with no job yet is missing."""
    from assets.matchmaking.repository import matchmaking_jobs

    known = ctx.ledgers["matchmaking"].known
    states = {"completed": v.DONE, "failed": v.DEAD}
    rows = {}
    for r in conn.execute(sa.select(matchmaking_jobs.c.date, matchmaking_jobs.c.timezone, matchmaking_jobs.c.user_id,
                                    matchmaking_jobs.c.status)):
        ref = f"{r.date.isoformat()}:{r.timezone}:{r.user_id}"
        if ref in known:
            rows[ref] = states.get(r.status, r.status)
    letters = {ref.replace("|", ":") for ref in letter_refs(conn, "matchmaking")}  # a run's letter: `date|tz`
    for ref in known:
        if rows.get(ref) != v.DONE and ref.rsplit(":", 1)[0] in letters:  # the partition's own letter
            rows[ref] = v.DEAD
    return rows


def _matchmaking_letters(conn: sa.Connection, ctx: Context) -> set[str]:
    letters = {ref.replace("|", ":") for ref in letter_refs(conn, "matchmaking")}
    return letters | {ref for ref in ctx.ledgers["matchmaking"].known
                      if ref.rsplit(":", 1)[0] in letters}


def _matchmaking_duplicates(conn: sa.Connection, ctx: Context) -> int:
    """Offers per user and day beyond the one set their job recorded (the set's size), and second jobs."""
    from assets.matchmaking.repository import matchmaking_jobs, matchmaking_offers

    jobs = conn.execute(sa.select(sa.func.count()).select_from(matchmaking_jobs).group_by(
        matchmaking_jobs.c.date, matchmaking_jobs.c.user_id).having(sa.func.count() > 1)).scalars().all()
    recorded = {(r.date, r.user_id): len(r.offers or []) for r in conn.execute(
        sa.select(matchmaking_jobs.c.date, matchmaking_jobs.c.user_id, matchmaking_jobs.c.offers))}
    offered = conn.execute(sa.select(matchmaking_offers.c.date, matchmaking_offers.c.user_id, sa.func.count()).group_by(
        matchmaking_offers.c.date, matchmaking_offers.c.user_id)).all()
    return sum(n - 1 for n in jobs) + sum(max(0, n - recorded.get((d, u), 0)) for d, u, n in offered)


LOADS: dict[str, Load] = {
    # webhook deliveries per request, whatever key they came under: a key that changed between retries
    # would be two deliveries at the receiver, and counted
    "criticizer": Load("criticizer", _criticizer_submit, "webhook.delivery", lambda e: e.get("path"),
                       lambda ctx, e: str(e.get("path", "")).startswith(f"chaos-{ctx.session}/")),
    # one email per recipient and review version (the subject names the changelist and the version)
    "review_notifications": Load("review_notifications", _review_submit, "mail.send",
                                 lambda e: (e.get("to"), e.get("subject")),
                                 lambda ctx, e: str(e.get("to", "")).startswith("reviewer-")),
    # one attachment per artifact, whatever idempotency key it was sent under
    "evidence": Load("evidence", _evidence_submit, "case.attach", lambda e: (e.get("case_id"), e.get("artifact_id")),
                     lambda ctx, e: True, rows=_evidence_rows, letters=_evidence_letters,
                     letter_pipelines=("evidence",)),
    # results per conversion job: counted in the job's own events (the gateway call itself may repeat)
    "conversion": Load("conversion", _conversion_submit, "pdf.convert", lambda e: e.get("seq"), lambda ctx, e: False,
                       rows=_conversion_rows, own_duplicates=_conversion_duplicates,
                       user_texts=_conversion_user_texts),
    # matching's effect is its write phase (edges, cluster ids), counted in the database; its LLM calls are reads
    "matching": Load("matching", _matching_submit, "llm.call", lambda e: e.get("seq"), lambda ctx, e: False,
                     rows=_matching_rows, own_duplicates=_matching_duplicates),
    # offers per user and day, counted in the database (no external service sees them)
    "matchmaking": Load("matchmaking", _matchmaking_submit, "llm.call", lambda e: e.get("seq"), lambda ctx, e: False,
                        rows=_matchmaking_rows, own_duplicates=_matchmaking_duplicates, letters=_matchmaking_letters),
}


# ----------------------------------------------------------------------------------------------- faults

def arm_sandbox(sandbox: SandboxClient, seed: int, canaries: Canaries, poisoned: int) -> list[str]:
    """Random faults on every route, behind `poisoned` scripted errors whose bodies carry canaries."""
    sandbox.set_default("llm", content=CRITIQUE)
    sandbox.set_default("llm", content=MATCH_FIRST, when=MATCHING_PROMPT)
    schedule = []
    for k, route in enumerate(ROUTES):
        steps = []
        for i in range(poisoned):
            if i % 2:
                steps.append({"status": 400, "json": {"error": {"message": f"invalid key {canaries.api_key} "
                              f"for {canaries.email}", "code": "invalid_request_error"}}})
            else:
                steps.append({"status": 503, "headers": {"Retry-After": "1"},
                              "json": {"error": {"message": f"overloaded; card {canaries.card} "
                                                            f"token Bearer {canaries.bearer}"}}})
        if steps:
            sandbox.script(route, *steps)
        sandbox.random_faults(route, seed=seed * 100 + k, rates={**TRANSIENT, **PERMANENT}, retry_after="1",
                              timeout_seconds=SLOW_504_SECONDS)
        schedule.append(f"`{route}`: first {poisoned} calls scripted errors with canary bodies (503/400 "
                        f"alternating), then seeded random faults (seed {seed * 100 + k})")
    return schedule


@dataclass
class Event:
    at: float
    what: str


class Monkey(threading.Thread):
    """Every `interval` seconds: SIGKILL a run worker or the daemon (restarted), terminate PostgreSQL
    backends; once, the embedded PostgreSQL is restarted. Exited services are restarted as a supervisor would."""

    def __init__(self, topology: Any, admin_url: str, dagster_url: str, databases: list[str], interval: float,
                 seed: int, started: float, pg_restart_at: int = 3) -> None:
        super().__init__(daemon=True, name="chaos-monkey")
        self.topology, self.admin_url, self.dagster_url, self.databases = topology, admin_url, dagster_url, databases
        self.interval, self.rng, self.started = interval, random.Random(f"monkey-{seed}"), started
        self.pg_restart_at = pg_restart_at
        self.events: list[Event] = []
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def note(self, what: str) -> None:
        self.events.append(Event(round(time.monotonic() - self.started, 1), what))
        print(f"chaos: t={self.events[-1].at:>6}s {what}", flush=True)

    def run(self) -> None:
        tick = 0
        while not self.stopping.wait(self.interval * self.rng.uniform(0.7, 1.3)):
            tick += 1
            try:
                with self.lock:
                    self.supervise()
                    if tick == self.pg_restart_at:
                        self.restart_postgres()
                    else:
                        self.kill_something(tick)
                        self.terminate_backends()
            except Exception as exc:  # noqa: BLE001 - the monkey must not die of what it causes
                self.note(f"monkey error: {type(exc).__name__}: {str(exc)[:200]}")

    def supervise(self) -> None:
        for name, code in self.topology.exited().items():
            self.note(f"{name} had exited ({code}); restarted")
            self.topology.respawn(name)

    def run_workers(self) -> list[psutil.Process]:
        """Run workers at work: the processes of STARTED runs that are executing their steps (the run's
        "Executing steps in process (pid: N)" event), so a kill hits a run mid-work, not one still loading."""
        engine = sa.create_engine(self.dagster_url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                messages = conn.execute(sa.text(
                    "SELECT e.event FROM event_logs e JOIN runs r ON r.run_id = e.run_id "
                    "WHERE r.status = 'STARTED' AND e.dagster_event_type = 'ENGINE_EVENT' "
                    "AND e.event LIKE '%Executing steps in process (pid: %'")).scalars().all()
        finally:
            engine.dispose()
        pids = {int(m.group(1)) for text in messages for m in [re.search(r"in process \(pid: (\d+)\)", text)] if m}
        alive = {p.pid: p for p in self.topology.survivors()}
        return [alive[pid] for pid in sorted(pids) if pid in alive]

    def kill_something(self, tick: int) -> None:
        """In turn: a run worker at work, the daemon, a run worker, a conversion worker."""
        converters = [n for n in self.topology.processes if n.startswith("conversion-worker")]
        rota = ["run-worker", "daemon", "run-worker"] + (["conversion-worker"] if converters else [])
        choice = rota[tick % len(rota)]
        if choice == "conversion-worker":
            choice = self.rng.choice(converters)
        if choice == "run-worker":
            workers = self.run_workers()
            if not workers:
                self.note("no run worker at work to kill this tick")
                return
            victim = self.rng.choice(workers)
            try:
                victim.send_signal(signal.SIGKILL)
                self.note(f"SIGKILL run worker pid {victim.pid}")
            except psutil.NoSuchProcess:
                pass
        else:
            self.topology.kill(choice)
            self.note(f"SIGKILL {choice}; restarted")

    def terminate_backends(self) -> None:
        engine = sa.create_engine(self.admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                killed = conn.execute(sa.text(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = ANY(:dbs) AND pid <> pg_backend_pid() AND random() < 0.3"),
                    {"dbs": self.databases}).scalar_one()
        finally:
            engine.dispose()
        self.note(f"pg_terminate_backend: {killed} backends")

    def restart_postgres(self) -> None:
        restart_embedded_postgres(self.admin_url)
        self.note("embedded PostgreSQL restarted (pg_ctl restart -m immediate)")

    def stop(self) -> None:
        self.stopping.set()
        self.join(60)


def restart_embedded_postgres(admin_url: str) -> None:
    """`pg_ctl restart -m immediate` on the server's data directory: a crash and a recovery."""
    from pgserver import _commands

    engine = sa.create_engine(admin_url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        data_dir = conn.execute(sa.text("SHOW data_directory")).scalar_one()
    engine.dispose()
    user = "pgserver" if os.geteuid() == 0 else None
    _commands.pg_ctl(["-w", "-m", "immediate", "restart"], pgdata=Path(data_dir), user=user, timeout=120)


# ------------------------------------------------------------------------------------------------ drain

def _alerts_pending(engine: sa.Engine) -> int:
    from redrive import alerts

    with engine.connect() as conn:
        return alerts.pending_count(conn)


def progress(ctx: Context, name: str) -> tuple[int, int]:
    """(entities the pipeline holds, of them still open)."""
    load = LOADS[name]
    if load.rows is None:
        return total_count(ctx.engine, name), open_count(ctx.engine, name)
    with ctx.engine.connect() as conn:
        rows = load.rows(conn, ctx)
    return len(rows), sum(1 for status in rows.values() if status not in (v.DONE, v.DEAD))


def wait_settled(ctx: Context, ledgers: dict[str, Ledger], timeout: float,
                 stalls: dict[str, v.StallMeter] | None = None, give_up_after_stall: float | None = None) -> bool:
    """Until every submitted entity has its row, none is open and no alert waits to be sent. `stalls` measures
    each pipeline's longest spell of open work without progress; one longer than `give_up_after_stall` ends the
    wait early (the verdict fails on it anyway)."""
    deadline = time.monotonic() + timeout
    stalls = stalls if stalls is not None else {}
    last = ""
    while time.monotonic() < deadline:
        try:
            state = {p: progress(ctx, p) for p in ledgers}
            pending = _alerts_pending(ctx.engine)
        except sa.exc.OperationalError:  # the monkey restarted PostgreSQL or ended our backend
            ctx.engine.dispose()
            time.sleep(1.0)
            continue
        now = time.monotonic()
        quiet = {p: stalls.setdefault(p, v.StallMeter()).observe(now, t, o, ledgers[p].expected)
                 for p, (t, o) in state.items()}
        line = " ".join(f"{p}={t}/{ledgers[p].expected} open={o}" for p, (t, o) in state.items())
        if line != last:
            print(f"chaos: {line} alerts pending={pending}", flush=True)
            last = line
        if pending == 0 and all(t >= ledgers[p].expected and o == 0 for p, (t, o) in state.items()):
            return True
        if give_up_after_stall is not None and max(quiet.values(), default=0.0) > give_up_after_stall:
            print(f"chaos: giving up, no progress for {max(quiet.values()):.0f} s: "
                  f"{', '.join(p for p, q in quiet.items() if q > give_up_after_stall)}", flush=True)
            return False
        time.sleep(2.0)  # polling the deployment's progress; not a timing assertion
    return False


# ---------------------------------------------------------------------------------------------- verdict

def work_rows(conn: sa.Connection, pipeline: str) -> dict[str, str]:
    from redrive.schema import work_items

    return {r.entity_ref: r.status for r in conn.execute(
        sa.select(work_items.c.entity_ref, work_items.c.status).where(work_items.c.pipeline == pipeline))}


def letter_refs(conn: sa.Connection, pipeline: str) -> set[str]:
    from redrive.schema import dead_letters

    return set(conn.execute(sa.select(dead_letters.c.entity_ref).where(
        dead_letters.c.pipeline == pipeline, dead_letters.c.status != "resolved")).scalars())


FINAL_ALERTS = ("dead_letter", "replay_failed", "escalation")  # the alerts the core writes with a dead letter


def letter_ids(conn: sa.Connection, pipeline: str) -> list[str]:
    """Every dead letter the pipeline ever wrote (resolved ones too): each is one final failure."""
    from redrive.schema import dead_letters

    return [str(i) for i in conn.execute(sa.select(dead_letters.c.id).where(dead_letters.c.pipeline == pipeline))
            .scalars()]


def alerted_letters(conn: sa.Connection, pipeline: str) -> list[str]:
    """The dead letter each final-failure alert was written for (its dedupe key `dead_letter:<id>:…`)."""
    from redrive.schema import alerts

    keys = conn.execute(sa.select(alerts.c.dedupe_key).where(
        alerts.c.pipeline == pipeline, alerts.c.kind.in_(FINAL_ALERTS))).scalars()
    return [key.split(":")[1] for key in keys if key.startswith("dead_letter:")]


def unreplayable(engine: sa.Engine, pipeline: str, drained: set[str], targets: set[str]) -> list[str]:
    """Dead letters `redrive dlq replay` would refuse or could not run: requested, then rolled back.

    Each as ``"<id>: <why>"`` so the report's examples say what to look at."""
    from redrive import deadletters, work
    from redrive.schema import dead_letters

    bad = []
    with engine.connect() as conn:
        ids = list(conn.execute(sa.select(dead_letters.c.id, dead_letters.c.entity_ref).where(
            dead_letters.c.pipeline == pipeline, dead_letters.c.status != "resolved")))
    for letter_id, ref in ids:
        conn = engine.connect()
        tx = conn.begin()
        try:
            deadletters.request_replay(conn, letter_id, evidence="chaos dry check", confirm_safe=True,
                                       at=datetime.now(UTC))
            runnable = (pipeline in drained and work.has_item(conn, pipeline, ref)) or pipeline in targets
            if not runnable:
                bad.append(f"{letter_id}: no work item for {ref} to replay into")
        except deadletters.ReplayRefused as refused:
            bad.append(f"{letter_id}: {refused}")
        finally:
            tx.rollback()
            conn.close()
    return bad


def sink_texts(engine: sa.Engine, pipeline: str) -> Iterator[tuple[str, str]]:
    """The pipeline's dead letters and alerts, as text."""
    from redrive.schema import alert_deliveries, alerts, dead_letters

    with engine.connect() as conn:
        for row in conn.execute(sa.select(dead_letters).where(dead_letters.c.pipeline == pipeline)):
            yield f"dead letter {row.id}", v.dumps(dict(row._mapping))
        for row in conn.execute(sa.select(alerts, alert_deliveries.c.last_error).outerjoin(
                alert_deliveries, alert_deliveries.c.alert_id == alerts.c.id).where(alerts.c.pipeline == pipeline)):
            yield f"alert {row.id}", v.dumps(dict(row._mapping))


def shared_texts(sandbox: SandboxClient, dagster_url: str | None, event_log_from: int,
                 log_dirs: list[Path]) -> Iterator[tuple[str, str]]:
    """Sinks no one pipeline owns: Slack, webhook and mail effects, Dagster's event log, every process's log files."""
    for effect in sandbox.effects():
        if effect.get("kind") in ("slack.message", "webhook.delivery", "mail.send"):
            yield f"{effect['kind']} effect {effect['seq']}", v.dumps(effect)
    if dagster_url:
        engine = sa.create_engine(dagster_url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                for row in conn.execute(sa.text("SELECT id, run_id, event FROM event_logs WHERE id > :start"),
                                        {"start": event_log_from}):
                    yield f"event log {row.id} (run {row.run_id})", row.event
        finally:
            engine.dispose()
    for folder in log_dirs:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.suffix not in (".yaml", ".db", ".sqlite"):
                yield f"log {path}", path.read_text(errors="replace")


def judge(ctx: Context, ledgers: dict[str, Ledger], *, drained: set[str], targets: set[str],
          shared: list[tuple[str, str]], stalls: dict[str, v.StallMeter] | None = None,
          stall_limit: float = v.STALL_LIMIT_SECONDS) -> tuple[list[v.Verdict], list[tuple[str, str]]]:
    """Per pipeline verdicts, and canaries found in sinks no pipeline owns."""
    canaries = ctx.canaries.values()
    effects = ctx.sandbox.effects()
    verdicts = []
    for name, ledger in ledgers.items():
        load = LOADS[name]
        filed = load.letter_pipelines or (name,)
        with ctx.engine.connect() as conn:
            rows = load.rows(conn, ctx) if load.rows else work_rows(conn, name)
            real = set().union(*(letter_refs(conn, p) for p in filed))
            letters = load.letters(conn, ctx) if load.letters else real
            written = [i for p in filed for i in letter_ids(conn, p)]
            alerted = [i for p in filed for i in alerted_letters(conn, p)]
            own = load.own_duplicates(conn, ctx) if load.own_duplicates else 0
        settled = v.settle(ledger.expected, ledger.known, rows, letters)
        mine = [e for e in effects if e.get("kind") == load.effect_kind and load.mine(ctx, e)]
        texts = [*(t for p in filed for t in sink_texts(ctx.engine, p)),
                 *(load.user_texts(ctx) if load.user_texts else [])]
        verdicts.append(v.verdict(
            name, settled, duplicate_effects=v.duplicates(mine, load.effect_key) + own,
            canaries=v.canaries_in(texts, canaries), redacted=sum("[REDACTED" in text for _, text in texts),
            unreplayable=[i for p in filed for i in unreplayable(ctx.engine, p, drained, targets)],
            alerts=v.alert_mismatches(written, alerted),
            longest_stall=(stalls or {}).get(name, v.StallMeter()).longest, stall_limit=stall_limit))
    return verdicts, v.canaries_in(shared, canaries)


# ----------------------------------------------------------------------------------------------- report

def write_report(path: Path, *, argv: list[str], args: argparse.Namespace, verdicts: list[v.Verdict],
                 shared_found: list[tuple[str, str]], schedule: list[str], events: list[Event], seconds: float,
                 drained_in_time: bool, runs: int, load_before: tuple[float, float, float]) -> None:
    load_after = os.getloadavg()
    total_in = sum(x.items_in for x in verdicts)
    lines = [
        "# Chaos run report", "",
        "Written by `python -m bench chaos` (`make chaos`); rerun it to reproduce (same seed, same fault draws;",
        "process kills and timings differ run to run).", "",
        f"- command: `python -m bench chaos {' '.join(argv)}`",
        f"- seed: {args.seed}; items: {args.items} requested, {total_in} entities (pipelines' own rows included)",
        f"- finished: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; wall time {seconds:.0f} s; "
        f"Dagster runs launched: {runs}",
        f"- machine: {platform.node()} · {platform.platform()} · {os.cpu_count()} cores · Python "
        f"{platform.python_version()}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}",
        f"- REDRIVE_TIME_SCALE: {TIME_SCALE}",
        f"- all due work drained before the timeout: {'yes' if drained_in_time else 'NO'}", "",
        "## Fault schedule", "",
        f"- sandbox, every route: transient {', '.join(f'{k} {int(r * 100)} %' for k, r in TRANSIENT.items())} "
        f"(20 % in all; 429/503 carry `Retry-After: 1`, `timeout` answers 504 after {SLOW_504_SECONDS} s); "
        f"permanent {', '.join(f'{k} {int(r * 100)} %' for k, r in PERMANENT.items())}",
        *[f"- {line}" for line in schedule],
        f"- processes: every ~{args.kill_interval:.0f} s (±30 %) in turn a run worker executing its steps "
        "(SIGKILL, not restarted: the code server reports its run failed), the daemon, a run worker, a conversion "
        "worker (SIGKILL, restarted as a supervisor would); and 30 % of PostgreSQL "
        "backends of the app and Dagster databases terminated; the embedded PostgreSQL restarted once "
        "(`pg_ctl restart -m immediate`) at the third tick; any service that exits is restarted",
        "", "## Verdict", "", *v.table(verdicts), "",
        f"Canaries found outside any one pipeline's rows (Slack and mail effects, Dagster's event log, process "
        f"logs): {len(shared_found)}", "",
        "Counts: *in* is what the harness submitted (plus rows a pipeline adds itself, such as a review "
        "recipient's own dead row); *lost* is an entity neither done nor dead-lettered (open, missing, or dead "
        "without its dead letter); duplicate effects are counted at the sandbox's effect log (criticizer: "
        "webhook deliveries per request at a receiver that honours Idempotency-Key; review: emails per recipient "
        "and version; evidence: attachments per artifact) or, where no service sees the effect, in the database "
        "(conversion: results per job; matching: edges stored twice and documents whose cluster id disagrees with "
        "the edges; matchmaking: offers per user and day beyond the set its job recorded); *unreplayable*: dead letters `redrive dlq replay` refuses or cannot run (requested in a "
        "rolled-back transaction); *alerts ≠ 1*: dead-lettered entities not alerted exactly once; *longest stall*: "
        f"the longest time the pipeline had open work and none of its entities moved, from the harness's polls every "
        f"2 s (a pipeline fails above {args.max_stall:g} s: a run whose worker died must be ended by the run "
        "watchdog and its work taken up again within that).", "",
    ]
    examples = {x.pipeline: x.examples for x in verdicts if x.examples}
    if examples or shared_found:
        lines += ["## Findings", ""]
        for name, ex in examples.items():
            lines.append(f"- {name}: {v.dumps(ex)}")
        for where, _ in shared_found[:10]:
            lines.append(f"- canary in {where}")
        lines.append("")
    lines += ["## Fault events", "", "| t (s) | event |", "|---|---|",
              *[f"| {e.at} | {e.what} |" for e in events[:400]], ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


# ------------------------------------------------------------------------------------------------- main

def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--kill-interval", type=float, default=10.0)
    parser.add_argument("--report", type=Path, default=DEFAULT_REPORT)
    parser.add_argument("--pipelines", default=",".join(LOADS), help="comma-separated subset")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the work to drain")
    parser.add_argument("--max-stall", type=float, default=v.STALL_LIMIT_SECONDS,
                        help="the verdict fails when a pipeline goes longer than this with open work and no progress; "
                             "three times as long ends the wait")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import dagster as dg

    from orchestration.definitions import build_definitions
    from orchestration.registry import load_pipelines

    argv = list(argv or [])
    args = parse(argv)
    names = [p for p in args.pipelines.split(",") if p]
    canaries = Canaries.from_seed(args.seed)
    session = uuid.uuid4().hex[:6]
    load_before = os.getloadavg()
    from devstack.postgres import create_database, drop_database, with_database
    from redrive.db import normalize_url

    with migrated_database(f"chaos_{session}") as url:
        settings = Settings(database_url=url, redrive_time_scale=TIME_SCALE)
        defs = build_definitions(settings)
        pipelines = load_pipelines(settings)
        drained = {n for p in pipelines for n in p.drained}
        targets = {n for p in pipelines for n in p.replay_targets}
        engine = engine_for(url)
        sandbox = SandboxClient(os.environ["SANDBOX_URL"])
        sandbox.reset()
        ctx = Context(engine, sandbox, session, canaries, defs, random.Random(args.seed))
        poisoned = max(2, args.items // 200)
        schedule = arm_sandbox(sandbox, args.seed, canaries, poisoned)
        home = settings.redrive_data_dir / "chaos" / session
        ledgers = {n: Ledger(n) for n in names}
        ctx.ledgers = ledgers
        admin = with_database(url, "postgres")
        # run storage of its own: no run of an earlier session counts as active here, the event log is this run's
        create_database(admin, f"chaos_{session}_dagster")
        dagster_url = normalize_url(with_database(admin, f"chaos_{session}_dagster"))
        dbs = [f"chaos_{session}", f"chaos_{session}_dagster"]
        services = ("code-server", "daemon") + (("conversion-api", "conversion-worker") if "conversion" in names else ())
        env = {"UPLOADS_DIR": str(home / "uploads"), "RESULTS_DIR": str(home / "results"), "DAGSTER_PG_URL": dagster_url,
               "MATCHING_SENSOR_INTERVAL_SECONDS": "5"}
        saved_pg_url = os.environ.get("DAGSTER_PG_URL")
        os.environ["DAGSTER_PG_URL"] = dagster_url  # this process's view of the instance (run counts)
        started = time.monotonic()
        monkey: Monkey | None = None
        try:
            with deployment(settings, home, only=services, workers=2, env=env) as topology:
                ctx.topology = topology
                instance = dg.DagsterInstance.from_config(str(home))
                runs0 = instance.get_runs_count()
                total_share = sum(SHARES[n] for n in names)
                for name in names:
                    LOADS[name].submit(ctx, max(1, int(args.items * SHARES[name] / total_share)), ledgers[name])
                print(f"chaos: submitted {', '.join(f'{n} {ledgers[n].expected}' for n in names)}", flush=True)
                monkey = Monkey(topology, admin, dagster_url, dbs, args.kill_interval, args.seed, started)
                monkey.start()
                stalls: dict[str, v.StallMeter] = {}
                settled = wait_settled(ctx, ledgers, args.timeout, stalls, give_up_after_stall=3 * args.max_stall)
                monkey.stop()
                seconds = time.monotonic() - started
                runs = _retry_db(lambda: instance.get_runs_count() - runs0)
                sandbox.clear_faults()
                shared = list(shared_texts(sandbox, dagster_url, 0,
                                           [home, settings.redrive_data_dir / "logs"]))
                verdicts, shared_found = judge(ctx, ledgers, drained=drained, targets=targets, shared=shared,
                                               stalls=stalls, stall_limit=args.max_stall)
        finally:
            if monkey is not None:
                monkey.stop()
            sandbox.clear_faults()
            engine.dispose()
            if saved_pg_url is None:
                os.environ.pop("DAGSTER_PG_URL", None)
            else:
                os.environ["DAGSTER_PG_URL"] = saved_pg_url
            drop_database(admin, f"chaos_{session}_dagster")
    write_report(args.report, argv=argv, args=args, verdicts=verdicts, shared_found=shared_found,
                 schedule=schedule, events=monkey.events if monkey else [], seconds=seconds,
                 drained_in_time=settled, runs=runs, load_before=load_before)
    print("\n".join(v.table(verdicts)))
    print(f"canaries outside the pipelines' rows: {len(shared_found)}; report: {args.report}")
    for x in verdicts:
        print(v.dumps({"verdict": x.as_json()}))
    return 1 if v.failed(verdicts, len(shared_found)) or not settled else 0


def _retry_db(fn: Callable[[], Any], attempts: int = 10) -> Any:
    for i in range(attempts):
        try:
            return fn()
        except Exception:  # noqa: BLE001 - the run storage may be restarting
            if i == attempts - 1:
                raise
            time.sleep(1.0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
