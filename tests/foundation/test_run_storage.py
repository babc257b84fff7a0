"""Runs land in Dagster's PostgreSQL storage (dagster-postgres on a psycopg2 URL, whatever driver the
application's URL names)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from dagster import instance_for_test

from devstack.postgres import create_database, drop_database, with_database
from orchestration.definitions import build_definitions
from redrive.db import dagster_storage_url, engine_for
from redrive.settings import Settings


def test_healthcheck_run_is_stored_in_postgres(admin_url: str, settings: Settings, sandbox) -> None:
    """A real job run on a Postgres-backed instance leaves its run and events in that database. The URL is derived
    from one naming psycopg 3 (an operator's DATABASE_URL may): dagster-postgres's NOTIFY fails on psycopg 3, and a
    deployment's runs then never leave NOT_STARTED."""
    name = "redrive_dagster_storage_test"
    drop_database(admin_url, name)
    create_database(admin_url, name)
    psycopg3 = "postgresql+psycopg://" + with_database(admin_url, name).partition("://")[2]
    dagster_url = dagster_storage_url(psycopg3)
    assert dagster_url.startswith("postgresql+psycopg2://")
    try:
        with instance_for_test(overrides={"storage": {"postgres": {"postgres_url": dagster_url}}}) as instance:
            job = build_definitions(settings).resolve_job_def("stack_healthcheck_job")
            result = job.execute_in_process(instance=instance)
            assert result.success
            run_id = result.run_id
        with engine_for(dagster_url).connect() as conn:
            status = conn.execute(sa.text("SELECT status FROM runs WHERE run_id = :r"), {"r": run_id}).scalar()
            events = conn.execute(sa.text("SELECT count(*) FROM event_logs WHERE run_id = :r"), {"r": run_id}).scalar()
        assert status == "SUCCESS"
        assert events > 5
        with engine_for(settings.database_url).connect() as conn:
            results = conn.execute(sa.text("SELECT results FROM healthchecks WHERE run_key = :r"), {"r": run_id}).scalar()
        assert results == {"s3": "ok", "sqs": "ok", "llm": "ok", "postgres": "ok"}
    finally:
        engine_for(dagster_url).dispose()
        drop_database(admin_url, name)


def test_the_migration_step_creates_the_tables_the_production_instance_no_longer_creates(
        admin_url: str, settings: Settings, sandbox, tmp_path, monkeypatch) -> None:
    """dagster.yaml.example does not create Dagster's tables (the code server builds an instance per sensor tick,
    and checking them cost three connections a tick): on a fresh database its instance cannot read a run until
    the migration step (`prepare_dagster_storage`, run by `redrive db upgrade` and `make serve`) created them,
    and a second migration step changes nothing."""
    import shutil

    from dagster import DagsterInstance
    from dagster._core.instance.ref import InstanceRef

    from orchestration.storage import prepare_dagster_storage
    from redrive.settings import PROJECT_ROOT

    name = "redrive_dagster_prepare_test"
    drop_database(admin_url, name)
    create_database(admin_url, name)
    url = dagster_storage_url(with_database(admin_url, name))
    monkeypatch.setenv("DAGSTER_PG_URL", url)
    shutil.copyfile(PROJECT_ROOT / "dagster.yaml.example", tmp_path / "dagster.yaml")
    try:
        with DagsterInstance.from_ref(InstanceRef.from_dir(str(tmp_path))) as instance:
            with pytest.raises(sa.exc.ProgrammingError):
                instance.get_runs_count()
        prepare_dagster_storage(url)
        prepare_dagster_storage(url)
        with DagsterInstance.from_ref(InstanceRef.from_dir(str(tmp_path))) as instance:
            assert instance.get_runs_count() == 0
            job = build_definitions(settings).resolve_job_def("stack_healthcheck_job")
            assert job.execute_in_process(instance=instance).success
            assert instance.get_runs_count() == 1
    finally:
        engine_for(url).dispose()
        drop_database(admin_url, name)
