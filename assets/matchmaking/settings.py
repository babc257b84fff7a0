"""The matchmaking pipeline's knobs, read from `MATCHMAKING_*` environment variables when definitions are built."""

from __future__ import annotations

from datetime import date
from typing import Annotated
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_TIMEZONES = (
    "America/Los_Angeles",
    "America/Chicago",
    "America/New_York",
    "America/Sao_Paulo",
    "Europe/London",
    "Europe/Berlin",
    "Asia/Kolkata",
    "Asia/Tokyo",
    "Australia/Sydney",
)


class MatchmakingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MATCHMAKING_", extra="ignore", case_sensitive=False)

    timezones: Annotated[tuple[str, ...], NoDecode] = Field(
        default=DEFAULT_TIMEZONES,
        description="IANA timezones, comma-separated: the timezone dimension of the partitions.",
    )
    start_date: date = Field(default=date(2026, 1, 1), description="First date partition.")
    offer_hour: int = Field(default=9, ge=0, le=23, description="Local hour at which a timezone's offers are made.")
    daily_offer_count: int = Field(
        default=3, ge=1, le=50,
        validation_alias=AliasChoices("MATCHMAKING_DAILY_OFFER_COUNT", "DAILY_OFFER_COUNT"),
        description="Offers per user per day (the ADR's DAILY_OFFER_COUNT).",
    )
    seed: str = Field(default="yoked-matchmaking", min_length=1,
                      description="Seed of the daily variety term; changing it changes every future offer.")
    scoring_path: str | None = Field(
        default=None,
        description="Artifact-store path of the scoring weights JSON; unset: the built-in weights.",
    )
    chunk_size: int = Field(default=2000, ge=1, le=50_000, description="Users claimed, scored and written together.")
    pair_budget: int = Field(default=262_144, ge=1_000,
                             description="Candidate pairs scored at once (bounds memory: ~40 bytes a pair).")
    batch_pause_seconds: float = Field(default=0.0, ge=0.0,
                                       description="Pause between chunks, to spare a busy primary.")
    lock_timeout_ms: int = Field(default=10_000, ge=1, description="A write waiting longer on a row lock is retried.")
    statement_timeout_ms: int = Field(default=120_000, ge=1, description="A statement running longer is retried.")

    @field_validator("timezones", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return value

    @field_validator("timezones")
    @classmethod
    def _known(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("MATCHMAKING_TIMEZONES needs at least one IANA timezone")
        for name in value:
            try:
                ZoneInfo(name)
            except (ZoneInfoNotFoundError, ValueError):
                raise ValueError(f"MATCHMAKING_TIMEZONES: {name!r} is not an IANA timezone") from None
        if len(set(value)) != len(value):
            raise ValueError("MATCHMAKING_TIMEZONES lists a timezone twice")
        return value
