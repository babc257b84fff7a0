"""The evidence pipeline's external services: the case API (attach, look up) and the merchant mail channel.

Both are idempotent by a key we derive (the artifact id; the notification token), so a retry after
a lost response never duplicates an effect. Errors are raised, never swallowed: an HTTP error as
`httpx.HTTPStatusError` and a transport failure as httpx's own exception, for the core's
classifier; a 2xx whose body we cannot read means "outcome unknown" and is raised as a retryable
`UPSTREAM_INTERNAL` (not as a data error: the file is fine, the answer was lost). One
`httpx.Client` per session keeps connections alive across a row's artifacts.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import NoReturn, TypeVar
from uuid import UUID

import httpx
import pydantic
from dagster import ConfigurableResource
from pydantic import BaseModel, ConfigDict, Field

from redrive.failures import Code, Failure, raise_failure
from redrive.upstreams import guarded

M = TypeVar("M", bound=BaseModel)


@lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    """One verifying TLS context per process (building one per session costs more than a row's calls)."""
    return ssl.create_default_context()


class CaseAttachment(BaseModel):
    """What the case API says about one attached evidence file."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    attachment_id: str = Field(min_length=1)
    case_id: str
    artifact_id: str
    status: str


class MailAccepted(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    message_id: str = Field(min_length=1)


def _read(response: httpx.Response, model: type[M], what: str) -> M:
    try:
        return model.model_validate_json(response.content)
    except (pydantic.ValidationError, ValueError) as exc:
        _unreadable(response, what, exc)


def _unreadable(response: httpx.Response, what: str, exc: Exception) -> NoReturn:
    raise_failure(Failure.of(Code.UPSTREAM_INTERNAL, retryable=True,
                             message=f"{what} answered {response.status_code} with an unreadable body",
                             detail=f"{type(exc).__name__}", upstream_status=response.status_code), exc)


class CaseApiClient:
    """`POST /cases/{case}/evidence` with `Idempotency-Key: <artifact id>`; `GET /attachments?idempotency_key=`."""

    def __init__(self, http: httpx.Client) -> None:
        self._http = http

    def attach(self, case_id: UUID, artifact_id: UUID, *, filename: str, content_sha256: str,
               s3_key: str) -> CaseAttachment:
        response = guarded("case_api", lambda: self._http.post(
            f"cases/{case_id}/evidence",
            json={"artifact_id": str(artifact_id), "filename": filename, "content_sha256": content_sha256,
                  "s3_key": s3_key},
            headers={"Idempotency-Key": str(artifact_id)},
        ))
        response.raise_for_status()
        return _read(response, CaseAttachment, "case API attach")

    def lookup(self, artifact_id: UUID) -> CaseAttachment | None:
        """The attachment made with this artifact's idempotency key, or None when there is none."""
        response = guarded("case_api", lambda: self._http.get("attachments",
                                                              params={"idempotency_key": str(artifact_id)}))
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return _read(response, CaseAttachment, "case API lookup")


class CaseApiResource(ConfigurableResource):
    """The case management API (the sandbox locally); `token` is a secret (CASE_API_TOKEN)."""

    base_url: str
    token: str
    timeout_seconds: float = 10.0

    @contextmanager
    def session(self) -> Iterator[CaseApiClient]:
        with httpx.Client(base_url=self.base_url.rstrip("/") + "/", timeout=self.timeout_seconds, verify=_tls(),
                          headers={"Authorization": f"Bearer {self.token}"}) as http:
            yield CaseApiClient(http)


class MailClient:
    """The mail provider: a send is idempotent per `idempotency_token`; a lookup finds it by token."""

    def __init__(self, http: httpx.Client) -> None:
        self._http = http

    def send(self, *, to: str, subject: str, text: str, token: str) -> str:
        response = guarded("mail", lambda: self._http.post("messages", json={
            "to": to, "subject": subject, "text": text, "idempotency_token": token}))
        response.raise_for_status()
        return _read(response, MailAccepted, "mail provider").message_id

    def find(self, token: str) -> str | None:
        response = guarded("mail", lambda: self._http.get("messages", params={"idempotency_token": token}))
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return _read(response, MailAccepted, "mail provider lookup").message_id


class MerchantMailResource(ConfigurableResource):
    """Where N1/N2 go: the mail provider's HTTP API (the sandbox locally); `token` from MAIL_API_TOKEN."""

    base_url: str
    token: str = "sandbox-token"
    timeout_seconds: float = 10.0

    @contextmanager
    def session(self) -> Iterator[MailClient]:
        with httpx.Client(base_url=self.base_url.rstrip("/") + "/", timeout=self.timeout_seconds, verify=_tls(),
                          headers={"Authorization": f"Bearer {self.token}"}) as http:
            yield MailClient(http)
