"""Pure decisions of the evidence pipeline (004): ids, manifest validation, rollups, attempt plans,
outcomes, notification gates and texts, and alert hysteresis. No I/O, no Dagster.

The retry decision itself is the core's (`redrive.budgets.decide` with `EVIDENCE_BACKOFF` and the
`EVIDENCE` vocabulary); this module only says which artifact gets which attempt and what its row
looks like afterwards.
"""

from __future__ import annotations

import csv
import hashlib
import io
import posixpath
import random
import uuid
import zipfile
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import IO, Literal
from uuid import UUID

from redrive.backoff import EVIDENCE_BACKOFF, BackoffPolicy
from redrive.budgets import decide
from redrive.failures import Failure
from redrive.vocabularies import evidence_category

# ------------------------------------------------------------------------------------------ vocabulary

PENDING, ATTACHED, FAILED = "PENDING", "ATTACHED", "FAILED"  # attachment_status (004 §1.1)
ATTACHMENT_STATUSES = (PENDING, ATTACHED, FAILED)
RETRY_SCHEDULED, RETRYING, RETRY_SUCCESS, RETRY_FAILED, PERMANENT_FAILED = (
    "RETRY_SCHEDULED", "RETRYING", "RETRY_SUCCESS", "RETRY_FAILED", "PERMANENT_FAILED")
RETRY_STATUSES = (PENDING, RETRY_SCHEDULED, RETRYING, RETRY_SUCCESS, RETRY_FAILED, PERMANENT_FAILED)
COMPLETED, PARTIALLY_FAILED = "COMPLETED", "PARTIALLY_FAILED"
ROW_EVIDENCE_STATUSES = (PENDING, COMPLETED, PARTIALLY_FAILED, FAILED)  # file_job_row.evidence_status (§1.2)
VALID, INVALID = "VALID", "INVALID"
RECEIVED, INGESTED, INGEST_FAILED = "RECEIVED", "INGESTED", "INGEST_FAILED"
FILE_JOB_STATUSES = (RECEIVED, INGESTED, INGEST_FAILED)

CORRUPTED_FILE, INVALID_FORMAT, S3_NOT_FOUND = "CORRUPTED_FILE", "INVALID_FORMAT", "S3_NOT_FOUND"
DATA_CATEGORY = "DATA"

# ----------------------------------------------------------------------------------------------- ids

NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://redrive.local/pipelines/evidence")
"""Every id derives from natural keys under this namespace (STYLE §6): a rerun writes the same rows."""


def file_job_id(bucket: str, key: str, etag: str) -> UUID:
    """One file job per uploaded object version: the same ZIP seen twice is one job, a re-upload a new one."""
    return uuid.uuid5(NAMESPACE, f"s3://{bucket}/{key}#{etag.strip(chr(34))}")


def row_id(job: UUID, line_no: int) -> UUID:
    return uuid.uuid5(NAMESPACE, f"{job}/row/{line_no}")


def artifact_id(row: UUID, index: int, name: str) -> UUID:
    return uuid.uuid5(NAMESPACE, f"{row}/artifact/{index}/{name}")


def initial_event_id(row: UUID) -> UUID:
    return uuid.uuid5(NAMESPACE, f"{row}/attach/initial")


def retry_event_id(row: UUID, retry_round: int) -> UUID:
    return uuid.uuid5(NAMESPACE, f"{row}/attach/retry/{retry_round}")


def notification_event_id(job: UUID, kind: str) -> UUID:
    return uuid.uuid5(NAMESPACE, f"{job}/notify/{kind}")


def notification_token(job: UUID, kind: str) -> str:
    """The mail provider's idempotency token for N1/N2 of a file job: one message per job and kind, ever."""
    return f"evidence:{job}:{kind}"


def row_entity(job: UUID | str, row: UUID | str) -> str:
    """How a row is named to the core (dead letters, replay): `<file job>/<row>`, partition first."""
    return f"{job}/{row}"


def partition_of(entity_ref: str) -> str:
    """The file job (dynamic partition key) of a row or file-job entity."""
    return entity_ref.split("/", 1)[0]


def split_row_entity(entity_ref: str) -> tuple[UUID, UUID]:
    job, _, row = entity_ref.partition("/")
    return UUID(job), UUID(row)


