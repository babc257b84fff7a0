"""One model of a failure, and the classifiers that turn real errors into it.

Every pipeline sees the same :class:`Failure`: a stable core :class:`Code`, whether a retry can help,
how long the server asked us to wait, a one-line public message and a sanitized internal detail.
Each seed's own words for these codes live in :mod:`redrive.vocabularies` as tables; retry timing in
:mod:`redrive.backoff`; the decision in :mod:`redrive.budgets`.

Classifiers never put exception text into the public ``message`` (it may hold secrets or paths);
the text goes into ``detail``, redacted by :func:`redrive.sanitize.sanitize_text`.
"""

from __future__ import annotations

import json
import math
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import Literal, NoReturn

import botocore.exceptions as boto_exc
import httpx
import psycopg2
import psycopg2.errors as pg_errors
import pydantic
import sqlalchemy.exc as sa_exc
import sqlalchemy.orm.exc as sa_orm_exc

from redrive.sanitize import sanitize_text

__all__ = [
    "DEFAULT_RETRYABLE",
    "MAX_DETAIL_CHARS",
    "Code",
    "ConflictError",
    "Failure",
    "PermanentError",
    "RUNTIME_BUGS",
    "RedriveError",
    "RetryableError",
    "classify_exception",
    "classify_http",
    "default_retryable",
    "describe_exception",
    "parse_retry_after",
    "raise_failure",
]

MAX_DETAIL_CHARS = 2000
"""Internal detail is cut to this length; the full stack goes through :func:`redrive.sanitize.sanitize_exception`."""
_MAX_DELTA_SECONDS = 2**31
"""RFC 9111 §1.2.2: a delta-seconds too large to represent is read as 2^31."""


class Code(StrEnum):
    """Stable core failure codes; every seed's vocabulary is a table keyed by these."""

    NETWORK_TIMEOUT = "NETWORK_TIMEOUT"
    NETWORK_ERROR = "NETWORK_ERROR"  # connection refused/reset, DNS
    UPSTREAM_UNAVAILABLE = "UPSTREAM_UNAVAILABLE"  # 502/503/504
    UPSTREAM_INTERNAL = "UPSTREAM_INTERNAL"  # 500, provider internal_error
    RATE_LIMITED = "RATE_LIMITED"  # 429, rate_limit_exceeded, quota windows
    CONFLICT = "CONFLICT"  # optimistic lock, duplicate-write race
    SCHEMA_INVALID = "SCHEMA_INVALID"  # pydantic validation, schema mismatch
    PARSE_ERROR = "PARSE_ERROR"  # malformed JSON
    CONTEXT_LENGTH_EXCEEDED = "CONTEXT_LENGTH_EXCEEDED"  # 400 context window
    BAD_REQUEST = "BAD_REQUEST"  # other 4xx
    AUTH_DENIED = "AUTH_DENIED"  # 401/403, invalid key
    NOT_FOUND = "NOT_FOUND"  # 404
    POLICY_REJECTED = "POLICY_REJECTED"  # moderation, hard business-rule deny
    DB_TRANSIENT = "DB_TRANSIENT"  # deadlock, serialization failure, connection loss
    DATA_ERROR = "DATA_ERROR"  # integrity violation the caller calls a data problem
    INVARIANT_VIOLATION = "INVARIANT_VIOLATION"  # our bug: illegal state, assertion
    UNKNOWN = "UNKNOWN"


DEFAULT_RETRYABLE: frozenset[Code] = frozenset(
    {
        Code.NETWORK_TIMEOUT,
        Code.NETWORK_ERROR,
        Code.UPSTREAM_UNAVAILABLE,
        Code.UPSTREAM_INTERNAL,
        Code.RATE_LIMITED,
        Code.CONFLICT,
        Code.DB_TRANSIENT,
    }
)
"""Core codes a retry can fix. UNKNOWN is not among them: an unclassified error is a missing rule."""


