"""The conversion tables and the core breaker tables: migrations equal models, and the database enforces the invariants."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from redrive.db import VERSION_TABLE
from orchestration.registry import all_metadata

MINE = {"conversion_jobs", "conversion_job_events", "conversion_api_tokens", "circuit_breakers",
        "circuit_breaker_calls"}


def _table_of(diff: object) -> str | None:
    """The table a diff entry is about (entries are tuples, or lists of tuples for column changes)."""
    entry = diff[0] if isinstance(diff, list) else diff
    for part in entry:
        name = getattr(part, "name", None) if not isinstance(part, str) else None
        table = getattr(part, "table", None)
        if table is not None and getattr(table, "name", None):
            return table.name
        if isinstance(part, sa.Table):
            return part.name
        if name and name in MINE:
            return name
    for part in entry:
        if isinstance(part, str) and part in MINE:
            return part
    return None


def test_migrations_match_models_for_our_tables(engine: sa.Engine) -> None:
    """0003 and 0601 create exactly what redrive.breaker and the conversion repository declare."""
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "version_table": VERSION_TABLE})
        diff = compare_metadata(ctx, all_metadata())
    ours = [d for d in diff if _table_of(d) in MINE]
    assert ours == []
    assert MINE <= set(sa.inspect(engine).get_table_names())


def test_database_refuses_a_non_canonical_error_code(engine: sa.Engine) -> None:
    """A code outside 003's ten can never be stored, whoever writes the row."""
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO conversion_jobs (owner, filename, source_location, source_bytes, source_sha256, error_code) "
            "VALUES ('a', 'f.pdf', 'x.pdf', 1, 'h', 'GW_UNAVAILABLE')"))


def test_database_refuses_processing_without_a_lease(engine: sa.Engine) -> None:
    """`processing` without leased_by/lease_expires_at would never be reclaimed: the CHECK forbids it."""
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO conversion_jobs (owner, filename, source_location, source_bytes, source_sha256, status) "
            "VALUES ('a', 'f.pdf', 'x.pdf', 1, 'h', 'processing')"))