# ---------------------------------------------------------------------------------- manifest (ingest)

MANIFEST_NAME = "manifest.csv"
CASE_COLUMN, FILES_COLUMN = "case_id", "evidence_files"
FILE_SEPARATOR = ";"
MAX_CASE_REF = 200
_MAGIC: Mapping[str, tuple[bytes, ...]] = {
    "pdf": (b"%PDF-",),
    "png": (b"\x89PNG\r\n\x1a\n",),
    "jpg": (b"\xff\xd8\xff",),
    "jpeg": (b"\xff\xd8\xff",),
    "gif": (b"GIF87a", b"GIF89a"),
}
READ_CHUNK = 1 << 16  # members are read in chunks of this size, never whole
_EOCD, _EOCD_SIZE, _EOCD_SEARCH = b"PK\x05\x06", 22, 22 + 0xFFFF  # end record (+ a comment of up to 64 KiB)
_ZIP64_EOCD, _ZIP64_EOCD_SIZE, _ZIP64_LOCATOR_SIZE = b"PK\x06\x06", 56, 20
DIRECTORY_BYTES_PER_ENTRY = 1024  # a directory entry is 46 bytes and its name: room for long paths


class ArchiveRejected(Exception):
    """The whole archive cannot be read; `code` is 004's (CORRUPTED_FILE or INVALID_FORMAT)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ParsedFile:
    index: int
    name: str  # path inside the archive, normalised
    file_type: str | None
    size: int | None
    sha256: str | None
    error_code: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_code is None


@dataclass(frozen=True)
class ParsedRow:
    line_no: int
    case_ref: str
    case_id: UUID | None
    files: tuple[ParsedFile, ...] = ()
    error_code: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_code is None


@dataclass(frozen=True)
class ParsedArchive:
    rows: tuple[ParsedRow, ...]

    @property
    def artifact_count(self) -> int:
        return sum(len(r.files) for r in self.rows)

    def error_counts(self) -> dict[str, int]:
        codes = [r.error_code for r in self.rows if r.error_code]
        codes += [f.error_code for r in self.rows for f in r.files if f.error_code]
        return dict(sorted(Counter(codes).items()))


def normalise_member(name: str) -> str | None:
    """A member path relative to the archive root, or None when it would leave the archive."""
    name = name.replace("\\", "/").strip()
    if not name or name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return None
    clean = posixpath.normpath(name)
    if clean == ".." or clean.startswith("../") or clean == ".":
        return None
    return clean


def _file_type(name: str) -> str | None:
    base = posixpath.basename(name)
    return base.rsplit(".", 1)[1].lower() if "." in base.strip(".") else None


class MemberTooLarge(Exception):
    """A member decompressed to more bytes than its limit allows (whatever its header declared)."""


class _Bounded(io.RawIOBase):
    """A member's decompressed stream that raises `MemberTooLarge` past `limit` bytes.

    `zipfile` stops at the size the central directory declares, so a lying header ends in a CRC
    error; counting here as well keeps the bound ours rather than an implementation detail.
    """

    def __init__(self, raw: IO[bytes], limit: int) -> None:
        self._raw, self._limit, self.size = raw, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self._raw.read(min(len(buffer), READ_CHUNK))
        self.size += len(data)
        if self.size > self._limit:
            raise MemberTooLarge(f"more than {self._limit} bytes")
        buffer[: len(data)] = data
        return len(data)


def read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes:
    """A member's bytes, refused (`MemberTooLarge`) before its declared or actual size passes `limit`."""
    if info.file_size > limit:
        raise MemberTooLarge(f"declares {info.file_size} bytes")
    with zf.open(info) as member:
        return _Bounded(member, limit).readall()


def _digest_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> tuple[str, int, bytes]:
    """sha256, size and first bytes of a member, streaming in chunks; raises on CRC or decompression
    errors and `MemberTooLarge` past `limit`."""
    sha = hashlib.sha256()
    head = b""
    with zf.open(info) as member:
        stream = _Bounded(member, limit)
        while chunk := stream.read(READ_CHUNK):
            if len(head) < 16:
                head += chunk[: 16 - len(head)]
            sha.update(chunk)
    return sha.hexdigest(), stream.size, head