def default_retryable(code: str) -> bool:
    """Whether a core code is retryable before any seed's vocabulary has its say."""
    return code in DEFAULT_RETRYABLE


_PUBLIC_MESSAGES: Mapping[Code, str] = {
    Code.NETWORK_TIMEOUT: "network timeout",
    Code.NETWORK_ERROR: "network error",
    Code.UPSTREAM_UNAVAILABLE: "upstream unavailable",
    Code.UPSTREAM_INTERNAL: "upstream internal error",
    Code.RATE_LIMITED: "rate limited",
    Code.CONFLICT: "conflicting concurrent write",
    Code.SCHEMA_INVALID: "schema validation failed",
    Code.PARSE_ERROR: "malformed payload",
    Code.CONTEXT_LENGTH_EXCEEDED: "input exceeds the model context window",
    Code.BAD_REQUEST: "request rejected",
    Code.AUTH_DENIED: "authentication or authorization denied",
    Code.NOT_FOUND: "resource not found",
    Code.POLICY_REJECTED: "rejected by content policy",
    Code.DB_TRANSIENT: "transient database error",
    Code.DATA_ERROR: "data integrity error",
    Code.INVARIANT_VIOLATION: "internal invariant violated",
    Code.UNKNOWN: "unclassified error",
}


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


@dataclass(frozen=True)
class Failure:
    """A classified failure: what went wrong, whether retrying can help, and what to tell whom.

    ``code`` is a core :class:`Code` until a vocabulary translates it; ``core_code`` then keeps the
    core code, so a vocabulary can be applied again (or another one) without guessing.
    """

    code: str
    retryable: bool
    retry_after: float | None
    message: str
    detail: str
    upstream_status: int | None = None
    core_code: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", _one_line(self.message))
        if self.retry_after is not None and not (math.isfinite(self.retry_after) and self.retry_after >= 0):
            raise ValueError(f"retry_after must be a finite number of seconds >= 0, got {self.retry_after!r}")

    @property
    def core(self) -> str:
        """The core code, whether or not a vocabulary has renamed ``code``."""
        return self.core_code or self.code

    @classmethod
    def of(
        cls,
        code: Code,
        *,
        detail: str = "",
        message: str | None = None,
        retry_after: float | None = None,
        upstream_status: int | None = None,
        retryable: bool | None = None,
    ) -> Failure:
        """Build a core failure with the code's default retryability and public message."""
        return cls(
            code=str(code),
            retryable=default_retryable(code) if retryable is None else retryable,
            retry_after=retry_after,
            message=message or _PUBLIC_MESSAGES.get(code, "error"),
            detail=_clip(sanitize_text(detail)),
            upstream_status=upstream_status,
        )

    def as_code(self, code: str, *, retryable: bool) -> Failure:
        """The same failure under a vocabulary's code and retryability; the core code is kept."""
        return replace(self, code=code, retryable=retryable, core_code=self.core)


def _clip(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -------------------------------------------------------------------------------------- exceptions


class RedriveError(Exception):
    """An error carrying its classified :class:`Failure`; ``str()`` is the public one-line message.

    The failure is authoritative; :meth:`of` picks the subclass that agrees with it. ``attempts`` is
    set by the retry loop to how many calls were made before giving up.
    """

    def __init__(self, failure: Failure, *, attempts: int | None = None) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.attempts = attempts

    def __str__(self) -> str:
        return self.failure.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.failure.code!s}, retryable={self.failure.retryable})"

    @property
    def retryable(self) -> bool:
        return self.failure.retryable

    @classmethod
    def of(cls, failure: Failure, *, attempts: int | None = None) -> RedriveError:
        """The subclass matching the failure: conflict, retryable or permanent."""
        if failure.retryable and failure.core == Code.CONFLICT:
            return ConflictError(failure, attempts=attempts)
        if failure.retryable:
            return RetryableError(failure, attempts=attempts)
        return PermanentError(failure, attempts=attempts)


class RetryableError(RedriveError):
    """A retry may succeed (at the Dagster edge: ``RetryRequested``)."""


