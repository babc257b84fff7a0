"""Every row of every seed vocabulary, driven from a real error through classify -> apply.

The expected tables below are written out by hand from the seeds (not computed from the module), so a
changed row in redrive/vocabularies.py fails here until someone checks it against the seed.
"""

from __future__ import annotations

import pytest

from redrive.failures import Code, Failure, classify_exception
from redrive.vocabularies import (
    CONVERSION,
    CONVERSION_INTERNAL,
    CONVERSION_PUBLIC_CODES,
    CONVERSION_RETRYABLE,
    CRITICIZER,
    EVIDENCE,
    EVIDENCE_S3,
    MATCHING,
    MATCHMAKING,
    VOCABULARIES,
    Entry,
    Vocabulary,
    criticizer_error_class,
    evidence_category,
    public_code,
)
from tests.core.real_inputs import REAL, client_error

C = Code

# 003 §3.1/§3.2: core -> (public code, retryable)
CONVERSION_EXPECTED: dict[Code, tuple[str, bool]] = {
    C.NETWORK_TIMEOUT: ("GW_TIMEOUT", True),
    C.NETWORK_ERROR: ("GW_5XX", True),
    C.UPSTREAM_UNAVAILABLE: ("GW_5XX", True),
    C.UPSTREAM_INTERNAL: ("GW_5XX", True),
    C.RATE_LIMITED: ("GW_5XX", True),
    C.CONFLICT: ("IO_ERROR", True),
    C.DB_TRANSIENT: ("IO_ERROR", True),
    C.SCHEMA_INVALID: ("GW_4XX", False),
    C.PARSE_ERROR: ("GW_4XX", False),
    C.CONTEXT_LENGTH_EXCEEDED: ("GW_4XX", False),
    C.BAD_REQUEST: ("GW_4XX", False),
    C.NOT_FOUND: ("GW_4XX", False),
    C.POLICY_REJECTED: ("GW_4XX", False),
    C.DATA_ERROR: ("GW_4XX", False),
    C.AUTH_DENIED: ("FORBIDDEN", False),
    C.INVARIANT_VIOLATION: ("UNKNOWN", True),
    C.UNKNOWN: ("UNKNOWN", True),
}

# 002 §8.1: core -> (error_class, retryable, category)
CRITICIZER_EXPECTED: dict[Code, tuple[str, bool, str]] = {
    C.NETWORK_TIMEOUT: ("NETWORK_TIMEOUT", True, "network_transient"),
    C.NETWORK_ERROR: ("NETWORK_TRANSIENT", True, "network_transient"),
    C.UPSTREAM_UNAVAILABLE: ("NETWORK_TRANSIENT", True, "network_transient"),
    C.DB_TRANSIENT: ("DB_TRANSIENT", True, "network_transient"),
    C.RATE_LIMITED: ("RATE_LIMITED", True, "rate_limiting"),
    C.UPSTREAM_INTERNAL: ("UPSTREAM_INTERNAL", True, "upstream_internal"),
    C.CONFLICT: ("CONFLICT", True, "conflict"),
    C.SCHEMA_INVALID: ("SCHEMA_INVALID", False, "validation"),
    C.PARSE_ERROR: ("MALFORMED_PAYLOAD", False, "validation"),
    C.CONTEXT_LENGTH_EXCEEDED: ("CONTEXT_LENGTH_EXCEEDED", False, "validation"),
    C.BAD_REQUEST: ("BAD_REQUEST", False, "validation"),
    C.DATA_ERROR: ("DATA_INVALID", False, "validation"),
    C.AUTH_DENIED: ("AUTH_DENIED", False, "auth"),
    C.NOT_FOUND: ("NOT_FOUND", False, "not_found"),
    C.POLICY_REJECTED: ("POLICY_REJECTED", False, "policy"),
    C.INVARIANT_VIOLATION: ("CONFIG_OR_RUNTIME_BUG", False, "bug"),
    C.UNKNOWN: ("UNCLASSIFIED", False, "bug"),
}

# 000 error classification: core -> transient?
MATCHING_EXPECTED: dict[Code, bool] = {
    C.RATE_LIMITED: True,  # HTTP 429
    C.UPSTREAM_UNAVAILABLE: True,  # HTTP 5xx
    C.UPSTREAM_INTERNAL: True,  # HTTP 5xx
    C.NETWORK_TIMEOUT: True,
    C.NETWORK_ERROR: True,  # connection refused
    C.PARSE_ERROR: True,
    C.SCHEMA_INVALID: True,
    C.CONTEXT_LENGTH_EXCEEDED: False,
    C.AUTH_DENIED: False,  # 401 / 403
    C.DB_TRANSIENT: True,
    C.CONFLICT: True,
    C.BAD_REQUEST: False,
    C.NOT_FOUND: False,
    C.POLICY_REJECTED: False,
    C.DATA_ERROR: False,
    C.INVARIANT_VIOLATION: False,
    C.UNKNOWN: False,
}