def _parse_file(zf: zipfile.ZipFile, members: Mapping[str, zipfile.ZipInfo], index: int, raw: str, seen: set[str],
                file_types: frozenset[str], max_file_bytes: int) -> ParsedFile:
    name = normalise_member(raw)
    if name is None:
        return ParsedFile(index, raw[:255] or "?", None, None, None, INVALID_FORMAT, "file path leaves the archive")
    file_type = _file_type(name)
    if name in seen:
        return ParsedFile(index, name, file_type, None, None, INVALID_FORMAT, "file listed twice in this row")
    seen.add(name)
    if file_type is None or file_type not in file_types:
        return ParsedFile(index, name, file_type, None, None, INVALID_FORMAT,
                          f"file type {'.' + file_type if file_type else '(none)'} is not accepted")
    info = members.get(name)
    if info is None:
        return ParsedFile(index, name, file_type, None, None, S3_NOT_FOUND, "file is not in the uploaded archive")
    if info.file_size > max_file_bytes:
        return ParsedFile(index, name, file_type, info.file_size, None, INVALID_FORMAT,
                          f"file is larger than {max_file_bytes} bytes")
    try:
        sha, size, head = _digest_member(zf, info, max_file_bytes)
    except MemberTooLarge:
        return ParsedFile(index, name, file_type, None, None, INVALID_FORMAT,
                          f"file is larger than {max_file_bytes} bytes")
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError) as exc:
        return ParsedFile(index, name, file_type, info.file_size, None, CORRUPTED_FILE,
                          f"file cannot be decompressed ({type(exc).__name__})")
    if size == 0:
        return ParsedFile(index, name, file_type, 0, sha, CORRUPTED_FILE, "file is empty")
    magic = _MAGIC.get(file_type)
    if magic and not head.startswith(magic):
        return ParsedFile(index, name, file_type, size, sha, CORRUPTED_FILE, f"content is not a valid .{file_type} file")
    return ParsedFile(index, name, file_type, size, sha)


@dataclass(frozen=True)
class ArchiveLimits:
    """How much of a file job's ZIP ingest reads (EVIDENCE_* settings; 004 names no figures).

    Each bounds memory or work whatever the archive: the directory (`zipfile` holds one object per
    entry), the manifest (streamed, never read whole), the rows and files it names, and every member
    (declared and actual size). Crossing one rejects the archive as INVALID_FORMAT, saying which.
    """

    max_file_bytes: int = 25 * 1024 * 1024
    max_archive_bytes: int = 1024 * 1024 * 1024
    max_manifest_bytes: int = 4 * 1024 * 1024
    max_manifest_rows: int = 10_000
    max_named_files: int = 20_000
    max_members: int = 20_000


def zip_directory(fp: IO[bytes]) -> tuple[int, int] | None:
    """(entries, bytes) of the central directory as the ZIP's end record declares them, read from the
    tail before `zipfile` builds a ZipInfo per entry (it reads as many bytes as declared, whatever the
    entry count says); None when there is no end record, which `zipfile` then rejects."""
    fp.seek(0, io.SEEK_END)
    size = fp.tell()
    fp.seek(max(0, size - _EOCD_SEARCH))
    tail = fp.read()
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < _EOCD_SIZE:
        return None
    entries = int.from_bytes(tail[at + 10:at + 12], "little")
    directory = int.from_bytes(tail[at + 12:at + 16], "little")
    if entries != 0xFFFF and directory != 0xFFFFFFFF:
        return entries, directory
    record = tail[max(0, at - _ZIP64_LOCATOR_SIZE - _ZIP64_EOCD_SIZE):max(0, at - _ZIP64_LOCATOR_SIZE)]
    if len(record) == _ZIP64_EOCD_SIZE and record[:4] == _ZIP64_EOCD:  # where `zipfile` looks for it too
        return int.from_bytes(record[32:40], "little"), int.from_bytes(record[40:48], "little")
    return entries, directory


