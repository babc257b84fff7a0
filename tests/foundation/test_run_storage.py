"""Runs land in Dagster's PostgreSQL storage (dagster-postgres on a psycopg2 URL, whatever driver the
application's URL names)."""

from __future__ import annotations

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
