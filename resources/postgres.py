"""Which PostgreSQL a process or a command uses: DATABASE_URL, or the embedded one. No Dagster here, so the
operator's commands (`redrive review status`, …) can ask without loading the orchestrator."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from redrive.db import engine_for, normalize_url, upgrade_head
from redrive.settings import Settings


def resolve_database_url(settings: Settings) -> str:
    """DATABASE_URL when set; otherwise the embedded PostgreSQL in the project's data folder."""
    if settings.database_url:
        return normalize_url(settings.database_url)
    from devstack.postgres import EmbeddedPostgres, create_database, with_database

    admin = EmbeddedPostgres(settings.redrive_data_dir / "pg").start()
    create_database(admin, "redrive")
    return with_database(admin, "redrive")


@contextmanager
def database_session(settings: Settings) -> Iterator[str]:
    """The database URL for one command: DATABASE_URL; the database of a running `make serve` (.data/serve.env);
    else an embedded server started for it and stopped after."""
    from devstack import serve_env

    served = serve_env.running(settings.redrive_data_dir / serve_env.FILE_NAME)
    url = settings.database_url or (served or {}).get("DATABASE_URL")
    if url:
        yield normalize_url(url)
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
        engine_for.cache_clear()  # type: ignore[attr-defined]
        pg.stop()
