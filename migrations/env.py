"""Alembic environment: one MetaData for all of redrive's tables, a version table of our own."""

from __future__ import annotations

from alembic import context

from orchestration.registry import all_metadata
from redrive.db import VERSION_TABLE, engine_for
from redrive.settings import Settings
from resources.database import resolve_database_url

config = context.config
url = config.attributes.get("database_url") or resolve_database_url(Settings())
target_metadata = all_metadata()


def run_migrations_offline() -> None:
    context.configure(url=url, target_metadata=target_metadata, version_table=VERSION_TABLE,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    with engine_for(url).connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata,
                          version_table=VERSION_TABLE, compare_type=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
