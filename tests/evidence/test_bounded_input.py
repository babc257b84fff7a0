"""Issue 13 item 9: a file job's ZIP is read within limits, whatever it holds (zip bombs, lying headers,
huge directories), through the real ingest (moto S3, PostgreSQL). Memory is measured with tracemalloc."""

from __future__ import annotations

import io
import random
import tracemalloc
import zipfile
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from assets.evidence import policy, worker
from assets.evidence import repository as repo
from assets.evidence.settings import EvidenceOptions
from tests.evidence.helpers import case_uuid, make_zip, pdf, put_zip

MiB = 1024 * 1024
HEADER = b"case_id,evidence_files\n"
PEAK_LIMIT = 32 * MiB  # what the ingest may allocate for any of these archives; the manifest bomb cost 580 MiB


def bomb(name: str, size: int, *, head: bytes = HEADER, extra: dict[str, bytes] | None = None) -> bytes:
    """A ZIP whose member `name` inflates to `size` bytes (`head`, then 'x's); ~1000:1, written in chunks."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        with zf.open(name, "w") as member:
            member.write(head)
            chunk = b"x" * MiB
            for _ in range((size - len(head)) // MiB):
                member.write(chunk)
        for other, body in (extra or {}).items():
            zf.writestr(other, body)
    return buf.getvalue()


def lie_about_size(data: bytes, name: str, declared: int) -> bytes:
    """Rewrite `name`'s uncompressed size in its local header and its central directory entry."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        info = zf.getinfo(name)
    out = bytearray(data)
    out[info.header_offset + 22:info.header_offset + 26] = declared.to_bytes(4, "little")
    central = out.index(b"PK\x01\x02")
    while out[central + 46:central + 46 + len(name)] != name.encode():
        central = out.index(b"PK\x01\x02", central + 4)
    out[central + 24:central + 28] = declared.to_bytes(4, "little")
    return bytes(out)


