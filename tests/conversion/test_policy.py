"""003 §5 unit tests: backoff, retryability by code, upload checks, reclaim logic, canonical codes — no I/O."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from assets.conversion import policy
from assets.conversion.settings import ConversionSettings
from redrive.budgets import decide
from redrive.failures import Code, Failure, PermanentError
from redrive.vocabularies import CONVERSION, CONVERSION_PUBLIC_CODES
from tests.conversion.conftest import make_pdf


@given(attempt=st.integers(min_value=1, max_value=2), seed=st.integers())
def test_backoff_is_5000ms_times_2_to_the_k_plus_up_to_5000ms(attempt: int, seed: int) -> None:
    """003 §3.2 with the core's 1-based attempt: after attempt 1 wait 5–10 s, after attempt 2 wait 10–15 s."""
    delay = ConversionSettings().backoff().delay(attempt, random.Random(seed))
    base = 5.0 * 2 ** (attempt - 1)
    assert base <= delay <= base + 5.0


def test_backoff_knobs_come_from_the_environment(monkeypatch) -> None:
    """RETRY_BASE_DELAY_MS and RETRY_JITTER_MAX_MS reshape the formula; jitter 0 makes it exact."""
    monkeypatch.setenv("RETRY_BASE_DELAY_MS", "1000")
    monkeypatch.setenv("RETRY_JITTER_MAX_MS", "0")
    backoff = ConversionSettings().backoff()
    assert [backoff.delay(a, random.Random(0)) for a in (1, 2, 3)] == [1.0, 2.0, 4.0]


@pytest.mark.parametrize(
    ("core", "code", "retryable"),
    [
        (Code.UPSTREAM_UNAVAILABLE, "GW_5XX", True),
        (Code.UPSTREAM_INTERNAL, "GW_5XX", True),
        (Code.NETWORK_ERROR, "GW_5XX", True),
        (Code.NETWORK_TIMEOUT, "GW_TIMEOUT", True),
        (Code.DB_TRANSIENT, "IO_ERROR", True),
        (Code.BAD_REQUEST, "GW_4XX", False),
        (Code.PARSE_ERROR, "GW_4XX", False),
        (Code.SCHEMA_INVALID, "GW_4XX", False),
        (Code.AUTH_DENIED, "FORBIDDEN", False),
        (Code.UNKNOWN, "UNKNOWN", True),
    ],
)
def test_retryability_by_code(core: Code, code: str, retryable: bool) -> None:
    """003 §3.1/§3.2: GW_5XX, GW_TIMEOUT, IO_ERROR, UNKNOWN retry; GW_4XX and FORBIDDEN never do."""
    failure = CONVERSION.apply(Failure.of(core))
    assert (failure.code, failure.retryable) == (code, retryable)
    decision = decide(failure, 1, 3, ConversionSettings().backoff(), random.Random(0))
    assert decision.retry is retryable


def test_at_most_three_attempts() -> None:
    """The third failed attempt of a retryable error is the last: exhausted, no delay."""
    failure = CONVERSION.apply(Failure.of(Code.UPSTREAM_UNAVAILABLE))
    assert decide(failure, 2, 3, ConversionSettings().backoff(), random.Random(0)).retry
    final = decide(failure, 3, 3, ConversionSettings().backoff(), random.Random(0))
    assert (final.retry, final.reason) == (False, "exhausted")


def test_upload_is_judged_by_its_bytes() -> None:
    """NOT_PDF without a %PDF-x.y header in the first 1024 bytes, TOO_LARGE past the limit, else accepted."""
    assert policy.upload_error(make_pdf(), 300, 1000) is None
    assert policy.upload_error(b"\n\n%PDF-1.7 ...", 20, 1000) is None  # header after junk, within 1024 bytes
    assert policy.upload_error(b"GIF89a", 6, 1000) == "NOT_PDF"
    assert policy.upload_error(b"%PDF-", 5, 1000) == "NOT_PDF"  # no version: not a header
    assert policy.upload_error(b" " * 1100 + b"%PDF-1.4", 1108, 5000) == "NOT_PDF"
    assert policy.upload_error(b"", 0, 1000) == "NOT_PDF"
    assert policy.upload_error(make_pdf(), 1001, 1000) == "TOO_LARGE"


