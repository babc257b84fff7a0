"""The failure model: Retry-After parsing, HTTP and exception classifiers, the typed error hierarchy."""

from __future__ import annotations

import json
import socket
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import botocore.exceptions as boto_exc
import httpx
import psycopg2
import psycopg2.errors as pg_errors
import pytest
import sqlalchemy.exc as sa_exc
import sqlalchemy.orm.exc as sa_orm_exc
from hypothesis import given, settings
from hypothesis import strategies as st

from redrive.failures import (
    DEFAULT_RETRYABLE,
    Code,
    ConflictError,
    Failure,
    PermanentError,
    RedriveError,
    RetryableError,
    classify_exception,
    classify_http,
    default_retryable,
    parse_retry_after,
    raise_failure,
)
from tests.core.real_inputs import (
    NOW,
    REAL,
    REQUEST,
    WeirdLibraryError,
    client_error,
    db_error,
    http_error,
    json_error,
    raised,
    validation_error,
)

# ------------------------------------------------------------------------------------- Retry-After


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("120", 120.0),
        ("0", 0.0),
        ("  30 ", 30.0),
        ("007", 7.0),
        ("99999999999999999999", float(2**31)),
        ("Thu, 26 Feb 2026 12:02:00 GMT", 120.0),  # IMF-fixdate
        ("Thursday, 26-Feb-26 12:01:00 GMT", 60.0),  # obsolete RFC 850
        ("Thu Feb 26 12:00:30 2026", 30.0),  # obsolete asctime, no zone: GMT
        ("Wed, 25 Feb 2026 12:00:00 GMT", 0.0),  # in the past
        (None, None),
        ("", None),
        ("   ", None),
        ("1.5", None),  # RFC 9110 delta-seconds is digits only
        ("-5", None),
        ("+5", None),
        ("soon", None),
        ("Thu, 26 Feb 2026", None),
        ("Thu, 99 Feb 2026 12:00:00 GMT", None),
        ("120 seconds", None),
    ],
)
def test_parse_retry_after_table(header: str | None, expected: float | None) -> None:
    """Both RFC 9110 forms parse to seconds from now; past dates give 0; anything else gives None."""
    assert parse_retry_after(header, NOW) == expected


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_parse_retry_after_never_raises(header: str) -> None:
    """Any header text yields a non-negative number or None, never an exception."""
    result = parse_retry_after(header, NOW)
    assert result is None or result >= 0


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=10**6))
def test_parse_retry_after_date_round_trip(seconds: int) -> None:
    """An IMF-fixdate N seconds ahead reads back as N seconds."""
    header = format_datetime(NOW + timedelta(seconds=seconds), usegmt=True)
    assert parse_retry_after(header, NOW) == float(seconds)


# ----------------------------------------------------------------------------------- classify_http


