"""The review-notification pipeline's knobs, from the environment (prefix REVIEW_NOTIFICATIONS_).

Read when the code location's definitions are built, never at import time. The mail provider's
URL is the code location's `MAIL_API_URL` (the sandbox's `/mail/v1` locally).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from assets.review_notifications import policy


class ReviewNotificationSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REVIEW_NOTIFICATIONS_", extra="ignore", case_sensitive=False)

    mail_api_token: str = Field(default="sandbox-token", description="Bearer token of the mail provider.")
    row_attempts: int = Field(default=1, ge=1, le=10,
                              description="Attempts per recipient within one pass of a drain run; past them the "
                                          "job's work row falls due later (1: no drain thread sleeps on a retry).")
    job_attempts: int = Field(default=policy.JOB_MAX_ATTEMPTS, ge=1, le=20,
                              description="Attempts of a job's send stage before it is dead-lettered.")
    sensor_interval_seconds: int = Field(default=15, ge=5,
                                         description="How often the due-work sensor looks for due jobs.")
