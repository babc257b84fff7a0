"""Connections to the system of record, and Alembic as the only way its schema changes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from redrive.settings import PROJECT_ROOT, Settings

VERSION_TABLE = "redrive_alembic_version"  # Dagster keeps its own alembic_version


def resolve_database_url(settings: Settings) -> str:
    """DATABASE_URL when set; otherwise the embedded PostgreSQL in the project's data folder."""
    if settings.database_url:
        return normalize_url(settings.database_url)
    from devstack.postgres import EmbeddedPostgres, create_database, with_database

    admin = EmbeddedPostgres(settings.redrive_data_dir / "pg").start()
    create_database(admin, "redrive")
    return with_database(admin, "redrive")


def normalize_url(url: str) -> str:
    """Pin psycopg2: under SQLAlchemy 2.1 a bare postgresql:// would pick psycopg 3."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg2://" + url[len("postgresql://") :]
    return url


def engine_for(url: str) -> sa.Engine:
    """One pooled engine per database per process; pre-ping so a restarted server costs one retry, not a failure."""
    return _engine(normalize_url(url))


@lru_cache(maxsize=64)
def _engine(url: str) -> sa.Engine:
    return sa.create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


engine_for.cache_clear = _engine.cache_clear  # type: ignore[attr-defined]


def alembic_config(url: str) -> Config:
    cfg = Config(str(PROJECT_ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(PROJECT_ROOT / "migrations"))
    cfg.attributes["database_url"] = normalize_url(url)
    return cfg


def upgrade_head(url: str) -> None:
    """Every branch to its head: the core and each pipeline's schema are branches of their own."""
    command.upgrade(alembic_config(url), "heads")


def downgrade_base(url: str) -> None:
    command.downgrade(alembic_config(url), "base")


@contextmanager
def database_session(settings: Settings) -> Iterator[str]:
    """The database URL for one command; an embedded server started for it is stopped after."""
    if settings.database_url:
        yield normalize_url(settings.database_url)
        return
    from devstack.postgres import EmbeddedPostgres, create_database, with_database

    pg = EmbeddedPostgres(settings.redrive_data_dir / "pg")
    admin = pg.start()
    try:
        create_database(admin, "redrive")
        url = with_database(admin, "redrive")
        upgrade_head(url)
        yield url
    finally:
        engine_for.cache_clear()
        pg.stop()
