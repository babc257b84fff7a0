"""The mail provider review notifications are sent through (the sandbox locally), over HTTP with httpx.

    POST /messages {to, subject, text, idempotency_token} → 202 {message_id} (the same token again →
         200 with the same id and no second email; another body under the same token → 409)
    GET  /messages?idempotency_token=T and GET /messages/{message_id} → 200 {message_id, …} or 404

The client only speaks the wire format. A non-2xx answer raises `httpx.HTTPStatusError` and a body
that does not parse raises `json.JSONDecodeError` / `pydantic.ValidationError`; the core's
classifier names each of them (`redrive.failures.classify_exception`). A lookup's 404 is an answer
("the provider has nothing"), not an error, so it returns None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx
from dagster import ConfigurableResource
from pydantic import BaseModel, ConfigDict, Field
from redrive.upstreams import guarded


class OutgoingMail(BaseModel):
    """What is sent: deterministic for one (changelist, recipient, version), so a resend is byte-identical."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    to: str = Field(min_length=3)
    subject: str = Field(min_length=1)
    text: str = Field(min_length=1)
    idempotency_token: str = Field(min_length=1)


class Accepted(BaseModel):
    model_config = ConfigDict(extra="ignore")

    message_id: str = Field(min_length=1)


class ProviderMessage(BaseModel):
    """The provider's record of a message: the evidence that a send happened."""

    model_config = ConfigDict(extra="ignore")

    message_id: str = Field(min_length=1)
    status: str = ""
    idempotency_token: str | None = None


@dataclass
class MailProvider:
    """One HTTP connection pool to the provider for the duration of a run (close it, or use `with`)."""

    base_url: str
    api_token: str
    timeout_seconds: float = 10.0
    transport: httpx.BaseTransport | None = None
    _http: httpx.Client | None = field(default=None, init=False, repr=False)

    @property
    def http(self) -> httpx.Client:
        if self._http is None:
            self._http = httpx.Client(
                base_url=self.base_url.rstrip("/"),
                timeout=self.timeout_seconds,
                headers={"Authorization": f"Bearer {self.api_token}"},
                transport=self.transport,
            )
        return self._http

    def send(self, mail: OutgoingMail) -> str:
        """Send once per token; returns the provider's message id (also for a replayed token)."""
        response = guarded("mail", lambda: self.http.post("/messages", json=mail.model_dump()))
        response.raise_for_status()
        return Accepted.model_validate(_json(response)).message_id

    def find_by_token(self, token: str) -> ProviderMessage | None:
        return self._lookup("/messages", params={"idempotency_token": token})

    def find_by_id(self, message_id: str) -> ProviderMessage | None:
        return self._lookup(f"/messages/{quote(message_id, safe='')}")

    def _lookup(self, path: str, params: dict[str, str] | None = None) -> ProviderMessage | None:
        response = guarded("mail", lambda: self.http.get(path, params=params))
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return ProviderMessage.model_validate(_json(response))

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def __enter__(self) -> MailProvider:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _json(response: httpx.Response) -> Any:
    return json.loads(response.content)


class MailProviderResource(ConfigurableResource):
    """The review-notification mail provider: base URL (MAIL_API_URL, or the sandbox) and its API token."""

    base_url: str = Field(description="e.g. https://mail.example.com/v1; locally the sandbox's /mail/v1")
    api_token: str = Field(default="sandbox-token", description="Bearer token (REVIEW_NOTIFICATIONS_MAIL_API_TOKEN)")
    timeout_seconds: float = 10.0

    def provider(self) -> MailProvider:
        return MailProvider(self.base_url, self.api_token, self.timeout_seconds)