def parse_archive(source: bytes | IO[bytes], *, file_types: frozenset[str], limits: ArchiveLimits) -> ParsedArchive:
    """Validate a file job's ZIP: a manifest row per dispute case, each naming its evidence files.

    Only a problem with the archive as a whole raises (`ArchiveRejected`); a malformed row or a bad
    file becomes that row's or file's error code, so nothing the merchant sent is silently dropped.
    Memory is bounded by `limits`, not by the archive: members and the manifest are streamed.
    """
    lim = limits
    fp = io.BytesIO(source) if isinstance(source, bytes | bytearray) else source
    try:
        directory = zip_directory(fp)
        if directory is not None and (directory[0] > lim.max_members
                                      or directory[1] > lim.max_members * DIRECTORY_BYTES_PER_ENTRY):
            raise ArchiveRejected(INVALID_FORMAT, f"the archive has more than {lim.max_members} entries")
        zf = zipfile.ZipFile(fp)
        infos = [i for i in zf.infolist() if not i.is_dir()]
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, OSError) as exc:
        raise ArchiveRejected(CORRUPTED_FILE, f"the upload is not a readable ZIP archive ({type(exc).__name__})") from exc
    if len(infos) > lim.max_members:
        raise ArchiveRejected(INVALID_FORMAT, f"the archive has more than {lim.max_members} entries")
    if sum(i.file_size for i in infos) > lim.max_archive_bytes:
        raise ArchiveRejected(INVALID_FORMAT, f"the archive expands to more than {lim.max_archive_bytes} bytes")
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = normalise_member(info.filename)
        if name is not None:
            members.setdefault(name, info)
    manifest = next((m for n, m in members.items() if n.lower() == MANIFEST_NAME), None)
    if manifest is None:
        raise ArchiveRejected(INVALID_FORMAT, f"the archive has no {MANIFEST_NAME} at its root")
    too_big = ArchiveRejected(INVALID_FORMAT, f"{MANIFEST_NAME} is larger than {lim.max_manifest_bytes} bytes")
    if manifest.file_size > lim.max_manifest_bytes:
        raise too_big
    try:
        with zf.open(manifest) as raw:
            text = io.TextIOWrapper(io.BufferedReader(_Bounded(raw, lim.max_manifest_bytes)),
                                    encoding="utf-8-sig", newline="")
            return ParsedArchive(tuple(_parse_manifest(zf, members, text,
                                                       frozenset(file_types), lim)))
    except MemberTooLarge as exc:
        raise too_big from exc
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ArchiveRejected(CORRUPTED_FILE, f"{MANIFEST_NAME} cannot be decompressed") from exc
    except UnicodeDecodeError as exc:
        raise ArchiveRejected(INVALID_FORMAT, f"{MANIFEST_NAME} is not UTF-8 text") from exc


def _parse_manifest(zf: zipfile.ZipFile, members: Mapping[str, zipfile.ZipInfo], text: IO[str],
                    file_types: frozenset[str], lim: ArchiveLimits) -> Iterator[ParsedRow]:
    """The manifest's rows as they are read; the stream under `text` stops at the manifest's limit."""
    reader = csv.reader(text)
    try:
        header = [h.strip().lower() for h in next(reader)]
    except StopIteration:
        raise ArchiveRejected(INVALID_FORMAT, f"{MANIFEST_NAME} is empty") from None
    except csv.Error as exc:
        raise ArchiveRejected(INVALID_FORMAT, f"{MANIFEST_NAME} header is not CSV") from exc
    if CASE_COLUMN not in header or FILES_COLUMN not in header:
        raise ArchiveRejected(INVALID_FORMAT, f"{MANIFEST_NAME} needs the columns {CASE_COLUMN} and {FILES_COLUMN}")
    case_at, files_at = header.index(CASE_COLUMN), header.index(FILES_COLUMN)
    rows = named = 0
    while True:
        try:
            record = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:  # e.g. a NUL byte: the line is malformed, the next one may be fine
            record = None
            row = ParsedRow(reader.line_num, "", None, (), INVALID_FORMAT, f"line is not valid CSV ({exc})"[:200])
        if record is not None:
            if not any(cell.strip() for cell in record):
                continue  # blank lines are not rows
            if files_at < len(record):
                named += record[files_at].count(FILE_SEPARATOR) + 1
            if named > lim.max_named_files:
                raise ArchiveRejected(INVALID_FORMAT, f"{MANIFEST_NAME} names more than {lim.max_named_files} files")
            row = _parse_row(zf, members, reader.line_num, record, len(header), case_at, files_at,
                             file_types, lim.max_file_bytes)
        rows += 1
        if rows > lim.max_manifest_rows:
            raise ArchiveRejected(INVALID_FORMAT, f"{MANIFEST_NAME} has more than {lim.max_manifest_rows} rows")
        yield row