class ConflictError(RetryableError):
    """A retryable write conflict (optimistic lock, duplicate-write race); a retry re-reads first.

    A subclass of :class:`RetryableError` so ``except RetryableError`` covers it.
    """


class PermanentError(RedriveError):
    """Retrying cannot help (at the Dagster edge: ``Failure(allow_retries=False)``)."""


def raise_failure(failure: Failure, cause: BaseException | None = None) -> NoReturn:
    """Raise the :class:`RedriveError` subclass for ``failure``, chained ``from`` its cause."""
    raise RedriveError.of(failure) from cause


# ------------------------------------------------------------------------------------- runtime bugs

RUNTIME_BUGS: tuple[type[BaseException], ...] = (
    AssertionError,
    TypeError,
    AttributeError,  # includes a None dereference
    LookupError,  # KeyError, IndexError
    ValueError,  # after the payload errors above, which are ValueErrors too
    NameError,  # UnboundLocalError
    RuntimeError,  # NotImplementedError, RecursionError, "illegal state"
    ArithmeticError,  # ZeroDivisionError, OverflowError
    ImportError,  # a bad deploy: a module or name missing
    SystemError,  # the interpreter's own invariant broke
)
"""Exceptions classified INVARIANT_VIOLATION: our code or its configuration is wrong, not the world."""

_WRAPPERS: frozenset[type[BaseException]] = frozenset({RuntimeError, Exception})
"""Generic types often raised `from` a real cause; the cause is consulted first."""


# ------------------------------------------------------------------------------------- Retry-After

_DELTA_SECONDS = re.compile(r"[0-9]+")


