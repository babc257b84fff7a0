"""Alembic owns the schema: head from empty, base back, and models never drift from migrations."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from devstack.postgres import create_database, drop_database, with_database
from redrive.db import VERSION_TABLE, downgrade_base, engine_for, upgrade_head
from orchestration.registry import all_metadata


def _tables(url: str) -> set[str]:
    with engine_for(url).connect() as conn:
        return set(sa.inspect(conn).get_table_names())


def test_upgrade_from_empty_then_downgrade_to_base(admin_url: str) -> None:
    """`upgrade head` on an empty database creates every table; `downgrade base` removes them all."""
    name = "redrive_migrate_roundtrip"
    drop_database(admin_url, name)
    create_database(admin_url, name)
    url = with_database(admin_url, name)
    try:
        assert _tables(url) == set()
        upgrade_head(url)
        expected = set(all_metadata().tables)
        assert expected <= _tables(url)
        downgrade_base(url)
        assert _tables(url) == {VERSION_TABLE}
        upgrade_head(url)  # and up again: downgrades leave nothing behind that blocks it
        assert expected <= _tables(url)
    finally:
        engine_for(url).dispose()
        drop_database(admin_url, name)


def test_models_match_migrations(engine: sa.Engine) -> None:
    """The schema from all migrations equals the schema the models declare (alembic check)."""
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "version_table": VERSION_TABLE})
        diff = compare_metadata(ctx, all_metadata())
    assert diff == []
