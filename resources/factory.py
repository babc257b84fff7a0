"""One factory builds every resource from settings; environments differ only in values (STYLE §4)."""

from __future__ import annotations

import os
from typing import Any

from dagster import EnvVar

from redrive.settings import Settings
from resources.aws import SqsResource, s3_resource
from resources.database import PostgresResource
from resources.http import ArtifactStoreResource
from resources.llm import LlmResource
from resources.notify import NotifierResource
from resources.reliability import ReliabilityResource


def secret(name: str, default: str) -> Any:
    """A secret as `EnvVar`, so the Dagster UI shows the variable's name, never its value."""
    return EnvVar(name) if os.environ.get(name) else default


def notifier_from(settings: Settings) -> NotifierResource:
    return NotifierResource(
        slack_webhook_url=settings.slack_webhook_url,
        slack_bot_token=secret("SLACK_BOT_TOKEN", "") or None,
        slack_api_base_url=settings.slack_api_url if settings.slack_bot_token else None,
        slack_channel=settings.slack_channel,
        email_to=settings.alert_email_to,
        email_from=settings.alert_email_from,
        mail_api_url=settings.mail_url,
        mail_api_token=secret("MAIL_API_TOKEN", settings.mail_api_token),  # issue 13 item 4: not always the sandbox's
    )


def build_resources(settings: Settings) -> dict[str, Any]:
    database = PostgresResource(database_url=settings.database_url)
    return {
        "database": database,
        "reliability": ReliabilityResource(
            database=database,
            notifier=notifier_from(settings),
            time_scale=settings.redrive_time_scale,
            durable_threshold_seconds=settings.redrive_durable_wait_threshold_seconds,
            burst_window_seconds=settings.alert_burst_window_seconds,
            ui_url=settings.dagster_ui_url,
        ),
        "s3": s3_resource(settings.aws_endpoint_url, settings.aws_region),
        "sqs": SqsResource(endpoint_url=settings.aws_endpoint_url, region_name=settings.aws_region),
        "artifact_store": ArtifactStoreResource(base_url=settings.store_url or "http://127.0.0.1:9/store",
                                                timeout_seconds=settings.http_timeout_seconds),
        "llm": LlmResource(base_url=settings.llm_url or "https://api.openai.com/v1",
                           api_key=secret("LLM_API_KEY", settings.llm_api_key), model=settings.llm_model,
                           timeout_seconds=settings.http_timeout_seconds),
    }
