"""Fixtures of the conversion tests: knobs on a temp folder, a worker on the test's database and the sandbox."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from assets.conversion import repository as repo
from assets.conversion.files import FileStore
from assets.conversion.settings import ConversionSettings, file_store
from assets.conversion.worker import JsonLog, Shutdown, Worker
from redrive.clock import FrozenClock
from redrive.reliability import Reliability
from redrive.settings import Settings
from resources.conversion import HttpGateway
from resources.factory import build_resources


def files_under(folder: Path) -> list[str]:
    """Every file below ``folder`` (published results and staged ones, ``.staging/…``), sorted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def make_pdf(text: str = "Hello") -> bytes:
    """A small, well-formed PDF whose page shows ``text`` (the sandbox's converter reads `(…) Tj`)."""
    stream = f"BT /F1 12 Tf 72 712 Td ({text}) Tj ET".encode()
    return (b"%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 2 0 R >> endobj\n"
            b"2 0 obj << /Type /Pages /Kids [3 0 R] /Count 1 >> endobj\n"
            b"3 0 obj << /Type /Page /Parent 2 0 R /Contents 4 0 R >> endobj\n"
            b"4 0 obj << /Length " + str(len(stream)).encode() + b" >> stream\n" + stream +
            b"\nendstream endobj\ntrailer << /Root 1 0 R >>\n%%EOF\n")


@pytest.fixture
def conv_settings(tmp_path: Path, stack) -> ConversionSettings:
    return ConversionSettings(
        uploads_dir=tmp_path / "uploads", results_dir=tmp_path / "results",
        gateway_url=f"{os.environ['SANDBOX_URL']}/pdf/v1", gateway_timeout_ms=3000,
        worker_lease_ttl_sec=2, worker_lease_extend_sec=0.5, worker_idle_sleep_sec=0.05,
        circuit_cooldown_ms=1000,
    )


@pytest.fixture
def files(conv_settings: ConversionSettings) -> FileStore:
    """The folders as a worker builds them, with the default RESULTS_SYNC (``turn``)."""
    return file_store(conv_settings)


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock()


@pytest.fixture
def reliability(settings: Settings, clock: FrozenClock) -> Reliability:
    """The core runtime on the test's database, alerting to the sandbox's Slack and mail; time frozen."""
    return build_resources(settings)["reliability"].runtime(clock)


@pytest.fixture
def make_worker(reliability: Reliability, files: FileStore,
                conv_settings: ConversionSettings) -> Iterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def build(*, settings: ConversionSettings | None = None, gateway=None, worker_id: str | None = None,
              runtime: Reliability | None = None) -> Worker:
        knobs = settings or conv_settings
        wid = worker_id or f"test-worker-{len(made) + 1}"
        worker = Worker(runtime or reliability, gateway or HttpGateway(knobs.gateway_base_url(Settings()),
                                                                       knobs.gateway_timeout_ms / 1000),
                        files, knobs, worker_id=wid, shutdown=Shutdown(knobs.worker_shutdown_grace_sec),
                        log=JsonLog(wid))
        made.append(worker)
        return worker

    yield build
    for w in made:
        w.gateway.close()


@pytest.fixture
def submit(engine: sa.Engine, files: FileStore, clock: FrozenClock) -> Callable[..., str]:
    """Queue a job as the API does (source file first, then the row and its `queued` event)."""

    def create(owner: str = "alice", pdf: bytes | None = None, name: str = "doc.pdf") -> str:
        body = pdf if pdf is not None else make_pdf(f"job {uuid.uuid4().hex[:8]}")
        job_id = str(uuid.uuid4())
        location = files.save_source(job_id, body)
        with engine.begin() as conn:
            repo.create(conn, repo.NewJob(job_id, owner, name, location, len(body),
                                          hashlib.sha256(body).hexdigest()), clock.now())
        return job_id

    return create


def job(engine: sa.Engine, job_id: str) -> repo.Job:
    with engine.connect() as conn:
        found = repo.get(conn, job_id)
    assert found is not None
    return found


def events(engine: sa.Engine, job_id: str) -> list[str]:
    with engine.connect() as conn:
        return [e["event"] for e in repo.events(conn, job_id)]
