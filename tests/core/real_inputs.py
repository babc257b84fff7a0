"""Real errors, one or more per core code, built from the libraries themselves (no mocks of their types)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

import botocore.exceptions as boto_exc
import httpx
import psycopg2.errors as pg_errors
import pydantic
import sqlalchemy.exc as sa_exc

from redrive.failures import Code, Failure, classify_exception

NOW = datetime(2026, 2, 26, 12, 0, 0, tzinfo=UTC)
REQUEST = httpx.Request("POST", "https://api.example.test/v1/chat/completions")


def http_error(
    status: int, body: object = None, headers: Mapping[str, str] | None = None
) -> httpx.HTTPStatusError:
    """A real HTTPStatusError, raised by ``raise_for_status`` on a real response."""
    if isinstance(body, dict):
        response = httpx.Response(status, json=body, headers=headers, request=REQUEST)
    else:
        response = httpx.Response(status, content=body or b"", headers=headers, request=REQUEST)
    try:
        response.raise_for_status()
    except httpx.HTTPStatusError as exc:
        return exc
    raise AssertionError(f"{status} did not raise")


def client_error(code: str, status: int, operation: str = "GetObject", headers: dict[str, str] | None = None) -> boto_exc.ClientError:
    """A botocore ClientError shaped like the service's parsed error response."""
    return boto_exc.ClientError(
        {
            "Error": {"Code": code, "Message": f"{code} happened"},
            "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers or {}, "RequestId": "req-1"},
        },
        operation,
    )


def db_error(wrapper: type[sa_exc.DBAPIError], orig: BaseException, **kwargs: bool) -> sa_exc.DBAPIError:
    """A SQLAlchemy DB-API wrapper around a psycopg2 error, as the engine raises it."""
    return wrapper("UPDATE job SET status = %(s)s", {"s": "running"}, orig, **kwargs)


class Ticket(pydantic.BaseModel):
    id: int
    title: str


def validation_error() -> pydantic.ValidationError:
    try:
        Ticket.model_validate({"id": "not-a-number"})
    except pydantic.ValidationError as exc:
        return exc
    raise AssertionError("validated")


def json_error() -> json.JSONDecodeError:
    try:
        json.loads('{"matches": [')
    except json.JSONDecodeError as exc:
        return exc
    raise AssertionError("parsed")


class WeirdLibraryError(Exception):
    """Something no classifier rule knows."""


def raised(exc: BaseException) -> BaseException:
    """``exc`` after a real raise, so it has a traceback."""
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001
        return caught


# One real input per core code, each a thunk returning the classified Failure.
REAL: Mapping[Code, Callable[[], Failure]] = {
    Code.NETWORK_TIMEOUT: lambda: classify_exception(httpx.ReadTimeout("timed out", request=REQUEST), now=NOW),
    Code.NETWORK_ERROR: lambda: classify_exception(httpx.ConnectError("[Errno 111] Connection refused", request=REQUEST), now=NOW),
    Code.UPSTREAM_UNAVAILABLE: lambda: classify_exception(http_error(503, b"<html>busy</html>"), now=NOW),
    Code.UPSTREAM_INTERNAL: lambda: classify_exception(
        http_error(500, {"error": {"code": "internal_error", "message": "oops"}}), now=NOW
    ),
    Code.RATE_LIMITED: lambda: classify_exception(
        http_error(429, {"error": {"code": "rate_limit_exceeded", "type": "requests"}}, {"Retry-After": "7"}), now=NOW
    ),
    Code.CONFLICT: lambda: classify_exception(
        db_error(sa_exc.IntegrityError, pg_errors.UniqueViolation("duplicate key value violates unique constraint")),
        integrity="conflict",
    ),
    Code.SCHEMA_INVALID: lambda: classify_exception(validation_error()),
    Code.PARSE_ERROR: lambda: classify_exception(json_error()),
    Code.CONTEXT_LENGTH_EXCEEDED: lambda: classify_exception(
        http_error(400, {"error": {"code": "context_length_exceeded", "type": "invalid_request_error"}}), now=NOW
    ),
    Code.BAD_REQUEST: lambda: classify_exception(http_error(422, {"detail": "unprocessable"}), now=NOW),
    Code.AUTH_DENIED: lambda: classify_exception(
        http_error(401, {"error": {"code": "invalid_api_key", "type": "invalid_request_error"}}), now=NOW
    ),
    Code.NOT_FOUND: lambda: classify_exception(client_error("NoSuchKey", 404)),
    Code.POLICY_REJECTED: lambda: classify_exception(
        http_error(400, {"error": {"code": "content_policy_violation"}}), now=NOW
    ),
    Code.DB_TRANSIENT: lambda: classify_exception(
        db_error(sa_exc.OperationalError, pg_errors.DeadlockDetected("deadlock detected"))
    ),
    Code.DATA_ERROR: lambda: classify_exception(
        db_error(sa_exc.IntegrityError, pg_errors.ForeignKeyViolation("violates foreign key constraint")),
        integrity="data",
    ),
    Code.INVARIANT_VIOLATION: lambda: classify_exception(raised(AssertionError("lease held by nobody"))),
    Code.UNKNOWN: lambda: classify_exception(raised(WeirdLibraryError("???"))),
}

assert set(REAL) == set(Code), "every core code needs a real input"