def _parse_row(zf: zipfile.ZipFile, members: Mapping[str, zipfile.ZipInfo], line_no: int, record: list[str],
               width: int, case_at: int, files_at: int, file_types: frozenset[str], max_file_bytes: int) -> ParsedRow:
    case_ref = (record[case_at].strip() if case_at < len(record) else "")[:MAX_CASE_REF]
    if len(record) != width:
        return ParsedRow(line_no, case_ref, None, (), INVALID_FORMAT, f"expected {width} fields, got {len(record)}")
    try:
        case_id = UUID(case_ref)
    except ValueError:
        return ParsedRow(line_no, case_ref, None, (), INVALID_FORMAT, "case_id is not a UUID")
    names = [n.strip() for n in record[files_at].split(FILE_SEPARATOR) if n.strip()]
    if not names:
        return ParsedRow(line_no, case_ref, case_id, (), INVALID_FORMAT, "no evidence files named")
    seen: set[str] = set()
    files = tuple(_parse_file(zf, members, i, n, seen, file_types, max_file_bytes) for i, n in enumerate(names))
    return ParsedRow(line_no, case_ref, case_id, files)


# -------------------------------------------------------------------------------------- row rollups


@dataclass(frozen=True)
class RowCounts:
    """Artifact facts of one row (004 §1.2 derives the row's status from them)."""

    total: int
    attached: int
    failed: int  # attachment_status FAILED, retryable or not
    in_flight: int  # neither ATTACHED nor PERMANENT_FAILED


def row_evidence_status(counts: RowCounts, *, row_valid: bool = True) -> str:
    """004 §1.2: COMPLETED when all attached, FAILED when all failed, PARTIALLY_FAILED when some failed.

    Where 004 says "PARTIALLY_FAILED otherwise" we keep PENDING while nothing has failed yet (a row
    still being attached has not failed), and a malformed row with no artifacts is FAILED.
    """
    if not row_valid or counts.total == 0:
        return FAILED
    if counts.attached == counts.total:
        return COMPLETED
    if counts.failed == counts.total:
        return FAILED
    if counts.failed > 0:
        return PARTIALLY_FAILED
    return PENDING


# ------------------------------------------------------------------------------------ attempt plans


@dataclass(frozen=True)
class ArtifactState:
    """One artifact as the worker reads it under its row's lock."""

    id: UUID
    file_job_id: UUID
    file_job_row_id: UUID
    case_id: UUID
    file_name: str
    s3_key: str
    content_sha256: str | None
    attachment_status: str
    attachment_error_code: str | None
    attempt_count: int
    retry_count: int
    retry_status: str
    next_retry_at: datetime | None
    attempt_started_at: datetime | None


@dataclass(frozen=True)
class PlannedAttempt:
    artifact: ArtifactState
    attempt: int  # 1-based number of the attempt about to be made
    lookup_first: bool  # a recorded attempt exists: ask the case API before attaching again


Mode = Literal["initial", "retry", "replay"]


def plan_attempts(artifacts: Iterable[ArtifactState], *, named: set[UUID], mode: Mode, now: datetime,
                  max_attempts: int) -> list[PlannedAttempt]:
    """004 §4 Rule 0 and Option A: of the artifacts an event names, which to attempt now.

    Skipped: ATTACHED (done), PERMANENT_FAILED (final; only an operator's replay reopens the
    non-DATA ones), and retryable failures whose `next_retry_at` has not come (each artifact keeps
    its own backoff even when its row is requeued for a sibling). An artifact with a recorded attempt
    — a finished one, or one whose outcome was never written (`attempt_started_at`) — is looked up at
    the case API first: that closes the "attached, but the database write failed" race that a
    database-only check cannot see.
    """
    planned = []
    for a in artifacts:
        if a.id not in named or a.attachment_status == ATTACHED:
            continue
        in_doubt = a.attempt_started_at is not None
        if mode == "replay":
            eligible = in_doubt or (a.retry_status == PERMANENT_FAILED
                                    and evidence_category(a.attachment_error_code) != DATA_CATEGORY)
        elif a.retry_status == PERMANENT_FAILED or a.attempt_count >= max_attempts:
            eligible = False
        else:
            eligible = (in_doubt or a.attempt_count == 0 or a.retry_status in (RETRY_SCHEDULED, RETRYING)
                        or (a.retry_status == RETRY_FAILED and a.next_retry_at is not None and a.next_retry_at <= now))
        if eligible:
            planned.append(PlannedAttempt(a, a.attempt_count + 1, in_doubt or a.attempt_count >= 1))
    return planned


