"""Connections to the system of record, and Alembic as the only way its schema changes.

The core takes a database URL; where it comes from (DATABASE_URL, or the embedded server the
local stack starts) is decided at the edge, in `resources.database`.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, ParamSpec

import sqlalchemy as sa

from redrive.settings import PROJECT_ROOT

if TYPE_CHECKING:  # Alembic loads only where the schema changes, not in every process that queries
    from alembic.config import Config

VERSION_TABLE = "redrive_alembic_version"  # Dagster keeps its own alembic_version


def normalize_url(url: str) -> str:
    """Pin psycopg2: under SQLAlchemy 2.1 a bare postgresql:// would pick psycopg 3."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg2://" + url[len("postgresql://") :]
    return url


def dagster_storage_url(url: str) -> str:
    """Dagster's storage URL on the server and database `url` names, with psycopg2 whatever driver `url` names.
    dagster-postgres sends `NOTIFY run_events, %s` with a bound parameter; psycopg 3 binds it server-side and
    PostgreSQL refuses the statement, so no run would ever leave NOT_STARTED (our own engines take either)."""
    scheme, sep, rest = normalize_url(url).partition("://")
    return f"postgresql+psycopg2://{rest}" if sep and scheme.startswith("postgresql") else url


def compiled_once(stmt: sa.Insert, *keys: str) -> sa.TextClause:
    """An INSERT … ON CONFLICT for the values `keys`, compiled once into a text statement whose binds keep their
    types (JSONB, UUID). SQLAlchemy 2.0 caches no `postgresql.insert` (`inherit_cache = False`: its ON CONFLICT
    clause has no cache key), so one executed for every entity was compiled again every time: 7 % of a
    criticizer run worker's time. A text statement is cached by its text."""
    from sqlalchemy.dialects import postgresql

    compiled = stmt.compile(dialect=postgresql.dialect(paramstyle="named"), column_keys=list(keys))
    text = compiled.string.replace("::", r"\:\:")  # a cast after a bind (`:output::JSONB`), not a bind's name
    return sa.text(text).bindparams(*(sa.bindparam(name, type_=bind.type) for name, bind in compiled.binds.items()))


def engine_for(url: str) -> sa.Engine:
    """One pooled engine per database per process; pre-ping so a restarted server costs one retry, not a failure."""
    return _engine(normalize_url(url))


POOL_CONNECTIONS = 15  # a process's cap (a drain run: its I/O threads, a plain handler's threads, the heartbeat)


P = ParamSpec("P")


def per_process(maxsize: int) -> Callable[[Callable[P, sa.Engine]], Callable[P, sa.Engine]]:
    """`functools.lru_cache` for an engine factory, forgotten in a forked child (Dagster's forkserver forks run
    workers from a process that has loaded the code): the child opens its own connections and the parent's stay the
    parent's (SQLAlchemy's `dispose(close=False)` for a fork), so a child never writes on, or closes when it drops
    the engine, a socket its parent uses. `orchestration.storage` does the same for Dagster's own engine."""

    def wrap(make: Callable[P, sa.Engine]) -> Callable[P, sa.Engine]:
        cached = functools.lru_cache(maxsize=maxsize)(make)
        made: weakref.WeakSet[sa.Engine] = weakref.WeakSet()

        @functools.wraps(make)
        def engine(*args: P.args, **kwargs: P.kwargs) -> sa.Engine:
            made.add(found := cached(*args, **kwargs))
            return found

        def forget_in_child() -> None:
            for inherited in list(made):
                inherited.dispose(close=False)
            made.clear()
            cached.cache_clear()

        os.register_at_fork(after_in_child=forget_in_child)
        engine.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
        return engine

    return wrap


@per_process(maxsize=64)
def _engine(url: str) -> sa.Engine:
    # Every connection a process opened stays open, up to the cap. A pool that keeps fewer than a drain uses at once
    # closes one at nearly every return and opens one at the next checkout, a new server backend each time (its
    # start, catalog caches and PL/pgSQL compiled again): with 5 kept, 625 sessions for 1,000 review jobs, half of
    # PostgreSQL's CPU for them; with 8 kept, an evidence file-job run at 8 rows in flight (a row lock's connection
    # and its commits' beside it) opened 42, a tenth of the deployment's CPU (issue 26). The server is sized by the
    # peak (docs/operating.md, "PostgreSQL's connections"), which keeping does not raise.
    return sa.create_engine(url, pool_pre_ping=True, pool_size=POOL_CONNECTIONS, max_overflow=0)


engine_for.cache_clear = _engine.cache_clear  # type: ignore[attr-defined]


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    cfg = Config(str(PROJECT_ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(PROJECT_ROOT / "migrations"))
    cfg.attributes["database_url"] = normalize_url(url)
    return cfg


def upgrade_head(url: str) -> None:
    """Every branch to its head: the core and each pipeline's schema are branches of their own."""
    from alembic import command

    command.upgrade(alembic_config(url), "heads")


def downgrade_base(url: str) -> None:
    from alembic import command

    command.downgrade(alembic_config(url), "base")


# (name, table, columns, partial predicate or None), for the migrations below
IndexSpec = tuple[str, str, list[str], str | None]


def create_indexes_concurrently(indexes: list[IndexSpec]) -> None:
    """In a migration: build each index CONCURRENTLY (outside the migration's transaction), so a table that
    has grown for months keeps taking writes while its index is built; an index already there is kept."""
    from alembic import op

    with op.get_context().autocommit_block():
        for name, table, columns, where in indexes:
            op.create_index(name, table, columns, unique=False, postgresql_concurrently=True, if_not_exists=True,
                            postgresql_where=sa.text(where) if where else None)


def drop_indexes_concurrently(indexes: list[IndexSpec]) -> None:
    from alembic import op

    with op.get_context().autocommit_block():
        for name, table, _, _ in reversed(indexes):
            op.drop_index(name, table_name=table, postgresql_concurrently=True, if_exists=True)