def parse_retry_after(value: str | None, now: datetime) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (RFC 9110 §10.2.3), or None; never raises.

    Accepts delta-seconds (digits only: ``"1.5"`` and ``"-3"`` are not delta-seconds and give None)
    and an HTTP-date in IMF-fixdate, RFC 850 or asctime form (asctime carries no zone and is GMT).
    A date in the past gives 0.0. Huge deltas are read as 2^31 seconds (RFC 9111 §1.2.2).
    """
    try:
        if value is None:
            return None
        text = value.strip()
        if not text:
            return None
        if _DELTA_SECONDS.fullmatch(text):
            return float(min(int(text), _MAX_DELTA_SECONDS)) if len(text) < 12 else float(_MAX_DELTA_SECONDS)
        if not any(ch.isalpha() for ch in text):  # "1.5", "-3": not a number we accept, not a date
            return None
        when = parsedate_to_datetime(text)
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        reference = now if now.tzinfo is not None else now.replace(tzinfo=UTC)
        return max(0.0, (when - reference).total_seconds())
    except Exception:  # malformed dates raise ValueError/TypeError/OverflowError/IndexError
        return None


def _header(headers: Mapping[str, str] | None, name: str) -> str | None:
    if not headers:
        return None
    wanted = name.lower()
    for key, val in headers.items():
        if isinstance(key, str) and key.lower() == wanted:
            return str(val)
    return None


# ------------------------------------------------------------------------------------ HTTP classifier

# Provider error codes found in response bodies (OpenAI-style `{"error": {"code", "type"}}` and plain
# `{"code": ...}`), matched case-insensitively. 002 §8.1 names most of them.
_BODY_CODES: Mapping[str, Code] = {
    "rate_limit_exceeded": Code.RATE_LIMITED,
    "rate_limit_error": Code.RATE_LIMITED,
    "insufficient_quota": Code.RATE_LIMITED,  # 002 §8.1: "temporary quota windows" are retryable
    "quota_exceeded": Code.RATE_LIMITED,
    "context_length_exceeded": Code.CONTEXT_LENGTH_EXCEEDED,
    "string_above_max_length": Code.CONTEXT_LENGTH_EXCEEDED,
    "internal_error": Code.UPSTREAM_INTERNAL,
    "server_error": Code.UPSTREAM_INTERNAL,
    "api_error": Code.UPSTREAM_INTERNAL,
    "overloaded_error": Code.UPSTREAM_UNAVAILABLE,
    "service_unavailable": Code.UPSTREAM_UNAVAILABLE,
    "invalid_api_key": Code.AUTH_DENIED,
    "authentication_error": Code.AUTH_DENIED,
    "permission_denied": Code.AUTH_DENIED,
    "permission_error": Code.AUTH_DENIED,
    "content_policy_violation": Code.POLICY_REJECTED,
    "content_filter": Code.POLICY_REJECTED,
    "case_not_found": Code.NOT_FOUND,  # 004 §7: the case was deleted
    "not_found_error": Code.NOT_FOUND,
    "invalid_recipient": Code.BAD_REQUEST,  # 002 review notifications §8.1: permanent
}

_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]{0,63}")


def _parse_body(body: bytes | str | Mapping[str, object] | None) -> object:
    if body is None or isinstance(body, Mapping):
        return body
    try:
        return json.loads(body)
    except (ValueError, TypeError):
        return None


def _body_codes(parsed: object) -> list[str]:
    """Identifier-like code strings from the usual places in an error body, most specific first."""
    found: list[str] = []
    if not isinstance(parsed, Mapping):
        return found
    err = parsed.get("error")
    if isinstance(err, Mapping):
        for key in ("code", "type", "status"):
            found.append(err.get(key))  # type: ignore[arg-type]
    elif isinstance(err, str):
        found.append(err)
    for key in ("code", "error_code", "errorCode", "type"):
        found.append(parsed.get(key))  # type: ignore[arg-type]
    return [c for c in found if isinstance(c, str) and _IDENTIFIER.fullmatch(c)]


def _code_for_status(status: int) -> Code:
    if status == 429:
        return Code.RATE_LIMITED
    if status in (502, 503, 504):
        return Code.UPSTREAM_UNAVAILABLE
    if status >= 500:
        return Code.UPSTREAM_INTERNAL
    if status in (401, 403):
        return Code.AUTH_DENIED
    if status == 404:
        return Code.NOT_FOUND
    if status == 408:  # the server gave up waiting for our request: a timeout, retryable
        return Code.NETWORK_TIMEOUT
    if status == 409:
        return Code.CONFLICT
    if status >= 400:
        return Code.BAD_REQUEST
    return Code.UNKNOWN  # 1xx-3xx handed to a failure classifier: a caller bug, not a retry case


def _body_excerpt(body: bytes | str | Mapping[str, object] | None, limit: int = 512) -> str:
    if body is None:
        return ""
    if isinstance(body, Mapping):
        text = json.dumps(body, default=repr)[:limit]
    elif isinstance(body, bytes):
        text = body[:limit].decode("utf-8", "replace")
    else:
        text = body[:limit]
    return text


def classify_http(
    status: int,
    body: bytes | str | Mapping[str, object] | None,
    headers: Mapping[str, str] | None,
    now: datetime,
) -> Failure:
    """Classify an HTTP error response by its provider error code, then its status (002 §8.1).

    A recognised body code wins over the status (a 400 with ``context_length_exceeded`` is not a
    generic bad request). ``Retry-After`` is read on any status; it matters on 429 and 503.
    """
    parsed = _parse_body(body)
    codes = _body_codes(parsed)
    body_code = next((c for c in codes if c.lower() in _BODY_CODES), None)
    code = _BODY_CODES[body_code.lower()] if body_code else _code_for_status(status)
    retry_after = parse_retry_after(_header(headers, "retry-after"), now)
    label = body_code or (codes[0] if codes else None)
    message = f"upstream answered {status}" + (f" ({label})" if label else "")
    detail = f"HTTP {status}; code={label or '-'}; body={_body_excerpt(body)}"
    return Failure.of(code, message=message, detail=detail, retry_after=retry_after, upstream_status=status)


# ------------------------------------------------------------------------------- exception classifier


def describe_exception(exc: BaseException) -> str:
    """``type: message`` for the exception and its cause/context chain, newest first, sanitized."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(parts) < 8:
        seen.add(id(current))
        try:
            text = str(current)
        except Exception:
            text = "<unprintable>"
        name = type(current).__qualname__
        parts.append(f"{name}: {text}" if text else name)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return _clip(sanitize_text(" <- ".join(parts)))


