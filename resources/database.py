"""PostgreSQL, the system of record: which server (DATABASE_URL, or the embedded one), and the Dagster resource."""

from __future__ import annotations

import sqlalchemy as sa
from dagster import ConfigurableResource, InitResourceContext
from pydantic import Field

from redrive import liveness
from redrive.clock import SystemClock
from redrive.db import engine_for
from redrive.settings import Settings
from resources.postgres import database_session, resolve_database_url  # commands use these without Dagster
from resources.secrets import resolved

__all__ = ["PostgresResource", "database_session", "resolve_database_url"]


class PostgresResource(ConfigurableResource):
    """SQLAlchemy engine on DATABASE_URL; unset, on the embedded PostgreSQL."""

    database_url: str | None = Field(default=None, description="Unset: embedded PostgreSQL in the data folder.")

    def url(self) -> str:
        if self.database_url:
            return resolved(self.database_url)
        return resolve_database_url(Settings(database_url=None))

    def engine(self) -> sa.Engine:
        return engine_for(self.url())

    # A run that uses PostgreSQL beats while it lasts (the run watchdog, issue 25); one thread per run however
    # many resources start it (redrive.liveness).
    def setup_for_execution(self, context: InitResourceContext) -> None:
        if context.dagster_run is not None:
            liveness.start_for_run(self.engine(), context.dagster_run.run_id, now=SystemClock().now)

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        if context.dagster_run is not None:
            liveness.stop_for_run(context.dagster_run.run_id)