# 001 retry policy: core -> (failure type, retried?)
MATCHMAKING_EXPECTED: dict[Code, tuple[str, bool]] = {
    C.DB_TRANSIENT: ("TRANSIENT_DB_ERROR", True),
    C.CONFLICT: ("TRANSIENT_DB_ERROR", True),
    C.NETWORK_TIMEOUT: ("TIMEOUT", True),
    C.NETWORK_ERROR: ("TIMEOUT", True),
    C.UPSTREAM_UNAVAILABLE: ("TIMEOUT", True),
    C.UPSTREAM_INTERNAL: ("TIMEOUT", True),
    C.RATE_LIMITED: ("TIMEOUT", True),
    C.DATA_ERROR: ("DATA_INCONSISTENCY", False),
    C.SCHEMA_INVALID: ("DATA_INCONSISTENCY", False),
    C.PARSE_ERROR: ("DATA_INCONSISTENCY", False),
    C.NOT_FOUND: ("DATA_INCONSISTENCY", False),
    C.INVARIANT_VIOLATION: ("LOGIC_ERROR", False),
    C.BAD_REQUEST: ("LOGIC_ERROR", False),
    C.CONTEXT_LENGTH_EXCEEDED: ("LOGIC_ERROR", False),
    C.AUTH_DENIED: ("LOGIC_ERROR", False),
    C.POLICY_REJECTED: ("LOGIC_ERROR", False),
    C.UNKNOWN: ("LOGIC_ERROR", False),
}

# 004 attachment_error_code: core -> (code, category, retryable)
EVIDENCE_EXPECTED: dict[Code, tuple[str, str, bool]] = {
    C.NETWORK_TIMEOUT: ("NETWORK_TIMEOUT", "NETWORK", True),
    C.NETWORK_ERROR: ("503", "NETWORK", True),
    C.UPSTREAM_UNAVAILABLE: ("503", "NETWORK", True),
    C.RATE_LIMITED: ("503", "NETWORK", True),
    C.UPSTREAM_INTERNAL: ("500", "SYSTEM", True),
    C.DB_TRANSIENT: ("SYSTEM_ERROR", "SYSTEM", True),
    C.CONFLICT: ("SYSTEM_ERROR", "SYSTEM", True),
    C.AUTH_DENIED: ("UNAUTHORIZED", "AUTH", False),
    C.NOT_FOUND: ("CASE_NOT_FOUND", "AUTH", False),
    C.SCHEMA_INVALID: ("INVALID_FORMAT", "DATA", False),
    C.DATA_ERROR: ("INVALID_FORMAT", "DATA", False),
    C.BAD_REQUEST: ("INVALID_FORMAT", "DATA", False),
    C.CONTEXT_LENGTH_EXCEEDED: ("INVALID_FORMAT", "DATA", False),
    C.POLICY_REJECTED: ("INVALID_FORMAT", "DATA", False),
    C.PARSE_ERROR: ("CORRUPTED_FILE", "DATA", False),
    C.INVARIANT_VIOLATION: ("SYSTEM_ERROR", "SYSTEM", True),
    C.UNKNOWN: ("SYSTEM_ERROR", "SYSTEM", True),
}


def _rows(expected: dict[Code, tuple]) -> list:  # type: ignore[type-arg]
    return [pytest.param(core, *row, id=str(core)) for core, row in expected.items()]


def test_expected_tables_cover_every_core_code() -> None:
    """Each hand-written table has a row for every core code, so no code falls to a default unseen."""
    for expected in (CONVERSION_EXPECTED, CRITICIZER_EXPECTED, MATCHING_EXPECTED, MATCHMAKING_EXPECTED, EVIDENCE_EXPECTED):
        assert set(expected) == set(Code)


@pytest.mark.parametrize("vocabulary", list(VOCABULARIES.values()), ids=lambda v: v.name)
def test_every_vocabulary_lists_every_core_code(vocabulary: Vocabulary) -> None:
    """Each vocabulary decides every core code in its table, not by falling through to the default."""
    assert set(vocabulary.table) == {str(c) for c in Code}