@dataclass(frozen=True)
class AttemptOutcome:
    """What the case API said for one artifact: attached (possibly found by lookup), or a classified failure."""

    attachment_id: str | None = None
    failure: Failure | None = None
    recovered_by_lookup: bool = False

    @property
    def attached(self) -> bool:
        return self.failure is None


@dataclass(frozen=True)
class ArtifactWrite:
    """The artifact's new lifecycle, retry and error fields after one attempt (004 §4)."""

    artifact_id: UUID
    attachment_status: str
    attachment_error_code: str | None
    attachment_error_message: str | None
    attached_at: datetime | None
    case_attachment_id: str | None
    attempt_count: int
    retry_count: int
    retry_status: str
    next_retry_at: datetime | None
    last_retry_at: datetime | None  # None: leave as it is
    final: bool
    reason: str
    decided_at: datetime


def decide_write(planned: PlannedAttempt, outcome: AttemptOutcome, *, now: datetime, rng: random.Random,
                 time_scale: float, max_attempts: int, replay: bool = False,
                 backoff: BackoffPolicy = EVIDENCE_BACKOFF) -> ArtifactWrite:
    """Attempt N's outcome → the row to write. `retry_count` counts attempts after the initial, so
    004's generated `is_retryable` (category NETWORK/SYSTEM and retry_count < 2) agrees with the
    core's decision at 3 attempts: a retry is scheduled exactly when `is_retryable` stays true.
    """
    n = planned.attempt
    last_retry_at = now if n > 1 else None
    if outcome.attached:
        return ArtifactWrite(planned.artifact.id, ATTACHED, None, None, now, outcome.attachment_id, n, n - 1,
                             RETRY_SUCCESS if n > 1 else PENDING, None, last_retry_at, True,
                             "recovered_by_lookup" if outcome.recovered_by_lookup else "attached", now)
    failure = outcome.failure
    assert failure is not None
    if replay:  # an operator's extra attempt: no automatic retries after it
        retry, delay, reason = False, 0.0, "replay_failed"
    else:
        decision = decide(failure, n, max_attempts, backoff, rng)
        retry, delay, reason = decision.retry, decision.delay, decision.reason
    return ArtifactWrite(
        planned.artifact.id, FAILED, failure.code, failure.message[:500], None, None, n, n - 1,
        RETRY_FAILED if retry else PERMANENT_FAILED,
        now + timedelta(seconds=delay * time_scale) if retry else None,
        last_retry_at, not retry, reason, now,
    )


# ------------------------------------------------------------------------------ notifications (§5)


@dataclass(frozen=True)
class FailedArtifact:
    artifact_id: UUID
    case_ref: str
    file_name: str
    error_code: str
    final: bool


@dataclass(frozen=True)
class JobFacts:
    """What the N1/N2 gates and texts need of one file job, read under the file job's lock."""

    file_job_id: UUID
    status: str
    source_name: str
    total: int
    attempted_or_final: int  # attempt_count >= 1, or closed without an attempt (rejected at ingest)
    attached: int
    in_flight: int
    recovered_by_retry: int
    invalid_rows: int
    failed: tuple[FailedArtifact, ...] = ()
    n1_requested: bool = False
    n2_requested: bool = False
    error_code: str | None = None


def n1_due(facts: JobFacts) -> bool:
    """004 §5 N1 gate: every artifact has had an attempt (or was rejected at ingest, which is its attempt)."""
    if facts.n1_requested or facts.status == RECEIVED:
        return False
    return facts.attempted_or_final == facts.total


def n2_due(facts: JobFacts, *, n1_requested: bool) -> bool:
    """004 §5 N2 gate (event-based): N1 is out and no retryable artifact is still in flight."""
    return n1_requested and not facts.n2_requested and facts.in_flight == 0 and facts.status != RECEIVED


