"""Uploaded PDFs and XML results on disk (003 §7 UPLOADS_DIR, RESULTS_DIR), written atomically.

Locations stored in the database are relative to these folders, so no server path ever reaches a
user, a log line or a dead letter, and the folders can move. A result is staged under a temporary
name and published with ``os.replace`` (atomic on POSIX) while the fenced completion holds the row
lock: a reader sees no result or the whole result, and one job has exactly one result file.

Staged files live in ``RESULTS_DIR/.staging`` (same file system, so the rename stays atomic): the
sweep for a killed worker's leftovers lists that folder, which holds only the results in flight,
instead of every result ever published (it runs every few seconds in every worker).

A result is durable before its job is written ``succeeded``. How (``RESULTS_SYNC``): ``turn``, one
``syncfs(2)`` of the results' file system for all the results a worker's turn completes (issue 14: an
fsync per file cost the worker more kernel time than everything else it does); ``file``, an fsync per
staged result. ``turn`` needs Linux 5.8 or later, where syncfs reports the writeback errors it finds;
elsewhere a store asked for it fsyncs each file.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

_ID = re.compile(r"^[0-9a-f-]{36}$")
_STAGED = re.compile(r"^\.([0-9a-f-]{36})\.xml\.e([0-9]+)\.[0-9]+\.tmp$")  # see stage_result
STAGING = ".staging"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes, *, sync: bool = True) -> None:
    """``data`` in a new file, fsynced unless ``sync`` is off: four system calls (a buffered ``open`` adds fstat,
    ioctl and lseek, and every call lets go of the GIL, which the worker's slot threads then hand around: issue 14)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _read_all(path: Path) -> bytes:
    """A file's bytes with open, read and close only (see :func:`_write_synced`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_atomically(path: Path, data: bytes, tmp: Path) -> None:
    _write_synced(tmp, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


ResultsSync = Literal["turn", "file"]


class ResultsNotDurable(OSError):
    """The results' file system reported a failed write: which staged result it was is unknown, and the kernel
    may have dropped the data, so no result staged before it may ever be published (PostgreSQL's answer to a
    failed fsync, for the same reason). Sticky: the worker stops and gives its leases back; a restart starts
    clean. An OSError, so the core names it an I/O failure (``UNKNOWN``, retried by a Dagster op's policy with a
    new worker), not a bug."""


def _syncfs_call() -> object | None:
    """libc's ``syncfs`` where it reports writeback errors (Linux 5.8+), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        major, minor = (int(part) for part in re.findall(r"\d+", platform.release())[:2])
        if (major, minor) < (5, 8):
            return None
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (ValueError, OSError, AttributeError):
        return None


class FileSystemSync:
    """One ``syncfs(2)`` for every result staged so far, through a descriptor opened before this process staged
    its first one: the kernel reports to a descriptor every writeback error on its file system since it was
    opened (errseq), so no failed write of ours goes unseen, whichever thread or flush wrote it back."""

    def __init__(self, folder: Path, call: object | None) -> None:
        self.folder, self._call = folder, call
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid: int | None = None
        self._failed: str | None = None

    def arm(self) -> None:
        """Before a staged write: the descriptor must predate it (per process; a forked child opens its own)."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._fd, self._pid = os.open(self.folder, os.O_RDONLY), os.getpid()
                    weakref.finalize(self, os.close, self._fd)  # a store per worker run: no descriptor outlives it

    def sync(self) -> None:
        if self._failed is None and self._pid == os.getpid() and self._call(self._fd) != 0:  # type: ignore[operator]
            self._failed = os.strerror(ctypes.get_errno())
        if self._failed is not None:
            raise ResultsNotDurable(f"the results' file system reported a failed write ({self._failed})")


@dataclass(frozen=True)
class Staged:
    """A result written under a temporary name, not yet visible."""

    tmp: Path
    final: Path
    location: str


@dataclass(frozen=True)
class FileStore:
    uploads: Path
    results: Path
    sync: ResultsSync = "file"
    """RESULTS_SYNC asked for; :attr:`turn_sync` says whether it is in force."""
    _fs: FileSystemSync | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.uploads.mkdir(parents=True, exist_ok=True)
        self.staging.mkdir(parents=True, exist_ok=True)
        call = _syncfs_call() if self.sync == "turn" else None
        if call is not None:
            object.__setattr__(self, "_fs", FileSystemSync(self.staging, call))

    @property
    def turn_sync(self) -> bool:
        """Results are made durable per turn (:meth:`sync_staged`), not per file."""
        return self._fs is not None

    @property
    def staging(self) -> Path:
        return self.results / STAGING

    @staticmethod
    def _checked(job_id: str) -> str:
        if not _ID.match(job_id):  # ids are UUIDs; anything else must never become a path
            raise ValueError("not a job id")
        return job_id

    # -- sources --------------------------------------------------------------------------------------

    def save_source(self, job_id: str, pdf: bytes) -> str:
        name = f"{self._checked(job_id)}.pdf"
        _write_atomically(self.uploads / name, pdf, self.uploads / f".{name}.{os.getpid()}.tmp")
        return name

    def source_path(self, location: str) -> Path:
        return self.uploads / Path(location).name

    def source_present(self, location: str) -> bool:
        return self.source_path(location).is_file()

    def read_source(self, location: str) -> bytes:
        return _read_all(self.source_path(location))

    def delete_source(self, location: str) -> None:
        self.source_path(location).unlink(missing_ok=True)

    # -- results --------------------------------------------------------------------------------------

    def stage_result(self, job_id: str, epoch: int, xml: bytes) -> Staged:
        """Write the XML under a name of this lease's own; nothing is visible until :meth:`publish`."""
        name = f"{self._checked(job_id)}.xml"
        tmp = self.staging / f".{name}.e{epoch}.{os.getpid()}.tmp"
        if self._fs is not None:
            self._fs.arm()
        _write_synced(tmp, xml, sync=self._fs is None)
        return Staged(tmp, self.results / name, name)

    def sync_staged(self) -> None:
        """Every result staged so far is durable when this returns (with ``file``, each already was); raises
        :class:`ResultsNotDurable` for good once the file system has reported a failed write."""
        if self._fs is not None:
            self._fs.sync()

    def publish(self, staged: Staged) -> None:
        os.replace(staged.tmp, staged.final)
        _fsync_dir(staged.final.parent)

    def publish_all(self, staged: list[Staged]) -> None:
        """Publish a turn's results with one directory fsync; each rename stays atomic on its own.

        A result already published by the same lease (a turn retried after its COMMIT was lost in
        transit) is left as it is.
        """
        for item in staged:
            try:
                os.replace(item.tmp, item.final)
            except FileNotFoundError:
                if not item.final.exists():
                    raise
        if staged:
            _fsync_dir(self.results)

    def staged_files(self, *, legacy: bool = False) -> list[tuple[Path, str, int]]:
        """Staged results on disk as (path, job id, lease epoch): what a killed worker may have left.
        ``legacy``: also those staged in RESULTS_DIR itself, where workers before the staging folder put them."""
        found = []
        with os.scandir(self.staging) as entries:
            names = [(self.staging, e.name) for e in entries]
        if legacy:
            with os.scandir(self.results) as entries:
                names += [(self.results, e.name) for e in entries if e.name.endswith(".tmp")]
        for folder, name in names:
            match = _STAGED.match(name)
            if match:
                found.append((folder / name, match.group(1), int(match.group(2))))
        return found

    def discard(self, staged: Staged) -> None:
        staged.tmp.unlink(missing_ok=True)

    def result_path(self, location: str) -> Path:
        return self.results / Path(location).name

    def delete_result(self, location: str) -> None:
        self.result_path(location).unlink(missing_ok=True)

    def result_present(self, location: str | None) -> bool:
        return bool(location) and self.result_path(location).is_file()  # type: ignore[arg-type]