# AWS error codes (ClientError.response["Error"]["Code"]) whose meaning beats the HTTP status.
_AWS_CODES: Mapping[str, Code] = {
    **dict.fromkeys(
        (
            "Throttling",
            "ThrottlingException",
            "ThrottledException",
            "SlowDown",
            "RequestLimitExceeded",
            "RequestThrottled",
            "RequestThrottledException",
            "TooManyRequestsException",
            "ProvisionedThroughputExceededException",
            "LimitExceededException",
            "BandwidthLimitExceeded",
            "OverLimit",
        ),
        Code.RATE_LIMITED,
    ),
    **dict.fromkeys(
        (
            "NoSuchKey",
            "NoSuchBucket",
            "NoSuchUpload",
            "NotFound",
            "404",
            "ResourceNotFoundException",
            "QueueDoesNotExist",
            "AWS.SimpleQueueService.NonExistentQueue",
        ),
        Code.NOT_FOUND,
    ),
    **dict.fromkeys(
        (
            "AccessDenied",
            "AccessDeniedException",
            "403",
            "Forbidden",
            "UnrecognizedClientException",
            "InvalidAccessKeyId",
            "InvalidClientTokenId",
            "SignatureDoesNotMatch",
            "InvalidSignatureException",
            "ExpiredToken",
            "ExpiredTokenException",
            "AuthFailure",
            "KMS.AccessDeniedException",
        ),
        Code.AUTH_DENIED,
    ),
    # Conditional writes that lost a race: optimistic-lock conflicts.
    **dict.fromkeys(
        (
            "PreconditionFailed",
            "ConditionalRequestConflict",
            "ConditionalCheckFailedException",
            "TransactionConflictException",
            "OperationAborted",
        ),
        Code.CONFLICT,
    ),
    **dict.fromkeys(("RequestTimeout", "RequestTimeoutException"), Code.NETWORK_TIMEOUT),
    **dict.fromkeys(
        ("ServiceUnavailable", "ServiceUnavailableException", "Unavailable", "503"), Code.UPSTREAM_UNAVAILABLE
    ),
    **dict.fromkeys(("InternalError", "InternalFailure", "InternalServerError", "500"), Code.UPSTREAM_INTERNAL),
}

# Postgres SQLSTATEs a retry fixes (Appendix A of the PostgreSQL manual).
_PG_TRANSIENT = frozenset(
    {
        "40P01",  # deadlock_detected
        "40001",  # serialization_failure
        "40003",  # statement_completion_unknown
        "55P03",  # lock_not_available
        "57014",  # query_canceled (statement_timeout)
        "57P01",  # admin_shutdown
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now
        "53300",  # too_many_connections
    }
)

# psycopg2 classes, for errors built without a server (pgcode is None then): most specific first.
_PG_CLASSES: tuple[tuple[type[BaseException], str], ...] = (
    (pg_errors.DeadlockDetected, "40P01"),
    (pg_errors.SerializationFailure, "40001"),
    (pg_errors.LockNotAvailable, "55P03"),
    (pg_errors.QueryCanceled, "57014"),
    (pg_errors.AdminShutdown, "57P01"),
    (pg_errors.TooManyConnections, "53300"),
    (pg_errors.UniqueViolation, "23505"),
    (pg_errors.ForeignKeyViolation, "23503"),
    (pg_errors.NotNullViolation, "23502"),
    (pg_errors.CheckViolation, "23514"),
    (pg_errors.ExclusionViolation, "23P01"),
    (psycopg2.IntegrityError, "23000"),
)

Integrity = Literal["conflict", "data"]