def many_entries(count: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("manifest.csv", HEADER)
        for i in range(count):
            zf.writestr(f"e{i}", b"")
    return buf.getvalue()


@pytest.fixture
def options(bucket) -> EvidenceOptions:
    return EvidenceOptions(bucket=bucket, allowed_file_types="pdf,txt")


@pytest.fixture
def ingest_zip(runtime, s3, bucket, inbox, clock, engine) -> Callable[..., tuple[worker.IngestResult, sa.Row, int]]:
    """Upload `data` to moto, record its file job, and run the real ingest under tracemalloc."""

    def run(data: bytes, options: EvidenceOptions, name: str = "upload.zip"):
        etag = put_zip(s3, bucket, inbox + name, data)
        job_id = policy.file_job_id(bucket, inbox + name, etag)
        with engine.begin() as conn:
            job = repo.upsert_file_job(conn, job_id, bucket=bucket, key=inbox + name, etag=etag,
                                       notify_to="merchant@example.com", now=clock.now())
        del data
        tracemalloc.start()
        try:
            result = worker.ingest(runtime, s3, options, job)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        with engine.connect() as conn:
            row = conn.execute(sa.select(repo.file_job).where(repo.file_job.c.id == job_id)).one()
        return result, row, peak

    return run


def test_a_100_mib_manifest_in_a_small_zip_is_refused_unread(ingest_zip, options) -> None:
    """A ~100 KiB ZIP whose manifest inflates to 100 MiB: INVALID_FORMAT naming the limit, memory stays small."""
    data = bomb("manifest.csv", 100 * MiB)
    assert len(data) < 200 * 1024
    result, job, peak = ingest_zip(data, options)
    assert (result.status, job.status, job.error_code) == ("INGEST_FAILED", "INGEST_FAILED", "INVALID_FORMAT")
    assert job.error_message == f"manifest.csv is larger than {options.max_manifest_bytes} bytes"
    assert peak < PEAK_LIMIT, f"ingest allocated {peak / MiB:.0f} MiB at its peak"


def test_a_manifest_that_lies_about_its_size_is_stopped_at_the_declared_size(ingest_zip, options) -> None:
    """The directory says 100 bytes, the data inflates to 100 MiB: reading stops at the declared size and the
    CRC check names the archive CORRUPTED_FILE; nothing past the declared size is held."""
    data = lie_about_size(bomb("manifest.csv", 100 * MiB), "manifest.csv", 100)
    result, job, peak = ingest_zip(data, options)
    assert (job.status, job.error_code) == ("INGEST_FAILED", "CORRUPTED_FILE")
    assert peak < PEAK_LIMIT, f"ingest allocated {peak / MiB:.0f} MiB at its peak"


def test_an_evidence_file_bomb_is_that_files_error_and_the_rest_is_ingested(ingest_zip, options, s3, bucket) -> None:
    """A member inflating past EVIDENCE_MAX_FILE_BYTES is INVALID_FORMAT for that file only; one lying about
    its size is CORRUPTED_FILE; the good file is extracted; memory stays small."""
    good, case = pdf("good"), case_uuid("bomb", 1)
    manifest = HEADER + f"{case},good.pdf;big.pdf;liar.pdf\n".encode()
    data = bomb("big.pdf", 60 * MiB, head=b"%PDF-1.4\n", extra={"manifest.csv": manifest, "good.pdf": good})
    liar = bomb("liar.pdf", 60 * MiB, head=b"%PDF-1.4\n")
    buf = io.BytesIO(data)
    with zipfile.ZipFile(buf, "a", zipfile.ZIP_DEFLATED) as zf, zipfile.ZipFile(io.BytesIO(liar)) as src:
        with zf.open("liar.pdf", "w") as out, src.open("liar.pdf") as inp:
            while chunk := inp.read(MiB):
                out.write(chunk)
    data = lie_about_size(buf.getvalue(), "liar.pdf", 1000)
    limits = options.model_copy(update={"max_file_bytes": 10 * MiB})
    result, job, peak = ingest_zip(data, limits)
    assert job.status == "INGESTED" and result.errors == {"CORRUPTED_FILE": 1, "INVALID_FORMAT": 1}
    assert peak < PEAK_LIMIT, f"ingest allocated {peak / MiB:.0f} MiB at its peak"


@pytest.mark.parametrize("limit, data_of, says", [
    ({"max_members": 500}, lambda: many_entries(2000), "the archive has more than 500 entries"),
    ({"max_manifest_rows": 50}, lambda: make_zip([[case_uuid("r", i), "a.pdf"] for i in range(51)], {"a.pdf": pdf("a")}),
     "manifest.csv has more than 50 rows"),
    ({"max_named_files": 30}, lambda: make_zip([[case_uuid("n", 1), ";".join(f"f{i}.pdf" for i in range(31))]], {}),
     "manifest.csv names more than 30 files"),
    ({"max_zip_bytes": 10_000}, lambda: make_zip([], {"noise.txt": random.Random(1).randbytes(20_000)}),
     "the uploaded archive is larger than 10000 bytes"),
], ids=["entries", "rows", "named-files", "zip-bytes"])
def test_every_limit_ends_in_invalid_format_saying_which(ingest_zip, options, limit, data_of, says) -> None:
    """Each EVIDENCE_MAX_* setting refuses the archive as INVALID_FORMAT with a message naming the limit."""
    result, job, _ = ingest_zip(data_of(), options.model_copy(update=limit))
    assert (result.status, job.error_code, job.error_message) == ("INGEST_FAILED", "INVALID_FORMAT", says)


def test_a_huge_directory_is_refused_from_its_end_record_before_zipfile_reads_it() -> None:
    """66,000 entries (a ZIP64 end record): counted from the archive's tail, refused before one ZipInfo per entry
    is built (that alone would cost tens of MiB)."""
    data = many_entries(66_000)
    entries, directory = policy.zip_directory(io.BytesIO(data))
    assert entries == 66_001 and directory > 66_000 * 46
    tracemalloc.start()
    try:
        with pytest.raises(policy.ArchiveRejected, match="more than 20000 entries") as rejected:
            policy.parse_archive(data, file_types=frozenset({"pdf"}), limits=policy.ArchiveLimits())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rejected.value.code == "INVALID_FORMAT" and peak < 2 * MiB


def test_the_manifest_bomb_through_a_dagster_run_tells_the_merchant(driver, engine, s3, bucket, inbox, sandbox) -> None:
    """Through the sensor and the ingest run: the run succeeds, the job is INGEST_FAILED, N1 and N2 are requested."""
    etag = put_zip(s3, bucket, inbox + "bomb.zip", bomb("manifest.csv", 100 * MiB))
    job_id = policy.file_job_id(bucket, inbox + "bomb.zip", etag)
    [request] = driver.tick("evidence_inbox")
    assert driver.launch(request).success
    with engine.connect() as conn:
        job = repo.get_file_job(conn, job_id)
        kinds = [e.payload["kind"] for e in repo.notification_events(conn, job_id)]
    assert (job.status, job.error_code) == ("INGEST_FAILED", "INVALID_FORMAT") and kinds == ["N1", "N2"]