@pytest.mark.parametrize(
    ("status", "body", "code"),
    [
        (429, None, Code.RATE_LIMITED),
        (500, None, Code.UPSTREAM_INTERNAL),
        (501, None, Code.UPSTREAM_INTERNAL),
        (502, None, Code.UPSTREAM_UNAVAILABLE),
        (503, None, Code.UPSTREAM_UNAVAILABLE),
        (504, None, Code.UPSTREAM_UNAVAILABLE),
        (401, None, Code.AUTH_DENIED),
        (403, None, Code.AUTH_DENIED),
        (404, None, Code.NOT_FOUND),
        (408, None, Code.NETWORK_TIMEOUT),
        (409, None, Code.CONFLICT),
        (400, None, Code.BAD_REQUEST),
        (410, None, Code.BAD_REQUEST),
        (413, None, Code.BAD_REQUEST),
        (422, None, Code.BAD_REQUEST),
        (400, {"error": {"code": "context_length_exceeded", "type": "invalid_request_error"}}, Code.CONTEXT_LENGTH_EXCEEDED),
        (429, {"error": {"code": "insufficient_quota", "type": "insufficient_quota"}}, Code.RATE_LIMITED),
        (429, {"error": {"code": None, "type": "rate_limit_exceeded"}}, Code.RATE_LIMITED),
        (500, {"error": {"code": "internal_error"}}, Code.UPSTREAM_INTERNAL),
        (401, {"error": {"code": "invalid_api_key"}}, Code.AUTH_DENIED),
        (400, {"error": {"code": "content_policy_violation"}}, Code.POLICY_REJECTED),
        (400, {"error": {"code": "content_filter"}}, Code.POLICY_REJECTED),
        (400, {"code": "CASE_NOT_FOUND", "message": "case 42 deleted"}, Code.NOT_FOUND),
        (422, {"error": {"code": "INVALID_RECIPIENT"}}, Code.BAD_REQUEST),
        (400, b'{"error": {"code": "context_length_exceeded"}}', Code.CONTEXT_LENGTH_EXCEEDED),
        (400, '{"error": "content_filter"}', Code.POLICY_REJECTED),
        (503, b"<html>not json</html>", Code.UPSTREAM_UNAVAILABLE),
        (400, {"error": {"code": "some_new_code"}}, Code.BAD_REQUEST),
    ],
)
def test_classify_http_table(status: int, body: object, code: Code) -> None:
    """A recognised provider code decides; otherwise the status does; retryability follows the core default."""
    failure = classify_http(status, body, None, NOW)  # type: ignore[arg-type]
    assert failure.code == code
    assert failure.retryable is (code in DEFAULT_RETRYABLE)
    assert failure.upstream_status == status


def test_classify_http_429_reads_retry_after_case_insensitively() -> None:
    """429 carries the server's Retry-After seconds, whatever the header's case."""
    assert classify_http(429, None, {"retry-after": "42"}, NOW).retry_after == 42.0
    assert classify_http(429, None, {"Retry-After": "42"}, NOW).retry_after == 42.0


def test_classify_http_503_reads_retry_after_date() -> None:
    """A 503 with an HTTP-date Retry-After yields the seconds until that date."""
    failure = classify_http(503, None, {"Retry-After": "Thu, 26 Feb 2026 12:05:00 GMT"}, NOW)
    assert failure.code == Code.UPSTREAM_UNAVAILABLE
    assert failure.retry_after == 300.0


def test_classify_http_garbage_retry_after_is_ignored() -> None:
    """An unparseable Retry-After leaves retry_after None rather than failing the classification."""
    assert classify_http(429, None, {"Retry-After": "later please"}, NOW).retry_after is None


def test_classify_http_message_is_one_line_without_body() -> None:
    """The public message names the status and code only; the body lands in the (sanitized) detail."""
    body = {"error": {"code": "rate_limit_exceeded", "message": "key sk-live-abcdefghijklmnop1234 for jane@corp.example"}}
    failure = classify_http(429, body, None, NOW)
    assert failure.message == "upstream answered 429 (rate_limit_exceeded)"
    assert "\n" not in failure.message
    assert "rate_limit_exceeded" in failure.detail
    assert "sk-live-abcdefghijklmnop1234" not in failure.detail
    assert "jane@corp.example" not in failure.detail


def test_classify_http_ignores_non_identifier_codes_in_message() -> None:
    """A body 'code' that is not an identifier never reaches the public message."""
    failure = classify_http(400, {"error": {"code": "drop table; password=hunter2"}}, None, NOW)
    assert failure.message == "upstream answered 400"


# ------------------------------------------------------------------------------ classify_exception


@pytest.mark.parametrize("code", list(Code))
def test_every_core_code_has_a_real_source(code: Code) -> None:
    """Each core code is produced by at least one real library error, with the default retryability."""
    failure = REAL[code]()
    assert failure.code == code
    assert failure.retryable is default_retryable(code)