def _sqlstate(err: object) -> str | None:
    code = getattr(err, "pgcode", None)
    if isinstance(code, str) and code:
        return code
    for cls, state in _PG_CLASSES:
        if isinstance(err, cls):
            return state
    return None


def _classify_db(exc: BaseException, orig: object, integrity: Integrity, invalidated: bool) -> Code:
    """Postgres errors by SQLSTATE first, then by DB-API class (psycopg2 or the SQLAlchemy wrapper)."""
    state = _sqlstate(orig)
    if invalidated:
        return Code.DB_TRANSIENT
    if state is not None:
        if state in _PG_TRANSIENT or state.startswith("08"):
            return Code.DB_TRANSIENT
        if state.startswith("23"):
            return Code.CONFLICT if integrity == "conflict" else Code.DATA_ERROR
        if state.startswith("22"):
            return Code.DATA_ERROR
        if state.startswith(("42", "25", "0A", "XX")):
            return Code.INVARIANT_VIOLATION
    for err in (orig, exc):
        if isinstance(err, psycopg2.IntegrityError | sa_exc.IntegrityError):
            return Code.CONFLICT if integrity == "conflict" else Code.DATA_ERROR
        if isinstance(err, psycopg2.OperationalError | psycopg2.InterfaceError):
            return Code.DB_TRANSIENT
        if isinstance(err, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.DisconnectionError):
            return Code.DB_TRANSIENT
        if isinstance(err, psycopg2.DataError | sa_exc.DataError):
            return Code.DATA_ERROR
        if isinstance(
            err,
            psycopg2.ProgrammingError
            | psycopg2.NotSupportedError
            | psycopg2.InternalError
            | sa_exc.ProgrammingError
            | sa_exc.NotSupportedError
            | sa_exc.InternalError,
        ):
            return Code.INVARIANT_VIOLATION
    return Code.UNKNOWN


def _classify_client_error(exc: boto_exc.ClientError, now: datetime) -> Failure:
    response = exc.response or {}
    error = response.get("Error") or {}
    meta = response.get("ResponseMetadata") or {}
    aws_code = str(error.get("Code") or "")
    status = meta.get("HTTPStatusCode")
    status = status if isinstance(status, int) else None
    code = _AWS_CODES.get(aws_code) or (_code_for_status(status) if status else Code.UNKNOWN)
    retry_after = parse_retry_after(_header(meta.get("HTTPHeaders"), "retry-after"), now)
    label = aws_code if _IDENTIFIER.fullmatch(aws_code or "-") else None
    message = f"AWS {exc.operation_name or 'call'} failed" + (f" ({label})" if label else "")
    if status:
        message += f" with {status}"
    return Failure.of(
        code, message=message, detail=describe_exception(exc), retry_after=retry_after, upstream_status=status
    )


def classify_exception(
    exc: BaseException,
    *,
    integrity: Integrity = "conflict",
    now: datetime | None = None,
) -> Failure:
    """Classify a raised exception into a core :class:`Failure`.

    ``integrity`` says what a unique/foreign-key violation means to the caller: a lost race to retry
    (``"conflict"``, the default, e.g. two workers inserting the same idempotency key) or bad input
    (``"data"``). ``now`` dates ``Retry-After`` headers (defaults to the system clock).
    An exception nothing recognises defers to its ``__cause__`` before falling back to UNKNOWN, so a
    library's wrapper around a timeout is still a timeout.
    """
    failure = _classify_one(exc, integrity, now)
    if not (failure.core == Code.UNKNOWN or type(exc) in _WRAPPERS):
        return failure
    # A bare RuntimeError/Exception is often a wrapper (`raise RuntimeError("fetch failed") from timeout`):
    # what it wraps names the failure better; with nothing recognisable inside, the wrapper's own code stands.
    cause = exc.__cause__
    hops = 0
    while cause is not None and hops < 5:
        inner = _classify_one(cause, integrity, now)
        if inner.core not in (Code.UNKNOWN, Code.INVARIANT_VIOLATION) or (
            failure.core == Code.UNKNOWN and inner.core != Code.UNKNOWN
        ):
            return replace(inner, detail=describe_exception(exc))
        cause, hops = cause.__cause__, hops + 1
    return failure


