"""The criticizer's knobs, from CRITICIZER_* environment variables, read when definitions are built."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from redrive.settings import Settings


class CriticizerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CRITICIZER_", extra="ignore", case_sensitive=False)

    artifact_url_prefixes: str = Field(
        default="",
        description="Comma-separated URL prefixes artifacts may be fetched from. Empty: the artifact store "
        "(ARTIFACT_STORE_URL, the sandbox's /store locally); with no store configured, any http(s) URL.",
    )
    max_artifact_bytes: int = Field(default=1_000_000, gt=0, description="Larger artifacts are refused (DATA_INVALID).")
    results_slack_webhook_url: str | None = Field(
        default=None,
        description="Slack incoming webhook for critique results. Unset: the code location's Slack alert channel.",
    )
    sensor_batch: int = Field(default=50, gt=0, description="Requests turned into runs per sensor tick.")
    sensor_interval_seconds: int = Field(default=30, gt=0)

    def allowed_prefixes(self, core: Settings) -> tuple[str, ...]:
        """Where artifacts may come from: the configured prefixes, else the artifact store, else anywhere."""
        configured = tuple(p.strip() for p in self.artifact_url_prefixes.split(",") if p.strip())
        if configured:
            return configured
        return (core.store_url.rstrip("/") + "/",) if core.store_url else ()
