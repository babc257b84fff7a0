"""Dagster's own PostgreSQL storage: created once by the migration step, and one pooled engine a process.

Created once: the gRPC code server builds a new `DagsterInstance` from the daemon's instance reference for every
tick of a sensor that takes resources (all of ours), and dagster-postgres's storages, when
`should_autocreate_tables` is on (its default), each connect and list the database's tables to see whether they
must create them: three connections and three catalog reads a tick (an instance cost 54.8 ms with them, 11.7 ms
without, here). `dagster.yaml.example` turns it off, so the tables are created here, by `redrive db upgrade` and by
`make serve` before any service starts. Dagster's own upgrades stay `dagster instance migrate`, as Dagster documents.

Pooled: dagster-postgres gives each of its three storages a `NullPool` engine, so every event a run writes, every
read of the daemon's loops and every sensor tick's cursor opens a new connection, and PostgreSQL forks a backend for
it. An evidence file-job run writes ~40 events; a deployment draining 2,000 rows in 10 such runs opened 2,806
connections to Dagster's database in 45 s, and the backends' start and exit were a third of the machine's CPU
(issue 26). `PooledPostgresStorage` is dagster-postgres's storage with its three parts on one engine a process and
database, pooled and pre-pinged as ours are (`redrive.db.engine_for`), shared by every instance the process builds:
the code server's instance a tick costs no connection. Dagster's webserver swaps in its own pool
(`optimize_for_webserver`), as before.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from dagster_postgres import DagsterPostgresStorage
from dagster_postgres.utils import create_pg_engine, get_token_provider_from_config, pg_config, pg_url_from_config

from redrive.db import dagster_storage_url

if TYPE_CHECKING:
    import sqlalchemy as sa

POOL_KEPT = 4  # connections a process keeps open at most: the daemon's loops and dequeue threads overlap; a run uses 1
POOL_RECYCLE_SECONDS = 3600  # as Dagster's webserver (--db-pool-recycle): a connection older than this is reopened

_engines: dict[tuple[str, int], sa.Engine] = {}
_lock = threading.Lock()


def shared_engine(url: str, pool_size: int = POOL_KEPT) -> sa.Engine:
    """This process's engine on Dagster's database `url`: autocommit as dagster-postgres's own, at most `pool_size`
    kept open, any number more opened and closed as needed (NullPool's unlimited), each checked before use (a
    restarted server costs a reconnect, not a failed event write)."""
    key = (url, pool_size)
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = create_pg_engine(url, isolation_level="AUTOCOMMIT", pool_size=pool_size,
                                                      max_overflow=-1, pool_pre_ping=True,
                                                      pool_recycle=POOL_RECYCLE_SECONDS)
    return engine


def _forget_in_child() -> None:
    """A forked process opens its own connections: the parent's stay the parent's (SQLAlchemy's `dispose(close=False)`
    for a fork), so a child never writes on, or closes, a socket its parent uses."""
    for engine in _engines.values():
        engine.dispose(close=False)
    _engines.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class PooledPostgresStorage(DagsterPostgresStorage):
    """dagster-postgres's run, event log and schedule storage on `shared_engine`; its config is dagster-postgres's
    with `pool_size`. With an `auth_provider` (tokens injected at each connect) the parts keep their own engines."""

    def __init__(self, postgres_url: str, should_autocreate_tables: bool = True, inst_data: Any = None,
                 token_provider: Any = None, pool_size: int = POOL_KEPT) -> None:
        super().__init__(postgres_url, should_autocreate_tables, inst_data=inst_data, token_provider=token_provider)
        if token_provider is None:
            engine = shared_engine(postgres_url, pool_size)
            # dagster-postgres reads `_engine` at every connect; its webserver optimization replaces it the same way
            for part in (self._run_storage, self._event_log_storage, self._schedule_storage):
                part._engine = engine

    @classmethod
    def config_type(cls) -> Any:
        from dagster import Field, IntSource

        return {**pg_config(), "pool_size": Field(IntSource, is_required=False, default_value=POOL_KEPT)}

    @classmethod
    def from_config_value(cls, inst_data: Any, config_value: Any) -> PooledPostgresStorage:
        return cls(pg_url_from_config(config_value), config_value.get("should_autocreate_tables", True),
                   inst_data=inst_data, token_provider=get_token_provider_from_config(config_value),
                   pool_size=config_value.get("pool_size", POOL_KEPT))


def prepare_dagster_storage(url: str) -> None:
    """Create Dagster's tables (runs, event logs, schedules and ticks) on `url` where they are missing;
    idempotent: on a database that has them it only reads the catalog."""
    storage = DagsterPostgresStorage(dagster_storage_url(url), should_autocreate_tables=True)
    for part in (storage.run_storage, storage.event_log_storage, storage.schedule_storage):
        part.dispose()
