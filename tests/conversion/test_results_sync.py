"""RESULTS_SYNC (issue 14): a turn's results are made durable by one syncfs before any of them is written done;
a failed write the file system reports stops the worker, publishes nothing and loses no job."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from assets.conversion import files as files_module
from assets.conversion.files import FileStore, ResultsNotDurable
from assets.conversion.settings import ConversionSettings, file_store
from redrive import logs
from tests.conversion.conftest import events, files_under, job

pytestmark = pytest.mark.skipif(files_module._syncfs_call() is None,
                                reason="syncfs reports writeback errors on Linux 5.8+ only")


class FileSystem:
    """The real syncfs, watched: what was staged at each call; ``failing`` makes it report EIO instead."""

    def __init__(self, staging: Callable[[], Path]) -> None:
        self.real = files_module._syncfs_call()
        self.staging = staging
        self.failing = False
        self.seen: list[set[str]] = []  # the staged files present at each call

    def __call__(self, fd: int) -> int:
        self.seen.append(set(os.listdir(self.staging())))
        if self.failing:
            ctypes.set_errno(errno.EIO)
            return -1
        return self.real(fd)  # type: ignore[operator]


@pytest.fixture
def filesystem(monkeypatch, conv_settings: ConversionSettings) -> FileSystem:
    fs = FileSystem(lambda: conv_settings.results_dir / ".staging")
    monkeypatch.setattr(files_module, "_syncfs_call", lambda: fs)
    return fs


@pytest.fixture
def files(conv_settings: ConversionSettings, filesystem: FileSystem) -> FileStore:
    return file_store(conv_settings)


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """Paths passed to os.fsync."""
    paths: list[str] = []
    real = os.fsync

    def watched(fd: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", watched)
    return paths


def test_a_turns_results_are_made_durable_by_one_syncfs_before_they_are_published(
        engine, files, filesystem, fsynced, submit, make_worker, conv_settings, caplog) -> None:
    """No staged result is fsynced on its own; every published result was on disk in `.staging` when a syncfs ran,
    so the flush came before its rename and its COMMIT. Fewer syncfs calls than jobs: one covers a turn."""
    caplog.set_level(logging.INFO, logger="redrive.conversion.worker")
    ids = [submit() for _ in range(12)]
    fsynced.clear()  # the uploads' own fsyncs
    worker = make_worker(settings=conv_settings.model_copy(update={"worker_concurrency": 12}))
    assert files.turn_sync
    assert worker.step() == "processed"

    assert {job(engine, i).status for i in ids} == {"succeeded"}
    assert files_under(files.results) == sorted(f"{i}.xml" for i in ids)
    assert not [p for p in fsynced if "/.staging/" in p]  # the per-file fsync is gone
    assert fsynced and all(p == str(files.results) for p in fsynced)  # the renames' folder fsync stays
    covered = {name.split(".")[1] for staged in filesystem.seen for name in staged}
    assert covered == set(ids)
    assert 1 <= len(filesystem.seen) < len(ids)
    started = [logs.record_fields(r) for r in caplog.records if r.getMessage() == "worker_started"]
    assert started == [] or started[0]["results_sync"] == "turn"


def test_a_failed_write_reported_by_syncfs_stops_the_worker_publishes_nothing_and_loses_no_job(
        engine, files, filesystem, submit, make_worker, conv_settings, reliability, caplog) -> None:
    """Which staged result failed is unknown and the kernel may have dropped its pages, so no result staged
    before the error may be published, not even after a later syncfs succeeds (sticky). The worker gives its
    leases back with their attempt, says so at CRITICAL, and raises; a restarted worker converts every job."""
    caplog.set_level(logging.INFO, logger="redrive.conversion.worker")
    ids = [submit() for _ in range(3)]
    filesystem.failing = True
    worker = make_worker(settings=conv_settings.model_copy(update={"worker_concurrency": 4}))
    with pytest.raises(ResultsNotDurable):
        worker.run(max_jobs=3)  # bounded: a regression that never raises ends here, not in a timeout

    for i in ids:
        row = job(engine, i)
        assert (row.status, row.attempt_count, row.result_location) == ("queued", 0, None)
        assert events(engine, i)[-1] == "queued"
    assert [p for p in files_under(files.results) if not p.startswith(".staging/")] == []
    lines = {r.getMessage(): r for r in caplog.records}
    assert lines["results_not_durable"].levelno == logging.CRITICAL
    assert {logs.record_fields(r)["reason"] for r in caplog.records if r.getMessage() == "job_requeued"} \
        == {"results_not_durable"}

    filesystem.failing = False
    with pytest.raises(ResultsNotDurable):
        files.sync_staged()  # sticky: the error was reported once, and it still stands

    restarted = file_store(conv_settings)
    from assets.conversion.worker import JsonLog, Shutdown, Worker
    fresh = Worker(reliability, worker.gateway, restarted, conv_settings, worker_id="restarted",
                   shutdown=Shutdown(0), log=JsonLog("restarted"))
    while fresh.step() == "processed":
        pass
    assert {job(engine, i).status for i in ids} == {"succeeded"}
    fresh.sweep_staged()
    assert files_under(files.results) == sorted(f"{i}.xml" for i in ids)


def test_turn_falls_back_to_an_fsync_per_file_where_syncfs_does_not_report_errors(
        monkeypatch, tmp_path, fsynced) -> None:
    """Before Linux 5.8 syncfs returns 0 whatever writeback failed: a store asked for ``turn`` fsyncs each file."""
    monkeypatch.setattr(files_module.platform, "release", lambda: "5.4.0-150-generic")
    old = FileStore(tmp_path / "u", tmp_path / "r", "turn")
    assert not old.turn_sync
    staged = old.stage_result("00000000-0000-0000-0000-000000000001", 1, b"<document/>")
    assert str(staged.tmp) in fsynced

    monkeypatch.setattr(files_module.platform, "release", lambda: "6.1.0")
    assert FileStore(tmp_path / "u", tmp_path / "r2", "turn").turn_sync
    assert not FileStore(tmp_path / "u", tmp_path / "r3", "file").turn_sync


def test_a_dropped_store_closes_its_descriptor(tmp_path) -> None:
    """A store is built per worker run (Dagster) or per test: its syncfs descriptor goes with it, none piles up."""
    import gc

    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_descriptors()
    for i in range(20):
        store = FileStore(tmp_path / "u", tmp_path / f"r{i}", "turn")
        store.stage_result("00000000-0000-0000-0000-000000000001", 1, b"<document/>")
        store.sync_staged()
        del store
    gc.collect()
    assert open_descriptors() <= before