def _httpx_cases() -> list[tuple[BaseException, Code]]:
    return [
        (httpx.ConnectTimeout("connect timed out", request=REQUEST), Code.NETWORK_TIMEOUT),
        (httpx.ReadTimeout("read timed out", request=REQUEST), Code.NETWORK_TIMEOUT),
        (httpx.WriteTimeout("write timed out", request=REQUEST), Code.NETWORK_TIMEOUT),
        (httpx.PoolTimeout("pool timed out", request=REQUEST), Code.NETWORK_TIMEOUT),
        (httpx.ConnectError("[Errno -2] Name or service not known", request=REQUEST), Code.NETWORK_ERROR),
        (httpx.ReadError("connection reset by peer", request=REQUEST), Code.NETWORK_ERROR),
        (httpx.RemoteProtocolError("Server disconnected without sending a response.", request=REQUEST), Code.NETWORK_ERROR),
        (httpx.UnsupportedProtocol("Request URL has an unsupported protocol 'htp://'", request=REQUEST), Code.INVARIANT_VIOLATION),
        (http_error(503, b"busy", {"Retry-After": "3"}), Code.UPSTREAM_UNAVAILABLE),
        (http_error(404, b""), Code.NOT_FOUND),
        (http_error(403, {"error": {"code": "permission_denied"}}), Code.AUTH_DENIED),
    ]


def _botocore_cases() -> list[tuple[BaseException, Code]]:
    url = "https://sqs.eu-central-1.amazonaws.com/"
    return [
        (boto_exc.ConnectTimeoutError(endpoint_url=url), Code.NETWORK_TIMEOUT),
        (boto_exc.ReadTimeoutError(endpoint_url=url), Code.NETWORK_TIMEOUT),
        (boto_exc.EndpointConnectionError(endpoint_url=url), Code.NETWORK_ERROR),
        (boto_exc.ConnectionClosedError(endpoint_url=url), Code.NETWORK_ERROR),
        (boto_exc.NoCredentialsError(), Code.AUTH_DENIED),
        (client_error("Throttling", 400, "SendMessage"), Code.RATE_LIMITED),
        (client_error("ThrottlingException", 400, "ChangeMessageVisibility"), Code.RATE_LIMITED),
        (client_error("SlowDown", 503, "PutObject"), Code.RATE_LIMITED),
        (client_error("RequestLimitExceeded", 400), Code.RATE_LIMITED),
        (client_error("NoSuchKey", 404), Code.NOT_FOUND),
        (client_error("NoSuchBucket", 404), Code.NOT_FOUND),
        (client_error("404", 404, "HeadObject"), Code.NOT_FOUND),
        (client_error("AWS.SimpleQueueService.NonExistentQueue", 400, "GetQueueUrl"), Code.NOT_FOUND),
        (client_error("QueueDoesNotExist", 400, "GetQueueUrl"), Code.NOT_FOUND),
        (client_error("AccessDenied", 403), Code.AUTH_DENIED),
        (client_error("SomethingNew", 403), Code.AUTH_DENIED),
        (client_error("PreconditionFailed", 412, "PutObject"), Code.CONFLICT),
        (client_error("InternalError", 500), Code.UPSTREAM_INTERNAL),
        (client_error("ServiceUnavailable", 503), Code.UPSTREAM_UNAVAILABLE),
        (client_error("SomethingNew", 502), Code.UPSTREAM_UNAVAILABLE),
        (client_error("InvalidParameterValue", 400), Code.BAD_REQUEST),
    ]


