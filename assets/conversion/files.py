"""Uploaded PDFs and XML results on disk (003 §7 UPLOADS_DIR, RESULTS_DIR), written atomically.

Locations stored in the database are relative to these folders, so no server path ever reaches a
user, a log line or a dead letter, and the folders can move. A result is staged under a temporary
name and published with ``os.replace`` (atomic on POSIX) while the fenced completion holds the row
lock: a reader sees no result or the whole result, and one job has exactly one result file.

Staged files live in ``RESULTS_DIR/.staging`` (same file system, so the rename stays atomic): the
sweep for a killed worker's leftovers lists that folder, which holds only the results in flight,
instead of every result ever published (it runs every few seconds in every worker).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_ID = re.compile(r"^[0-9a-f-]{36}$")
_STAGED = re.compile(r"^\.([0-9a-f-]{36})\.xml\.e([0-9]+)\.[0-9]+\.tmp$")  # see stage_result
STAGING = ".staging"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    """``data`` in a new file, fsynced: four system calls (a buffered ``open`` adds fstat, ioctl and lseek, and
    every call lets go of the GIL, which the worker's slot threads then hand around: issue 14)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
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

    def __post_init__(self) -> None:
        self.uploads.mkdir(parents=True, exist_ok=True)
        self.staging.mkdir(parents=True, exist_ok=True)

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
        _write_synced(tmp, xml)
        return Staged(tmp, self.results / name, name)

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

    def result_present(self, location: str | None) -> bool:
        return bool(location) and self.result_path(location).is_file()  # type: ignore[arg-type]
