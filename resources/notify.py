"""Alert channels: Slack (incoming webhook or Web API) and email (the mail provider's HTTP API).

Each channel is enabled by the presence of its configuration (000). They only carry
text; what to say and when is `redrive.alerts`. Slack is a top-level Dagster resource
("slack" in the Definitions, listed in the UI) that the notifier nests: dagster-slack's
SlackResource for the Web API (with a base URL: the sandbox locally, Slack by default),
or a webhook resource of the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dagster import ConfigurableResource
from dagster_slack import SlackResource
from pydantic import Field
from slack_sdk import WebClient
from slack_sdk.webhook import WebhookClient

from redrive.alerts import Channel
from redrive.upstreams import guarded
from resources.http import shared_client
from resources.secrets import resolved


class SlackChannelResource(ConfigurableResource):
    """What the core's alerts need of Slack: the channel alerts go to, or None when Slack is off."""

    channel: str = Field(default="#redrive-alerts", description="SLACK_CHANNEL (the Web API posts there)")

    def alert_channel(self) -> Channel | None:
        return None


class SlackApiResource(SlackResource, SlackChannelResource):
    """dagster-slack's resource (token → `WebClient`) with a configurable API base URL."""

    base_url: str | None = None

    def get_client(self) -> WebClient:
        if self.base_url:
            return WebClient(token=resolved(self.token), base_url=self.base_url, timeout=10)
        return WebClient(token=resolved(self.token), timeout=10)

    def alert_channel(self) -> Channel | None:
        return SlackApiChannel(self, self.channel) if self.token else None


class SlackWebhookResource(SlackChannelResource):
    """An incoming webhook, shaped like `SlackApiResource`: configuration plus `get_client()`.

    The URL's path is the credential: configure it as `EnvVar("SLACK_WEBHOOK_URL")`.
    """

    url: str | None = Field(default=None, description="SLACK_WEBHOOK_URL; unset: no Slack alerts")

    def get_client(self) -> WebhookClient:
        if not self.url:
            raise ValueError("no Slack webhook URL configured")
        return WebhookClient(resolved(self.url), timeout=10)

    def alert_channel(self) -> Channel | None:
        return SlackWebhookChannel(resolved(self.url)) if self.url else None


@dataclass(frozen=True)
class SlackWebhookChannel:
    url: str = field(repr=False)  # the webhook URL is a bearer credential
    name: str = "slack"

    def send(self, subject: str, text: str, token: str) -> str | None:
        response = guarded("slack", lambda: shared_client().post(self.url, json={"text": text}, timeout=10))
        response.raise_for_status()
        return None


@dataclass(frozen=True)
class SlackApiChannel:
    resource: SlackApiResource
    channel: str
    name: str = "slack"

    def send(self, subject: str, text: str, token: str) -> str | None:
        reply = guarded("slack", lambda: self.resource.get_client().chat_postMessage(channel=self.channel, text=text))
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
            response = guarded("mail", lambda recipient=recipient: shared_client().post(
                f"{self.mail_url.rstrip('/')}/messages",
                json={"to": recipient, "subject": subject, "text": text,
                      "idempotency_token": f"{token}:{recipient}"},
                headers={"Authorization": f"Bearer {self.api_token}"},
                timeout=10,
            ))
            response.raise_for_status()
            ids.append(response.json().get("message_id", ""))
        return ",".join(ids)


class NotifierResource(ConfigurableResource):
    """Which alert channels are on: each one by the presence of its configuration."""

    slack: SlackChannelResource | None = None  # the code location's top-level "slack" resource
    email_to: str | None = None
    email_from: str = "redrive@localhost"
    mail_api_url: str | None = None
    mail_api_token: str = "sandbox-token"

    def channels(self) -> dict[str, Channel]:
        out: dict[str, Channel] = {}
        slack = self.slack.alert_channel() if self.slack is not None else None
        if slack is not None:
            out["slack"] = slack
        recipients = tuple(a.strip() for a in (self.email_to or "").split(",") if a.strip())
        if recipients and self.mail_api_url:
            out["email"] = EmailChannel(self.mail_api_url, recipients, self.email_from, resolved(self.mail_api_token))
        return out