def n2_forced_due(n1_sent_at: datetime | None, n2_requested: bool, now: datetime, timeout: timedelta) -> bool:
    """004 §5 timeout safeguard: N2 goes out `timeout` after N1 whatever the state."""
    return n1_sent_at is not None and not n2_requested and now >= n1_sent_at + timeout


def summary_of(facts: JobFacts) -> dict[str, object]:
    """The summary both notifications carry (NotificationSummary's fields)."""
    final = [f for f in facts.failed if f.final]
    return {
        "total": facts.total,
        "attached": facts.attached,
        "failed": len(facts.failed),
        "in_retry": facts.in_flight,
        "permanent_failed": len(final),
        "recovered_by_retry": facts.recovered_by_retry,
        "invalid_rows": facts.invalid_rows,
        "by_error_code": dict(sorted(Counter(f.error_code for f in facts.failed).items())),
        "cannot_retry": [
            {"artifact_id": str(f.artifact_id), "case_ref": f.case_ref, "file_name": f.file_name,
             "error_code": f.error_code, "error_category": evidence_category(f.error_code)}
            for f in sorted(final, key=lambda f: (f.case_ref, f.file_name, str(f.artifact_id)))
        ],
    }


def _breakdown(by_code: Mapping[str, int]) -> list[str]:
    return [f"  - {code}: {count}" for code, count in by_code.items()]


def render_n1(facts: JobFacts) -> tuple[str, str]:
    """N1: the first pass's success/failure breakdown and the retry promise."""
    s = summary_of(facts)
    subject = f"Evidence upload {facts.source_name}: {s['attached']} of {s['total']} files attached"
    lines = [f"Your evidence upload {facts.source_name} (file job {facts.file_job_id}) has had its first pass.",
             f"Attached: {s['attached']} of {s['total']} files."]
    if facts.error_code:
        lines.append(f"The archive could not be processed: {facts.error_code}.")
    if s["invalid_rows"]:
        lines.append(f"Manifest rows that could not be read: {s['invalid_rows']}.")
    if s["failed"]:
        lines.append(f"Not attached yet: {s['failed']}, by reason:")
        lines += _breakdown(s["by_error_code"])  # type: ignore[arg-type]
    if facts.in_flight:
        lines.append(f"We retry the {facts.in_flight} files that failed for a temporary reason automatically "
                     "and will send a final summary when retries are done.")
    return subject, "\n".join(lines)


def render_n2(facts: JobFacts, *, forced: bool, forced_closed: int = 0) -> tuple[str, str]:
    """N2: the final summary; permanent failures are listed as "Cannot Retry" (004 §5, §7)."""
    s = summary_of(facts)
    subject = f"Evidence upload {facts.source_name}: final result, {s['attached']} of {s['total']} files attached"
    lines = [f"Final result for your evidence upload {facts.source_name} (file job {facts.file_job_id}).",
             f"Attached: {s['attached']} of {s['total']} files ({s['recovered_by_retry']} after a retry).",
             f"Failed for good: {s['permanent_failed']}."]
    if facts.error_code:
        lines.append(f"The archive could not be processed: {facts.error_code}. Please upload a new archive.")
    if s["invalid_rows"]:
        lines.append(f"Manifest rows that could not be read: {s['invalid_rows']}.")
    if forced:
        lines.append(f"This summary was sent at the retry deadline; {forced_closed} files still being retried "
                     "were closed as failed.")
    if s["cannot_retry"]:
        lines.append("Cannot Retry (please send these again in a new upload):")
        for item in s["cannot_retry"]:  # type: ignore[attr-defined]
            lines.append(f"  - case {item['case_ref']}: {item['file_name']}: {item['error_code']}")
    if s["by_error_code"]:
        lines.append("Failures by reason:")
        lines += _breakdown(s["by_error_code"])  # type: ignore[arg-type]
    return subject, "\n".join(lines)


# --------------------------------------------------------------------------- dead letters per row