@pytest.mark.parametrize(("core", "code", "retryable"), _rows(CONVERSION_EXPECTED))
def test_conversion_row(core: Code, code: str, retryable: bool) -> None:
    """003: a real error of this core code becomes this canonical code, retried iff GW_5XX/GW_TIMEOUT/IO_ERROR/UNKNOWN."""
    failure = REAL[core]()
    applied = CONVERSION.apply(failure)
    assert (applied.code, applied.retryable) == (code, retryable)
    assert applied.code in CONVERSION_PUBLIC_CODES
    assert applied.retryable is (applied.code in CONVERSION_RETRYABLE)
    assert applied.retry_after == failure.retry_after


@pytest.mark.parametrize(
    ("internal", "public"),
    [
        ("GW_UNAVAILABLE", "GW_5XX"),
        ("NETWORK_ERROR", "GW_5XX"),
        ("PARSE_ERROR", "GW_4XX"),
        ("VALIDATION_ERROR", "GW_4XX"),
        ("INVALID_MAPPING", "GW_4XX"),
        ("MEMORY_ERROR", "UNKNOWN"),
        ("NOT_PDF", "NOT_PDF"),
        ("TOO_LARGE", "TOO_LARGE"),
        ("GW_4XX", "GW_4XX"),
        ("GW_5XX", "GW_5XX"),
        ("GW_TIMEOUT", "GW_TIMEOUT"),
        ("IO_ERROR", "IO_ERROR"),
        ("NOT_READY", "NOT_READY"),
        ("EXPIRED", "EXPIRED"),
        ("FORBIDDEN", "FORBIDDEN"),
        ("UNKNOWN", "UNKNOWN"),
        ("SOMETHING_NEW", "UNKNOWN"),
    ],
)
def test_conversion_internal_row(internal: str, public: str) -> None:
    """003 §3.1: internal names map onto the canonical public codes; anything unknown is UNKNOWN."""
    assert public_code(internal) == public


def test_conversion_internal_table_has_no_untested_rows() -> None:
    """The internal table holds exactly the rows tested above (plus the canonical identities)."""
    assert set(CONVERSION_INTERNAL) == {
        "GW_UNAVAILABLE", "NETWORK_ERROR", "PARSE_ERROR", "VALIDATION_ERROR", "INVALID_MAPPING", "MEMORY_ERROR",
    } | CONVERSION_PUBLIC_CODES
    assert set(CONVERSION_INTERNAL.values()) <= CONVERSION_PUBLIC_CODES


def test_conversion_never_retries_gw_4xx() -> None:
    """003 §3.2: no core code maps to a retryable GW_4XX."""
    assert all(not e.retryable for e in CONVERSION.table.values() if e.code == "GW_4XX")


@pytest.mark.parametrize(("core", "error_class", "retryable", "category"), _rows(CRITICIZER_EXPECTED))
def test_criticizer_row(core: Code, error_class: str, retryable: bool, category: str) -> None:
    """002 §8.1: a real error of this core code gets this error_class, category and classification."""
    failure = REAL[core]()
    entry = criticizer_error_class(failure, idempotent=True)
    assert entry == Entry(error_class, retryable, category)
    applied = CRITICIZER.apply(failure)
    assert (applied.code, applied.retryable) == (error_class, retryable)


@pytest.mark.parametrize(("core", "error_class", "retryable", "category"), _rows(CRITICIZER_EXPECTED))
def test_criticizer_non_idempotent_row(core: Code, error_class: str, retryable: bool, category: str) -> None:
    """002 §8.1: for non-idempotent work only the conflict row changes, to non-retryable."""
    entry = criticizer_error_class(REAL[core](), idempotent=False)
    assert entry.code == error_class
    assert entry.retryable is (retryable and core != Code.CONFLICT)


@pytest.mark.parametrize(("core", "transient"), _rows({k: (v,) for k, v in MATCHING_EXPECTED.items()}))
def test_matching_row(core: Code, transient: bool) -> None:
    """000: a real error of this core code is transient or not as 000's table (and our documented rest) says."""
    failure = REAL[core]()
    applied = MATCHING.apply(failure)
    assert applied.retryable is transient
    assert applied.code == core
    assert MATCHING.entry(failure).category == ("transient" if transient else "non_transient")


def test_matching_schema_failure_is_transient_unlike_criticizer() -> None:
    """The same schema failure is retried by 000 (LLM non-determinism) and dead-lettered by 002."""
    failure = REAL[Code.SCHEMA_INVALID]()
    assert MATCHING.apply(failure).retryable is True
    assert CRITICIZER.apply(failure).retryable is False


@pytest.mark.parametrize(("core", "code", "retryable"), _rows(MATCHMAKING_EXPECTED))
def test_matchmaking_row(core: Code, code: str, retryable: bool) -> None:
    """001: transient DB errors and timeouts retry; logic errors and data inconsistencies do not."""
    applied = MATCHMAKING.apply(REAL[core]())
    assert (applied.code, applied.retryable) == (code, retryable)


