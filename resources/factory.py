"""One factory builds every resource from settings; environments differ only in values (STYLE §4)."""

from __future__ import annotations

import json
import os
from typing import Any

from dagster import EnvVar

from redrive.settings import Settings
from resources.aws import SqsResource, s3_resource
from resources.database import PostgresResource
from resources.http import ArtifactStoreResource
from resources.llm import LlmResource
from resources.notify import NotifierResource, SlackApiResource, SlackChannelResource, SlackWebhookResource
from resources.reliability import ReliabilityResource


def secret(name: str, default: str) -> Any:
    """A secret as `EnvVar`, so the Dagster UI shows the variable's name, never its value."""
    return EnvVar(name) if os.environ.get(name) else default


def secret_setting(name: str, value: Any) -> Any:
    """A setting that is a secret: `EnvVar(name)` when its value came from that variable (the UI and
    every resource config show the name; Dagster resolves it when the resource is initialized). A value
    given otherwise (a test's own database, say) is passed as it is: `EnvVar` would resolve to another.
    """
    return EnvVar(name) if value and os.environ.get(name) == value else value


def slack_from(settings: Settings, *, env_vars: bool = True) -> SlackChannelResource:
    """The Web API when a bot token is configured, else the incoming webhook (off when neither is).

    `env_vars=False` for use outside Dagster (a command, a test's runtime): nothing resolves an EnvVar there.
    """
    hidden = secret_setting if env_vars else (lambda _name, value: value)
    if settings.slack_bot_token:
        return SlackApiResource(token=hidden("SLACK_BOT_TOKEN", settings.slack_bot_token),
                                base_url=settings.slack_api_url, channel=settings.slack_channel)
    return SlackWebhookResource(url=hidden("SLACK_WEBHOOK_URL", settings.slack_webhook_url),
                                channel=settings.slack_channel)


def notifier_from(settings: Settings, slack: SlackChannelResource | None = None) -> NotifierResource:
    """The notifier; without `slack` (outside Dagster: commands, tests) with plain values, not EnvVars."""
    return NotifierResource(
        slack=slack or slack_from(settings, env_vars=False),
        email_to=settings.alert_email_to,
        email_from=settings.alert_email_from,
        mail_api_url=settings.mail_url,
        mail_api_token=secret("MAIL_API_TOKEN", settings.mail_api_token),  # issue 13 item 4: not always the sandbox's
    )


def build_resources(settings: Settings) -> dict[str, Any]:
    # Nested resources are the top-level objects themselves, so the UI shows who uses them.
    database = PostgresResource(database_url=secret_setting("DATABASE_URL", settings.database_url))
    slack = slack_from(settings)
    return {
        "database": database,
        "slack": slack,
        "reliability": ReliabilityResource(
            database=database,
            notifier=notifier_from(settings, slack),
            time_scale=settings.redrive_time_scale,
            durable_threshold_seconds=settings.redrive_durable_wait_threshold_seconds,
            burst_window_seconds=settings.alert_burst_window_seconds,
            ui_url=settings.dagster_ui_url,
            upstream_limits=json.dumps({name: limits.model_dump(exclude_defaults=True)
                                        for name, limits in settings.upstream_limits().items()}),
        ),
        "s3": s3_resource(settings.aws_endpoint_url, settings.aws_region),
        "sqs": SqsResource(endpoint_url=settings.aws_endpoint_url, region_name=settings.aws_region),
        "artifact_store": ArtifactStoreResource(base_url=settings.store_url or "http://127.0.0.1:9/store",
                                                timeout_seconds=settings.http_timeout_seconds),
        "llm": LlmResource(base_url=settings.llm_url or "https://api.openai.com/v1",
                           api_key=secret("LLM_API_KEY", settings.llm_api_key), model=settings.llm_model,
                           timeout_seconds=settings.http_timeout_seconds),
    }
