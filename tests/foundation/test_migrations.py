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


def test_0030_moves_evidence_file_jobs_records_under_evidence(admin_url: str) -> None:
    """Issue 27: letters, alerts, timers and counters of `evidence_file_jobs` become `evidence`'s; an entity active
    under both keeps the `evidence` letter and the other is resolved with a note; the downgrade puts file jobs back."""
    from alembic import command

    from redrive.db import alembic_config

    name = "redrive_migrate_0030"
    drop_database(admin_url, name)
    create_database(admin_url, name)
    url = with_database(admin_url, name)
    try:
        command.upgrade(alembic_config(url), "0006")
        letter = ("INSERT INTO dead_letters (pipeline, stage, entity_ref, error_class, error_message, retryable, "
                  "attempts, first_failure_at, last_failure_at) VALUES (:p, 'ingest', :e, 'S3_NOT_FOUND', 'm', false, "
                  "1, now(), now())")
        observe = ("INSERT INTO stage_observations (pipeline, stage, outcome, error_class, count, buckets, sum_seconds)"
                   " VALUES (:p, 'ingest', 'ok', '', :n, :b, :n)")
        with engine_for(url).begin() as conn:
            for pipeline, entity in (("evidence_file_jobs", "job-1"), ("evidence_file_jobs", "job-2"),
                                     ("evidence", "job-2"), ("evidence", "job-3/row-1")):
                conn.execute(sa.text(letter), {"p": pipeline, "e": entity})
            conn.execute(sa.text("INSERT INTO alerts (dedupe_key, group_key, pipeline, kind, summary) "
                                 "VALUES ('k', 'g', 'evidence_file_jobs', 'dead_letter', 's')"))
            conn.execute(sa.text(observe), {"p": "evidence_file_jobs", "n": 2, "b": [1, 1]})
            conn.execute(sa.text(observe), {"p": "evidence", "n": 3, "b": [0, 3]})
        command.upgrade(alembic_config(url), "0030")
        with engine_for(url).connect() as conn:
            letters = conn.execute(sa.text(
                "SELECT pipeline, entity_ref, status, notes FROM dead_letters ORDER BY id")).all()
            assert [(p, e, s) for p, e, s, _ in letters] == [
                ("evidence", "job-1", "open"), ("evidence", "job-2", "resolved"), ("evidence", "job-2", "open"),
                ("evidence", "job-3/row-1", "open")]
            assert letters[1].notes[-1]["kind"] == "merged"
            assert conn.execute(sa.text("SELECT pipeline FROM alerts")).scalar_one() == "evidence"
            assert conn.execute(sa.text("SELECT pipeline, count, buckets, sum_seconds FROM stage_observations")).one() \
                == ("evidence", 5, [1, 4], 5.0)
        command.downgrade(alembic_config(url), "0006")
        with engine_for(url).connect() as conn:
            assert conn.execute(sa.text("SELECT pipeline, entity_ref FROM dead_letters ORDER BY id")).all() == [
                ("evidence_file_jobs", "job-1"), ("evidence_file_jobs", "job-2"), ("evidence_file_jobs", "job-2"),
                ("evidence", "job-3/row-1")]
    finally:
        engine_for(url).dispose()
        drop_database(admin_url, name)
