"""Dagster's own PostgreSQL storage, created once by the migration step rather than checked at every tick.

The gRPC code server builds a new `DagsterInstance` from the daemon's instance reference for every tick of a
sensor that takes resources (all of ours), and dagster-postgres's storages, when `should_autocreate_tables` is
on (its default), each connect and list the database's tables to see whether they must create them: three
connections and three catalog reads a tick (an instance cost 54.8 ms with them, 11.7 ms without, here). `dagster.yaml.example` turns it
off, so the tables are created here, by `redrive db upgrade` and by `make serve` before any service starts.
Dagster's own upgrades stay `dagster instance migrate`, as Dagster documents.
"""

from __future__ import annotations

from redrive.db import dagster_storage_url


def prepare_dagster_storage(url: str) -> None:
    """Create Dagster's tables (runs, event logs, schedules and ticks) on `url` where they are missing;
    idempotent: on a database that has them it only reads the catalog."""
    from dagster_postgres import DagsterPostgresStorage

    storage = DagsterPostgresStorage(dagster_storage_url(url), should_autocreate_tables=True)
    for part in (storage.run_storage, storage.event_log_storage, storage.schedule_storage):
        part.dispose()