@pytest.mark.parametrize(("core", "code", "category", "retryable"), _rows(EVIDENCE_EXPECTED))
def test_evidence_row(core: Code, code: str, category: str, retryable: bool) -> None:
    """004: a real error of this core code is stored as this attachment_error_code, with the column's category."""
    failure = REAL[core]()
    applied = EVIDENCE.apply(failure)
    assert (applied.code, applied.retryable) == (code, retryable)
    assert evidence_category(applied.code) == category
    assert EVIDENCE.entry(failure).category == category


def test_evidence_s3_missing_object_is_data_not_auth() -> None:
    """A missing S3 object becomes S3_NOT_FOUND (DATA, permanent), not the case API's CASE_NOT_FOUND."""
    applied = EVIDENCE_S3.apply(REAL[Code.NOT_FOUND]())
    assert (applied.code, applied.retryable) == ("S3_NOT_FOUND", False)
    assert evidence_category(applied.code) == "DATA"
    assert {k: v for k, v in EVIDENCE_S3.table.items() if k != Code.NOT_FOUND} == {
        k: v for k, v in EVIDENCE.table.items() if k != Code.NOT_FOUND
    }


@pytest.mark.parametrize(
    ("code", "category"),
    [
        ("ATTACHMENT_API_TIMEOUT", "NETWORK"),
        ("503", "NETWORK"),
        ("NETWORK_TIMEOUT", "NETWORK"),
        ("500", "SYSTEM"),
        ("SYSTEM_ERROR", "SYSTEM"),
        ("CORRUPTED_FILE", "DATA"),
        ("INVALID_FORMAT", "DATA"),
        ("S3_NOT_FOUND", "DATA"),
        ("401", "AUTH"),
        ("403", "AUTH"),
        ("UNAUTHORIZED", "AUTH"),
        ("CASE_NOT_FOUND", "AUTH"),
        # ELSE 'SYSTEM', including NULL and near misses (SQL IN is case- and space-sensitive)
        (None, "SYSTEM"),
        ("", "SYSTEM"),
        ("429", "SYSTEM"),
        ("network_timeout", "SYSTEM"),
        (" 503", "SYSTEM"),
        ("404", "SYSTEM"),
    ],
)
def test_evidence_category_case_row(code: str | None, category: str) -> None:
    """004 §1.1: evidence_category reproduces the error_category generated column's CASE row by row."""
    assert evidence_category(code) == category


def test_apply_twice_is_the_same_as_once() -> None:
    """A vocabulary looks up the core code, so applying it again changes nothing."""
    for vocabulary in VOCABULARIES.values():
        for make in REAL.values():
            once = vocabulary.apply(make())
            assert vocabulary.apply(once) == once


def test_apply_keeps_retry_after_and_core_code() -> None:
    """The seed code replaces the core code but retry_after, message and core code are kept."""
    failure = REAL[Code.RATE_LIMITED]()
    applied = EVIDENCE.apply(failure)
    assert (applied.code, applied.core, applied.retry_after, applied.message) == (
        "503", Code.RATE_LIMITED, 7.0, failure.message,
    )


def test_vocabulary_tables_are_read_only() -> None:
    """A vocabulary's table cannot be edited at run time."""
    with pytest.raises(TypeError):
        CONVERSION.table["UNKNOWN"] = Entry("X", False)  # type: ignore[index]


def test_vocabulary_rejects_non_core_keys() -> None:
    """A table keyed by anything but core codes is a configuration error, caught at import."""
    with pytest.raises(ValueError, match="core codes"):
        Vocabulary("bad", {"HTTP_500": Entry("X", True)}, default=Entry("X", False))


def test_unlisted_code_uses_default() -> None:
    """A failure whose core code a vocabulary does not list gets the vocabulary's default entry."""
    partial = Vocabulary("partial", {str(Code.NETWORK_TIMEOUT): Entry("T", True)}, default=Entry("D", False))
    assert partial.apply(Failure.of(Code.AUTH_DENIED)).code == "D"
    assert partial.apply(REAL[Code.NETWORK_TIMEOUT]()).code == "T"


def test_aws_not_found_reaches_evidence_as_case_not_found() -> None:
    """A real ClientError 404 from the case side ends as CASE_NOT_FOUND, permanent (004 §7)."""
    applied = EVIDENCE.apply(classify_exception(client_error("ResourceNotFoundException", 404)))
    assert (applied.code, applied.retryable) == ("CASE_NOT_FOUND", False)