def row_final_code(failed_codes: Sequence[str]) -> tuple[str, int] | None:
    """The code a row's dead letter carries, or None when the row needs no operator.

    Final DATA failures (CORRUPTED_FILE, INVALID_FORMAT, S3_NOT_FOUND) are the merchant's to fix with
    a new upload; N2 reports them as "Cannot Retry" and the permanent-failure-rate alert counts them,
    but no replay could help, so they are not dead-lettered. The other final failures (case gone,
    credentials, retries exhausted) are: the most frequent code names the letter.
    """
    ops = Counter(c for c in failed_codes if evidence_category(c) != DATA_CATEGORY)
    if not ops:
        return None
    code, count = min(ops.items(), key=lambda kv: (-kv[1], kv[0]))
    return code, count


# ----------------------------------------------------------------------------------- alerts (§6)


@dataclass(frozen=True)
class AlertState:
    name: str
    firing: bool = False
    episode: int = 0
    condition_since: datetime | None = None


@dataclass(frozen=True)
class AlertCheck:
    name: str
    condition: bool
    summary: str
    sustain_seconds: float = 0.0


@dataclass(frozen=True)
class AlertStep:
    state: AlertState
    fire: bool


def step_alert(state: AlertState | None, check: AlertCheck, now: datetime) -> AlertStep:
    """Hysteresis: an alert fires once per episode (condition held for `sustain_seconds`), and a
    new episode starts only after the condition cleared. The episode number, not the clock, goes
    into the dedupe key."""
    current = state or AlertState(check.name)
    if not check.condition:
        return AlertStep(AlertState(check.name, False, current.episode, None), False)
    since = current.condition_since or now
    if current.firing:
        return AlertStep(AlertState(check.name, True, current.episode, since), False)
    if (now - since).total_seconds() >= check.sustain_seconds:
        return AlertStep(AlertState(check.name, True, current.episode + 1, since), True)
    return AlertStep(AlertState(check.name, False, current.episode, since), False)


@dataclass(frozen=True)
class Thresholds:
    permanent_rate: float
    permanent_min_sample: int
    queue_depth: int
    queue_depth_sustain_seconds: float
    n2_avg_latency_seconds: float
    heartbeat_seconds: float


@dataclass(frozen=True)
class MetricsView:
    """The numbers §6's alerts read (a subset of the snapshot)."""

    finished: int
    permanent_failed: int
    queue_depth_artifacts: int
    n2_latency_avg_seconds: float | None
    heartbeat_age_seconds: float | None
    active_file_jobs: int
    permanent_by_code: Mapping[str, int] = field(default_factory=dict)


def alert_checks(m: MetricsView, t: Thresholds) -> list[AlertCheck]:
    rate = m.permanent_failed / m.finished if m.finished else 0.0
    heartbeat_missing = (m.heartbeat_age_seconds is None and m.active_file_jobs > 0) or (
        m.heartbeat_age_seconds is not None and m.heartbeat_age_seconds > t.heartbeat_seconds)
    codes = ", ".join(f"{c}×{n}" for c, n in sorted(m.permanent_by_code.items())) or "-"
    return [
        AlertCheck("permanent_failure_rate", m.finished >= t.permanent_min_sample and rate > t.permanent_rate,
                   f"{rate:.0%} of {m.finished} evidence files finished in the last hour failed for good "
                   f"(threshold {t.permanent_rate:.0%}); by code: {codes}"),
        AlertCheck("retry_queue_depth", m.queue_depth_artifacts > t.queue_depth,
                   f"{m.queue_depth_artifacts} evidence files wait for a retry (threshold {t.queue_depth})",
                   t.queue_depth_sustain_seconds),
        AlertCheck("n2_latency", m.n2_latency_avg_seconds is not None
                   and m.n2_latency_avg_seconds > t.n2_avg_latency_seconds,
                   f"N1→N2 took {(m.n2_latency_avg_seconds or 0) / 3600:.1f} h on average over the last day "
                   f"(SLA {t.n2_avg_latency_seconds / 3600:.1f} h)"),
        AlertCheck("scheduler_heartbeat", heartbeat_missing,
                   "the evidence retry scheduler has not ticked for "
                   + (f"{m.heartbeat_age_seconds / 60:.0f} min" if m.heartbeat_age_seconds is not None else "ever")
                   + f" (threshold {t.heartbeat_seconds / 60:.0f} min); retries are not being requeued"),
    ]