def _classify_one(exc: BaseException, integrity: Integrity, now: datetime | None) -> Failure:
    when = now or datetime.now(UTC)
    kind = type(exc).__name__

    def make(code: Code, **kwargs: object) -> Failure:
        message = f"{_PUBLIC_MESSAGES[code]} ({kind})"
        return Failure.of(code, message=message, detail=describe_exception(exc), **kwargs)  # type: ignore[arg-type]

    if isinstance(exc, RedriveError):
        return exc.failure

    # httpx: status errors carry a response; transport errors say what broke.
    if isinstance(exc, httpx.HTTPStatusError):
        response = exc.response
        try:
            content: bytes | None = response.content
        except httpx.ResponseNotRead:
            content = None
        http = classify_http(response.status_code, content, response.headers, when)
        return replace(http, detail=_clip(f"{http.detail}; {describe_exception(exc)}"))
    if isinstance(exc, httpx.TimeoutException):
        return make(Code.NETWORK_TIMEOUT)
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.LocalProtocolError | httpx.InvalidURL):
        return make(Code.INVARIANT_VIOLATION)  # we built a bad request: retrying sends it again
    if isinstance(exc, httpx.NetworkError | httpx.RemoteProtocolError | httpx.ProxyError):
        return make(Code.NETWORK_ERROR)
    if isinstance(exc, httpx.DecodingError):
        return make(Code.PARSE_ERROR)

    # botocore: timeouts, connection failures, then service errors by AWS code and status.
    if isinstance(exc, boto_exc.ConnectTimeoutError | boto_exc.ReadTimeoutError):
        return make(Code.NETWORK_TIMEOUT)
    if isinstance(exc, boto_exc.ConnectionError | boto_exc.HTTPClientError):
        return make(Code.NETWORK_ERROR)
    if isinstance(exc, boto_exc.NoCredentialsError | boto_exc.PartialCredentialsError):
        return make(Code.AUTH_DENIED)
    if isinstance(exc, boto_exc.ParamValidationError):
        return make(Code.BAD_REQUEST)
    if isinstance(exc, boto_exc.ClientError):
        return _classify_client_error(exc, when)

    # SQLAlchemy and psycopg2: pool timeouts, DB-API errors by SQLSTATE, stale optimistic locks.
    if isinstance(exc, sa_exc.TimeoutError):
        return make(Code.DB_TRANSIENT)
    if isinstance(exc, sa_orm_exc.StaleDataError):
        return make(Code.CONFLICT)  # version_id_col mismatch: someone else wrote first
    if isinstance(exc, sa_exc.DBAPIError):
        code = _classify_db(exc, exc.orig, integrity, bool(exc.connection_invalidated))
        return make(code)
    if isinstance(exc, psycopg2.Error):
        return make(_classify_db(exc, exc, integrity, False))

    # Payloads: pydantic's ValidationError and JSONDecodeError are ValueErrors, so they come first.
    if isinstance(exc, pydantic.ValidationError):
        return make(Code.SCHEMA_INVALID)
    if isinstance(exc, json.JSONDecodeError | UnicodeDecodeError):
        return make(Code.PARSE_ERROR)

    # The standard library's network errors (socket.timeout is TimeoutError since 3.10).
    if isinstance(exc, TimeoutError):
        return make(Code.NETWORK_TIMEOUT)
    if isinstance(exc, ConnectionError | socket.gaierror):
        return make(Code.NETWORK_ERROR)

    # Programming and configuration errors (002 §8.1 "Configuration/runtime bug": null dereference,
    # illegal state, invariant violation, bad deploy config): a retry runs the same code on the same state.
    if isinstance(exc, RUNTIME_BUGS):
        return make(Code.INVARIANT_VIOLATION)
    return make(Code.UNKNOWN)
