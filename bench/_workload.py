"""What the scale benchmark and the chaos run share: a deployment on a scratch database, the drained
pipelines' work-queue counts, dropping evidence file jobs in the S3 inbox, and CPU over a process tree."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa

from bench._support import scratch_database
from redrive import work
from redrive.db import engine_for, upgrade_head
from redrive.schema import work_items
from redrive.settings import Settings


def open_count(engine: sa.Engine, pipeline: str) -> int:
    """Work rows of the pipeline still due or leased."""
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(work_items).where(
            work_items.c.pipeline == pipeline, work_items.c.status.in_(work.OPEN_STATUSES))).scalar_one()


def total_count(engine: sa.Engine, pipeline: str) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(work_items).where(
            work_items.c.pipeline == pipeline)).scalar_one()


def wait_drained(engine: sa.Engine, pipeline: str, expected_total: int, timeout: float) -> int:
    """Until every expected entity exists (evidence rows appear at ingest) and none is open; what is left open."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if total_count(engine, pipeline) >= expected_total and open_count(engine, pipeline) == 0:
            return 0
        time.sleep(1.0)  # polling the database for the deployment's progress; not a timing assertion
    return open_count(engine, pipeline) + max(0, expected_total - total_count(engine, pipeline))


def cpu_of(pids: list[int]) -> float:
    """User + system CPU of these processes, their live descendants and every child they reaped."""
    total, seen = 0.0, set()
    for pid in pids:
        try:
            top = psutil.Process(pid)
            procs = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            if proc.pid in seen:
                continue
            seen.add(proc.pid)
            try:
                t = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system + t.children_user + t.children_system
    return total


@dataclass
class RunWorkers:
    """Samples the processes that Dagster starts under the code server to execute runs (every `every` seconds):
    how busy each kept its core, its CPU over its life seen so far. A drain run is one process, so one run's
    process at ~100 % is the cap of that run whatever its upstreams allow."""

    parents: list[int]
    every: float = 0.5
    seen: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # pid -> (created, last seen, cpu)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> RunWorkers:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            for parent in self.parents:
                try:
                    children = psutil.Process(parent).children(recursive=True)
                except psutil.NoSuchProcess:
                    continue
                for child in children:
                    try:
                        if "multiprocessing" not in " ".join(child.cmdline()):
                            continue
                        t = child.cpu_times()
                        self.seen[child.pid] = (child.create_time(), time.time(), t.user + t.system)
                    except psutil.Error:
                        continue

    def busiest(self, at_least_seconds: float = 10.0) -> float:
        """The highest share of a core a run's process used over its life (those seen for a while)."""
        return max((cpu / (last - created) for created, last, cpu in self.seen.values()
                    if last - created >= at_least_seconds), default=0.0)


def postgres_pids(url: str) -> list[int]:
    """The PostgreSQL server process behind `url` (its backends are its children)."""
    engine = engine_for(url)
    with engine.connect() as conn:
        backend = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    try:
        parent = psutil.Process(backend).parent()
    except psutil.NoSuchProcess:
        return []
    return [parent.pid] if parent is not None else []


@contextmanager
def migrated_database(name: str) -> Iterator[str]:
    with scratch_database(name) as url:
        upgrade_head(url)
        yield url


@contextmanager
def deployment(settings: Settings, home: Path, *, only: tuple[str, ...] = ("code-server", "daemon"),
               workers: int = 1, env: dict[str, str] | None = None) -> Iterator[Any]:
    """The processes of `make serve` (devstack.topology) on this database; sensors ticked every 5 s. Dagster's
    storage is a database of its own unless `env` names one (DAGSTER_PG_URL): no run of an earlier deployment
    (a failed run the daemon retries, one left STARTED) is launched or counted in this one. Its evidence inbox starts
    empty: moto's S3 outlives a deployment, and a ZIP an earlier one left (a round before, another pipeline's) would
    be new to this one's database, ingested again and counted in its figures."""
    import os

    from devstack.postgres import create_database, drop_database, with_database
    from devstack.topology import Topology
    from orchestration.definitions import build_definitions
    from redrive.db import dagster_storage_url

    clear_evidence_inbox(build_definitions(settings))

    full = {"DATABASE_URL": settings.database_url or "", "REDRIVE_TIME_SCALE": str(settings.redrive_time_scale),
            "CRITICIZER_SENSOR_INTERVAL_SECONDS": "5", "REVIEW_NOTIFICATIONS_SENSOR_INTERVAL_SECONDS": "5",
            **(env or {})}
    own = "DAGSTER_PG_URL" not in full
    admin, name = with_database(settings.database_url or "", "postgres"), f"dagster_{home.name}"
    saved = os.environ.get("DAGSTER_PG_URL")
    if own:
        drop_database(admin, name)
        create_database(admin, name)
        full["DAGSTER_PG_URL"] = os.environ["DAGSTER_PG_URL"] = dagster_storage_url(with_database(admin, name))
    try:
        with Topology(home=home, env=full, only=list(only), workers=workers) as topology:
            yield topology
    finally:
        if own:
            if saved is None:
                os.environ.pop("DAGSTER_PG_URL", None)
            else:
                os.environ["DAGSTER_PG_URL"] = saved
            drop_database(admin, name)


def clear_evidence_inbox(defs: Any) -> int:
    """Delete every object under the evidence S3 inbox; how many. The inbox is moto's, shared by every deployment of
    a bench session: a ZIP an earlier pipeline's load left there is a new file job to the next deployment's fresh
    database, whose inbox sensor ingests it and launches evidence runs in the middle of another pipeline's figures."""
    from assets.evidence.settings import EvidenceSettings
    from redrive.settings import Settings as Core

    client, evidence = defs.resources["s3"].get_client(), EvidenceSettings()
    bucket = evidence.bucket or Core().redrive_bucket
    deleted = 0
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=evidence.inbox_prefix):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
                deleted += len(keys)
    except client.exceptions.NoSuchBucket:
        return 0
    return deleted


def drop_evidence_zips(defs: Any, zips: list[tuple[str, bytes]],
                       notify_to: str = "merchant@example.com") -> list[tuple[str, str, str]]:
    """Put file-job ZIPs in the evidence S3 inbox (the inbox sensor takes it from there); (bucket, key, etag)s."""
    from assets.evidence.settings import EvidenceSettings
    from redrive.settings import Settings as Core
    from resources.aws import ensure_bucket

    client, evidence = defs.resources["s3"].get_client(), EvidenceSettings()
    bucket = evidence.bucket or Core().redrive_bucket
    ensure_bucket(client, bucket)
    dropped = []
    for name, data in zips:
        key = f"{evidence.inbox_prefix}{name}"
        put = client.put_object(Bucket=bucket, Key=key, Body=data, Metadata={"notify-to": notify_to})
        dropped.append((bucket, key, str(put["ETag"]).strip('"')))
    return dropped
