"""Alert channels: Slack (incoming webhook or Web API) and email (the mail provider's HTTP API).

Each channel is enabled by the presence of its configuration (000). They only carry
text; what to say and when is `redrive.alerts`. dagster-slack's SlackResource has
no base URL, so `SlackApiResource` adds one: the sandbox locally, Slack by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx
from dagster import ConfigurableResource
from dagster_slack import SlackResource
from slack_sdk import WebClient

from redrive.alerts import Channel


class SlackApiResource(SlackResource):
    """dagster-slack's resource with a configurable API base URL."""

    base_url: str | None = None

    def get_client(self) -> WebClient:
        if self.base_url:
            return WebClient(token=self.token, base_url=self.base_url, timeout=10)
        return WebClient(token=self.token, timeout=10)


@dataclass(frozen=True)
class SlackWebhookChannel:
    url: str = field(repr=False)  # the webhook URL is a bearer credential
    name: str = "slack"

    def send(self, subject: str, text: str, token: str) -> str | None:
        response = httpx.post(self.url, json={"text": text}, timeout=10)
        response.raise_for_status()
        return None


@dataclass(frozen=True)
class SlackApiChannel:
    resource: SlackApiResource
    channel: str
    name: str = "slack"

    def send(self, subject: str, text: str, token: str) -> str | None:
        reply = self.resource.get_client().chat_postMessage(channel=self.channel, text=text)
        return str(reply.get("ts"))


@dataclass(frozen=True)
class EmailChannel:
    """Email through the mail provider's API; the token makes a resend of the same batch a no-op."""

    mail_url: str
    recipients: tuple[str, ...]
    sender: str
    api_token: str = field(default="sandbox-token", repr=False)  # never in a repr, a log or the UI
    name: str = "email"

    def send(self, subject: str, text: str, token: str) -> str | None:
        ids = []
        for recipient in self.recipients:
            response = httpx.post(
                f"{self.mail_url.rstrip('/')}/messages",
                json={"to": recipient, "subject": subject, "text": text,
                      "idempotency_token": f"{token}:{recipient}"},
                headers={"Authorization": f"Bearer {self.api_token}"},
                timeout=10,
            )
            response.raise_for_status()
            ids.append(response.json().get("message_id", ""))
        return ",".join(ids)


class NotifierResource(ConfigurableResource):
    """Which alert channels are on: each one by the presence of its configuration."""

    slack_webhook_url: str | None = None
    slack_bot_token: str | None = None
    slack_api_base_url: str | None = None
    slack_channel: str = "#redrive-alerts"
    email_to: str | None = None
    email_from: str = "redrive@localhost"
    mail_api_url: str | None = None
    mail_api_token: str = "sandbox-token"

    def channels(self) -> dict[str, Channel]:
        out: dict[str, Channel] = {}
        if self.slack_bot_token:
            out["slack"] = SlackApiChannel(
                SlackApiResource(token=self.slack_bot_token, base_url=self.slack_api_base_url), self.slack_channel
            )
        elif self.slack_webhook_url:
            out["slack"] = SlackWebhookChannel(self.slack_webhook_url)
        recipients = tuple(a.strip() for a in (self.email_to or "").split(",") if a.strip())
        if recipients and self.mail_api_url:
            out["email"] = EmailChannel(self.mail_api_url, recipients, self.email_from, self.mail_api_token)
        return out
