"""The criticizer's HTTP: fetching review artifacts and posting critiques to requesters' webhooks.

Errors reach the core's classifier as typed failures: a non-2xx artifact answer raises
`httpx.HTTPStatusError` (its URL is the artifact's, which is not a secret); a non-2xx
webhook answer is classified here with `classify_http` and raised *without* the httpx
error as its cause, because that error's message holds the webhook URL, whose path is
often a credential (Slack-style webhooks) and must not reach a stack in a dead letter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
from dagster import ConfigurableResource
from pydantic import Field

from redrive.clock import SystemClock
from redrive.failures import Code, Failure, classify_http, raise_failure
from redrive.upstreams import guarded
from resources.http import shared_client
from resources.notify import SlackWebhookChannel


class CriticizerHttpResource(ConfigurableResource):
    """Artifact store and webhook client of the criticizer; the results Slack webhook, if its own."""

    timeout_seconds: float = 10.0
    artifact_url_prefixes: list[str] = Field(default_factory=list, description="Empty: any http(s) URL.")
    max_artifact_bytes: int = 1_000_000
    results_slack_webhook_url: str | None = None

    def fetch_artifact(self, url: str) -> bytes:
        """GET the artifact, refusing URLs outside the allowed stores (002 §8.1 explicit deny policy)."""
        self._allowed(url)
        return guarded("artifact_store", lambda: self._fetch(url))

    def _allowed(self, url: str) -> None:
        if self.artifact_url_prefixes and not any(url.startswith(p) for p in self.artifact_url_prefixes):
            raise_failure(Failure.of(Code.POLICY_REJECTED, message="artifact URL is outside the allowed stores",
                                     retryable=False))

    def _fetch(self, url: str) -> bytes:
        with shared_client().stream("GET", url, timeout=self.timeout_seconds) as response:
            if response.is_error:
                response.read()  # the classifier reads provider error codes and Retry-After from it
                response.raise_for_status()
            body = _Capped(self.max_artifact_bytes)
            for chunk in response.iter_bytes():
                body.add(chunk)
        return body.bytes()

    def post_webhook(self, url: str, payload: Mapping[str, Any], headers: Mapping[str, str]) -> int:
        """POST the critique; returns the status, raises a classified failure on a non-2xx answer."""
        response = guarded("webhooks", lambda: shared_client().post(url, json=dict(payload), headers=dict(headers),
                                                                    timeout=self.timeout_seconds))
        return _delivered(response)

    def results_channel(self) -> SlackWebhookChannel | None:
        """A Slack webhook of the criticizer's own for results, when configured (else the core's Slack channel)."""
        return SlackWebhookChannel(self.results_slack_webhook_url) if self.results_slack_webhook_url else None


class _Capped:
    """An artifact's bytes as they stream in; more than the cap is a permanent data error."""

    def __init__(self, cap: int) -> None:
        self.cap, self.size, self.chunks = cap, 0, []

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.cap:
            raise_failure(Failure.of(Code.DATA_ERROR, retryable=False,
                                     message=f"artifact is larger than {self.cap} bytes"))
        self.chunks.append(chunk)

    def bytes(self) -> bytes:
        return b"".join(self.chunks)


def _delivered(response: httpx.Response) -> int:
    """The webhook's status; a non-2xx answer raises classified, without the httpx error (its URL is a secret)."""
    if response.is_error:
        raise_failure(classify_http(response.status_code, response.content, response.headers, SystemClock().now()))
    return response.status_code