@pytest.mark.parametrize(("raw", "shown"), [
    ("report.pdf", "report.pdf"),
    ("../../etc/passwd", "passwd"),
    ("C:\\Users\\me\\scan 1.pdf", "scan 1.pdf"),
    ("<script>.pdf", "_script_.pdf"),
    ("Relevé\u0000 7.pdf", "Relevé_ 7.pdf"),
    ("", "upload.pdf"),
    (None, "upload.pdf"),
])
def test_display_names_carry_no_path(raw: str | None, shown: str) -> None:
    """Whatever name a client sends, what we store and show has no directory and no markup."""
    assert policy.display_name(raw) == shown


def test_check_xml_names_bad_answers_as_gw_4xx() -> None:
    """Truncated XML and the wrong root element are permanent gateway errors (GW_4XX), a document passes."""
    policy.check_xml(b'<document sha256="x"><page n="1">hi</page></document>')
    for bad in (b'<document sha256="', b"<unexpected/>"):
        with pytest.raises(PermanentError) as caught:
            policy.check_xml(bad)
        assert policy.classify(caught.value).code == "GW_4XX"


def test_reclaim_requeues_unless_the_worker_was_lost_every_time() -> None:
    """003 §3.4 reclaim: an expired lease goes back to queued; the job that lost its worker as often as it has
    attempts is a poison job and fails (issue 26: lost leases are counted apart from attempts)."""
    assert policy.reclaim_outcome(1, 3) == "requeue"
    assert policy.reclaim_outcome(2, 3) == "requeue"
    assert policy.reclaim_outcome(3, 3) == "fail"
    assert CONVERSION.apply(policy.LOST_LEASE).code == "UNKNOWN"


def test_public_codes_are_always_canonical() -> None:
    """Internal names map to the ten codes of 003 §2; unknown ones become UNKNOWN."""
    assert policy.public("GW_UNAVAILABLE") == "GW_5XX"
    assert policy.public("INVALID_MAPPING") == "GW_4XX"
    assert policy.public("SOMETHING_NEW") == "UNKNOWN"
    assert policy.public(None) is None
    assert all(policy.public(c) == c for c in CONVERSION_PUBLIC_CODES)


def test_lease_extension_always_fits_inside_the_lease() -> None:
    """An extension period at or above the TTL would lose every long job's lease; it is pulled to a third of it."""
    knobs = ConversionSettings(worker_lease_ttl_sec=6, worker_lease_extend_sec=30)
    assert knobs.worker_lease_extend_sec == 2


def test_breaker_knobs_map_to_the_policy(monkeypatch) -> None:
    """CIRCUIT_WINDOW, CIRCUIT_FAIL_THRESHOLD, CIRCUIT_COOLDOWN_MS from the environment shape the breaker."""
    for key, value in {"CIRCUIT_WINDOW": "40", "CIRCUIT_FAIL_THRESHOLD": "0.25", "CIRCUIT_COOLDOWN_MS": "1500"}.items():
        monkeypatch.setenv(key, value)
    p = ConversionSettings().breaker_policy()
    assert (p.window, p.failure_threshold, p.min_calls, p.cooldown) == (40, 0.25, 20, 1.5)


def test_breaker_cooldown_is_a_wait_the_time_scale_shrinks() -> None:
    """Like every computed wait, the probe cooldown follows REDRIVE_TIME_SCALE (the demo's 0.01: 30 s → 0.3 s)."""
    knobs = ConversionSettings(circuit_cooldown_ms=30000)
    assert knobs.breaker_policy().cooldown == 30.0
    assert knobs.breaker_policy(0.01).cooldown == pytest.approx(0.3)


def test_claim_ahead_covers_the_slots_that_free_during_one_turn() -> None:
    """Leases claimed beyond WORKER_CONCURRENCY: about concurrency × turn / job, at most a quarter of the slots,
    none for long jobs, small workers or before anything was measured."""
    assert policy.claim_ahead(32, turn_seconds=0.036, job_seconds=0.24) == 4
    assert policy.claim_ahead(32, turn_seconds=0.005, job_seconds=0.001) == 8  # instant jobs: capped at a quarter
    assert policy.claim_ahead(32, turn_seconds=0.03, job_seconds=30.0) == 0  # a claimed job never waits a whole call
    assert policy.claim_ahead(2, turn_seconds=0.03, job_seconds=0.001) == 0
    assert policy.claim_ahead(32, turn_seconds=0.0, job_seconds=0.0) == 0  # nothing measured yet
