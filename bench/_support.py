"""What every benchmark needs: a database of its own, migrated, dropped afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from alembic import command

from devstack.postgres import create_database, drop_database, with_database
from redrive.db import alembic_config, engine_for
from resources.database import resolve_database_url
from redrive.settings import Settings


def machine_cpu() -> float:
    """CPU seconds every process on the machine has used so far (PostgreSQL's backends included): what a
    contender costs when the figure is taken around it alone."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


@contextlib.contextmanager
def scratch_database(name: str, *, heads: str | None = "heads", keep: bool = False) -> Iterator[str]:
    """A fresh database on DATABASE_URL's server (or the embedded one), so no other work touches its rows;
    migrated to `heads`, or left empty with None (a Dagster instance's storage); dropped after, unless `keep`
    (to look into what a long benchmark left; the next run of it drops it first)."""
    admin = with_database(resolve_database_url(Settings()), "postgres")
    drop_database(admin, name)
    create_database(admin, name)
    url = with_database(admin, name)
    try:
        if heads is not None:
            command.upgrade(alembic_config(url), heads)
        yield url
    finally:
        engine_for(url).dispose()
        if keep:
            print(f"  kept database {name} (drop it when done)", flush=True)
        else:
            drop_database(admin, name)