def _db_cases() -> list[tuple[BaseException, Code]]:
    class ServerDeadlock(psycopg2.OperationalError):
        """psycopg2's pgcode is read-only; a subclass stands in for one the server filled in."""

        pgcode = "40P01"

    class ServerConnectionFailure(psycopg2.OperationalError):
        pgcode = "08006"

    class ServerStatementTimeout(psycopg2.OperationalError):
        pgcode = "57014"

    class ServerTooManyConnections(psycopg2.OperationalError):
        pgcode = "53300"

    class ServerUniqueViolation(psycopg2.IntegrityError):
        pgcode = "23505"

    class ServerUndefinedTable(psycopg2.ProgrammingError):
        pgcode = "42P01"

    return [
        (db_error(sa_exc.OperationalError, pg_errors.DeadlockDetected("deadlock detected")), Code.DB_TRANSIENT),
        (db_error(sa_exc.OperationalError, pg_errors.SerializationFailure("could not serialize access")), Code.DB_TRANSIENT),
        (db_error(sa_exc.OperationalError, pg_errors.LockNotAvailable("could not obtain lock")), Code.DB_TRANSIENT),
        (db_error(sa_exc.OperationalError, pg_errors.QueryCanceled("canceling statement due to statement timeout")), Code.DB_TRANSIENT),
        (db_error(sa_exc.OperationalError, pg_errors.TooManyConnections("too many clients")), Code.DB_TRANSIENT),
        (db_error(sa_exc.OperationalError, ServerDeadlock("deadlock detected")), Code.DB_TRANSIENT),
        (db_error(sa_exc.OperationalError, ServerConnectionFailure("server closed the connection")), Code.DB_TRANSIENT),
        (db_error(sa_exc.OperationalError, ServerStatementTimeout("statement timeout")), Code.DB_TRANSIENT),
        (db_error(sa_exc.OperationalError, ServerTooManyConnections("too many")), Code.DB_TRANSIENT),
        (db_error(sa_exc.DBAPIError, psycopg2.Error("ssl eof"), connection_invalidated=True), Code.DB_TRANSIENT),
        (db_error(sa_exc.OperationalError, psycopg2.OperationalError("could not connect to server")), Code.DB_TRANSIENT),
        (db_error(sa_exc.InterfaceError, psycopg2.InterfaceError("connection already closed")), Code.DB_TRANSIENT),
        (db_error(sa_exc.IntegrityError, ServerUniqueViolation("duplicate key")), Code.CONFLICT),
        (db_error(sa_exc.ProgrammingError, ServerUndefinedTable('relation "jobz" does not exist')), Code.INVARIANT_VIOLATION),
        (db_error(sa_exc.DataError, pg_errors.InvalidTextRepresentation("invalid input syntax for type uuid")), Code.DATA_ERROR),
        (sa_exc.TimeoutError("QueuePool limit of size 5 overflow 10 reached"), Code.DB_TRANSIENT),
        (sa_orm_exc.StaleDataError("UPDATE statement on table 'job' expected to update 1 row(s); 0 were matched."), Code.CONFLICT),
        (pg_errors.DeadlockDetected("deadlock detected"), Code.DB_TRANSIENT),
        (pg_errors.SerializationFailure("could not serialize"), Code.DB_TRANSIENT),
        (pg_errors.UniqueViolation("duplicate key"), Code.CONFLICT),
        (ServerConnectionFailure("terminating connection"), Code.DB_TRANSIENT),
    ]


def _stdlib_cases() -> list[tuple[BaseException, Code]]:
    return [
        (validation_error(), Code.SCHEMA_INVALID),
        (json_error(), Code.PARSE_ERROR),
        (TimeoutError("timed out"), Code.NETWORK_TIMEOUT),
        (socket.timeout("timed out"), Code.NETWORK_TIMEOUT),
        (ConnectionRefusedError(111, "Connection refused"), Code.NETWORK_ERROR),
        (ConnectionResetError(104, "Connection reset by peer"), Code.NETWORK_ERROR),
        (socket.gaierror(-2, "Name or service not known"), Code.NETWORK_ERROR),
        (AssertionError("unreachable"), Code.INVARIANT_VIOLATION),
        (TypeError("'NoneType' object is not subscriptable"), Code.INVARIANT_VIOLATION),
        (AttributeError("'NoneType' object has no attribute 'id'"), Code.INVARIANT_VIOLATION),
        (KeyError("stage"), Code.INVARIANT_VIOLATION),
        (ValueError("illegal state"), Code.INVARIANT_VIOLATION),
        (WeirdLibraryError("???"), Code.UNKNOWN),
        (RuntimeError("???"), Code.INVARIANT_VIOLATION),  # issue 13 item 2: a runtime bug, not unclassified
    ]


