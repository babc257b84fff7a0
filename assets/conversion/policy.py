"""Pure decisions of the conversion pipeline: upload checks, error codes, reclaim, how many worker runs.

No I/O and no Dagster here (STYLE §2); the worker, the API and the sensor carry these out.
"""

from __future__ import annotations

import math
import re
import unicodedata
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Literal

from redrive.failures import Code, Failure, PermanentError, classify_exception
from redrive.vocabularies import CONVERSION, CONVERSION_PUBLIC_CODES, public_code

STATUSES = ("queued", "processing", "succeeded", "failed")
PDF_HEADER = re.compile(rb"%PDF-[12]\.[0-9]")
PDF_HEADER_WINDOW = 1024  # ISO 32000: readers accept the header anywhere in the first 1024 bytes

# -------------------------------------------------------------------------------------------- uploads


def upload_error(head: bytes, size: int, max_bytes: int) -> str | None:
    """003 §2: ``TOO_LARGE`` past the limit, ``NOT_PDF`` unless the bytes say PDF — by content, never by name."""
    if size > max_bytes:
        return "TOO_LARGE"
    if size == 0 or not PDF_HEADER.search(head[:PDF_HEADER_WINDOW]):
        return "NOT_PDF"
    return None


_UNSAFE = re.compile(r"[^\w. -]+")  # letters of any script, digits, _ . - and space


def display_name(name: str | None) -> str:
    """A file name safe to show and store as a label: no path, no control characters, at most 120 chars."""
    text = unicodedata.normalize("NFKC", name or "")
    text = text.replace("\\", "/").rsplit("/", 1)[-1]
    text = _UNSAFE.sub("_", text).strip(" .") or "upload.pdf"
    return text[:120]


# --------------------------------------------------------------------------------------- gateway errors


def classify(exc: BaseException) -> Failure:
    """Any error of an attempt as 003's canonical code (§3.1) with 003's retryability (§3.2)."""
    return CONVERSION.apply(classify_exception(exc))


def check_xml(xml: bytes) -> None:
    """The gateway's answer must be an XML ``<document>``; anything else is a gateway 4xx (003 §3.1).

    Raised as typed failures so the classifier names them: unparsable → PARSE_ERROR, wrong root →
    SCHEMA_INVALID; the vocabulary maps both to ``GW_4XX`` (never retried: the same file gives the same answer).
    """
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as exc:
        raise PermanentError(Failure.of(Code.PARSE_ERROR, message="converter answered malformed XML",
                                        detail=str(exc))) from exc
    if root.tag != "document":
        raise PermanentError(Failure.of(Code.SCHEMA_INVALID, message="converter answered an unexpected XML shape",
                                        detail=f"root element <{root.tag[:40]}>"))


def public(code: str | None) -> str | None:
    """What the UI and API show for a stored code: always one of the ten canonical codes (003 §2)."""
    if code is None:
        return None
    return code if code in CONVERSION_PUBLIC_CODES else public_code(code)


# -------------------------------------------------------------------------------------------- leases

ReclaimOutcome = Literal["requeue", "fail"]


def reclaim_outcome(lost_leases: int, max_attempts: int) -> ReclaimOutcome:
    """An expired lease is requeued (003 §3.4) with its attempt given back — unless the job has now lost
    its worker ``max_attempts`` times (``lost_leases`` counts this one).

    An expired lease is our own infrastructure's loss (a crash, a pause, the database away), counted
    apart from the gateway's attempts (issue 26 §2); a job that loses its worker every time is a poison
    pill (it may be what kills them), not bad luck. `repository.reclaim_expired` applies it in SQL.
    """
    return "fail" if lost_leases >= max_attempts else "requeue"


def claim_ahead(concurrency: int, turn_seconds: float, job_seconds: float) -> int:
    """Leases claimed beyond WORKER_CONCURRENCY, so a slot that frees starts its next job at once (issue 14).

    A slot's next lease otherwise waits for the turn that writes its result: ``turn_seconds`` (the
    statement, the publish, the COMMIT's fsync) on every job. During one turn about
    ``concurrency × turn / job`` slots free; that many leases wait ready, at most a quarter of the slots.
    Long jobs make it 0: a claimed job never waits long for a slot while another worker could run it.
    """
    if concurrency < 4 or job_seconds <= 0 or not math.isfinite(turn_seconds / job_seconds):
        return 0
    return max(0, min(concurrency // 4, math.floor(concurrency * turn_seconds / job_seconds)))


LOST_LEASE = Failure.of(Code.UNKNOWN, message="the worker was lost on every attempt (lease expired)")
"""The failure recorded for a job whose last attempt's lease expired."""

# ------------------------------------------------------------------------------------ dagster dispatch


@dataclass(frozen=True)
class Dispatch:
    """What the worker sensor asks for this tick."""

    worker_runs: int = 0
    probe: bool = False
    reason: str = ""


def dispatch(*, due: int, in_flight: int, max_runs: int, per_run: int, breaker_open: bool,
             probe_due: bool) -> Dispatch:
    """Worker runs while there is due work and the breaker is closed: never more than WORKER_RUNS runs in flight,
    and no more runs than the due jobs fill, each run holding ``per_run`` (WORKER_CONCURRENCY) jobs in flight.

    While the breaker is open nothing is dispatched (003 §3.3); one probe run is requested once its
    cooldown has passed, so the breaker closes by itself when the gateway recovers.
    """
    if breaker_open:
        if probe_due and in_flight < max_runs:
            return Dispatch(probe=True, reason="breaker open: probing the gateway")
        return Dispatch(reason="breaker open: jobs stay queued until a health probe succeeds")
    if due <= 0:
        return Dispatch(reason="no due conversion job")
    free = max(0, max_runs - in_flight)
    if free == 0:
        return Dispatch(reason=f"{in_flight} worker runs in flight (WORKER_RUNS={max_runs})")
    return Dispatch(worker_runs=min(free, math.ceil(due / max(1, per_run))), reason=f"{due} due jobs")
