"""A code location per test: its own database, the session's sandbox, waits shortened by configuration."""

from __future__ import annotations

import dagster as dg
import pytest
import sqlalchemy as sa

from assets.rehearsal import repository
from orchestration.definitions import build_definitions
from redrive.settings import Settings

TIME_SCALE = 0.001  # a 3 s Retry-After becomes 3 ms; configuration, not code


@pytest.fixture
def scaled_settings(db_url: str, stack) -> Settings:
    return Settings(database_url=db_url, redrive_time_scale=TIME_SCALE, alert_burst_window_seconds=300)


@pytest.fixture
def defs(scaled_settings: Settings) -> dg.Definitions:
    return build_definitions(scaled_settings)


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture
def rehearsal_request(engine: sa.Engine, sandbox):
    """One request whose artifact is in the sandbox store; returns its id."""
    sandbox.put_store("docs/contract.txt", b"The parties agree to everything.", "text/plain")
    with engine.begin() as conn:
        repository.create(conn, "req-1", "docs/contract.txt", "Is this contract fair?")
    return "req-1"