@pytest.mark.parametrize(
    ("exc", "code"),
    _httpx_cases() + _botocore_cases() + _db_cases() + _stdlib_cases(),
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_classify_exception_table(exc: BaseException, code: Code) -> None:
    """Real httpx, botocore, SQLAlchemy/psycopg2, pydantic and stdlib errors map to their core code."""
    failure = classify_exception(raised(exc), now=NOW)
    assert failure.code == code
    assert failure.retryable is default_retryable(code)


@pytest.mark.parametrize(
    ("integrity", "code", "retryable"),
    [("conflict", Code.CONFLICT, True), ("data", Code.DATA_ERROR, False)],
)
def test_integrity_error_meaning_is_the_callers(integrity: str, code: Code, retryable: bool) -> None:
    """A unique violation is a retryable conflict or a permanent data error, as the caller declares."""
    exc = db_error(sa_exc.IntegrityError, pg_errors.UniqueViolation("duplicate key value"))
    failure = classify_exception(exc, integrity=integrity)  # type: ignore[arg-type]
    assert (failure.code, failure.retryable) == (code, retryable)


def test_http_status_error_keeps_retry_after_and_status() -> None:
    """An HTTPStatusError is classified from its response: status, body code and Retry-After."""
    failure = classify_exception(http_error(429, {"error": {"code": "rate_limit_exceeded"}}, {"Retry-After": "12"}), now=NOW)
    assert (failure.code, failure.retry_after, failure.upstream_status) == (Code.RATE_LIMITED, 12.0, 429)


def test_client_error_reads_retry_after_from_aws_headers() -> None:
    """A throttled AWS call honours a retry-after header in its response metadata."""
    failure = classify_exception(client_error("SlowDown", 503, "PutObject", {"retry-after": "9"}), now=NOW)
    assert (failure.code, failure.retry_after, failure.upstream_status) == (Code.RATE_LIMITED, 9.0, 503)


def test_redrive_error_is_classified_as_its_own_failure() -> None:
    """A RedriveError already knows its failure; classification returns it unchanged."""
    failure = Failure.of(Code.POLICY_REJECTED, detail="moderation block")
    assert classify_exception(RedriveError.of(failure)) is failure


def test_unknown_wrapper_defers_to_its_cause() -> None:
    """An unrecognised exception raised from a timeout is classified as the timeout."""
    try:
        try:
            raise httpx.ReadTimeout("read timed out", request=REQUEST)
        except httpx.ReadTimeout as inner:
            raise WeirdLibraryError("llm client failed") from inner
    except WeirdLibraryError as outer:
        failure = classify_exception(outer)
    assert failure.code == Code.NETWORK_TIMEOUT
    assert "WeirdLibraryError" in failure.detail and "ReadTimeout" in failure.detail


def test_public_message_never_holds_exception_text() -> None:
    """Exception text (which may hold secrets) stays out of the message; the detail keeps it redacted."""
    secret = "postgresql://app:Sup3rS3cret@db.internal/redrive"
    failure = classify_exception(raised(ValueError(f"cannot connect to {secret}")))
    assert failure.message == "internal invariant violated (ValueError)"
    assert "Sup3rS3cret" not in failure.message and "Sup3rS3cret" not in failure.detail
    assert failure.detail.startswith("ValueError: cannot connect to postgresql://app:[REDACTED:password:")


def test_detail_holds_the_exception_chain() -> None:
    """The detail lists type and message of the exception and its causes, newest first."""
    try:
        try:
            json.loads("{")
        except json.JSONDecodeError as inner:
            raise KeyError("matches") from inner
    except KeyError as outer:
        failure = classify_exception(outer)
    assert failure.detail.startswith("KeyError: 'matches' <- JSONDecodeError: Expecting property name")


def test_classifying_a_real_refused_connection() -> None:
    """A real connection to a closed local port is a retryable NETWORK_ERROR."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(httpx.ConnectError) as caught:
        httpx.get(f"http://127.0.0.1:{port}/", timeout=2.0)
    failure = classify_exception(caught.value)
    assert (failure.code, failure.retryable) == (Code.NETWORK_ERROR, True)


def test_classifying_a_real_read_timeout() -> None:
    """A real server that accepts but never answers yields a retryable NETWORK_TIMEOUT."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with pytest.raises(httpx.ReadTimeout) as caught:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=httpx.Timeout(2.0, read=0.05))
    failure = classify_exception(caught.value)
    assert (failure.code, failure.retryable) == (Code.NETWORK_TIMEOUT, True)


# ---------------------------------------------------------------------------------- error hierarchy


@pytest.mark.parametrize(
    ("code", "error_type"),
    [
        (Code.NETWORK_TIMEOUT, RetryableError),
        (Code.RATE_LIMITED, RetryableError),
        (Code.CONFLICT, ConflictError),
        (Code.AUTH_DENIED, PermanentError),
        (Code.UNKNOWN, PermanentError),
    ],
)
def test_redrive_error_of_picks_the_matching_subclass(code: Code, error_type: type[RedriveError]) -> None:
    """RedriveError.of raises retryable, conflict or permanent errors to match the failure."""
    err = RedriveError.of(Failure.of(code))
    assert type(err) is error_type
    assert err.retryable is default_retryable(code)


def test_conflict_error_is_a_retryable_error() -> None:
    """`except RetryableError` also catches conflicts, which are retryable."""
    assert issubclass(ConflictError, RetryableError)


def test_non_retryable_conflict_is_permanent() -> None:
    """A conflict a vocabulary made non-retryable (non-idempotent work) raises as permanent."""
    failure = Failure.of(Code.CONFLICT).as_code("CONFLICT", retryable=False)
    assert type(RedriveError.of(failure)) is PermanentError


def test_raise_failure_chains_the_cause_and_shows_the_public_message() -> None:
    """raise_failure raises `from` the cause, and str() of the error is the one-line public message."""
    cause = raised(TimeoutError("socket timed out after 30s"))
    failure = classify_exception(cause)
    with pytest.raises(RetryableError) as caught:
        raise_failure(failure, cause)
    assert caught.value.__cause__ is cause
    assert str(caught.value) == "network timeout (TimeoutError)"
    assert caught.value.failure is failure


def test_failure_message_is_forced_to_one_line() -> None:
    """A multi-line message is folded onto one line."""
    failure = Failure("X", False, None, "line one\nline two\tend", "")
    assert failure.message == "line one line two end"


def test_failure_rejects_negative_retry_after() -> None:
    """A negative retry_after is a bug in the caller, caught at construction."""
    with pytest.raises(ValueError, match="retry_after"):
        Failure("X", True, -1.0, "m", "d")


def test_as_code_keeps_the_core_code() -> None:
    """Renaming a failure for a vocabulary keeps its core code and retry_after."""
    failure = classify_http(429, None, {"Retry-After": "5"}, NOW).as_code("GW_5XX", retryable=True)
    assert (failure.code, failure.core, failure.retry_after) == ("GW_5XX", Code.RATE_LIMITED, 5.0)


def test_failure_is_frozen() -> None:
    """Failures are values: assigning to a field fails."""
    failure = Failure.of(Code.UNKNOWN)
    with pytest.raises(AttributeError):
        failure.code = "OTHER"  # type: ignore[misc]


def test_now_for_retry_after_defaults_to_utc() -> None:
    """Classifying without `now` still dates a Retry-After against the current UTC time."""
    future = datetime.now(UTC) + timedelta(seconds=600)
    failure = classify_exception(http_error(503, b"", {"Retry-After": format_datetime(future, usegmt=True)}))
    assert failure.retry_after is not None and 590 <= failure.retry_after <= 600
