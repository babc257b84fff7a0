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
    from dagster import DagsterInstance
    from dagster._core.instance.ref import InstanceRef

    from orchestration.storage import prepare_dagster_storage

    name = "redrive_dagster_prepare_test"
    url = production_instance_folder(admin_url, name, tmp_path, monkeypatch)
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


def test_a_runs_events_are_written_on_the_process_pooled_connections_and_survive_a_dropped_one(
        admin_url: str, settings: Settings, sandbox, tmp_path, monkeypatch) -> None:
    """The production instance's storage (dagster.yaml.example) writes a run's events on one pooled engine a
    process: a run of 13 events opens a handful of server sessions, not one an event as dagster-postgres's own
    storage does (a `NullPool`: 2,806 sessions for 10 evidence file-job runs, a third of the machine's CPU). A
    connection the server dropped meanwhile is replaced before use: the next run writes all of its events."""
    from dagster import DagsterInstance
    from dagster._core.instance.ref import InstanceRef

    from orchestration.storage import PooledPostgresStorage, prepare_dagster_storage

    name = "redrive_dagster_pool_test"
    url = production_instance_folder(admin_url, name, tmp_path, monkeypatch)
    prepare_dagster_storage(url)
    admin = engine_for(admin_url)

    def sessions() -> int:
        with admin.connect() as conn:
            return conn.execute(sa.text("SELECT sessions FROM pg_stat_database WHERE datname = :d"), {"d": name}).scalar()

    job = build_definitions(settings).resolve_job_def("stack_healthcheck_job")
    try:
        with DagsterInstance.from_ref(InstanceRef.from_dir(str(tmp_path))) as instance:
            assert isinstance(instance.get_ref().storage, PooledPostgresStorage)
            before = sessions()
            first = job.execute_in_process(instance=instance)
            assert first.success
            written = len(instance.all_logs(first.run_id))
            opened = sessions() - before
            assert written >= 10 and opened <= 5, (written, opened)
            with admin.connect() as conn:  # the server drops every connection the process pooled
                dropped = conn.execute(sa.text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                               "WHERE datname = :d"), {"d": name}).scalar()
            assert dropped >= 1
            second = job.execute_in_process(instance=instance)
            assert second.success and len(instance.all_logs(second.run_id)) == written
    finally:
        drop_database(admin_url, name)


def test_the_pooled_engine_is_one_a_process_and_a_forked_process_opens_its_own(admin_url: str) -> None:
    """Every instance a process builds shares one engine (the code server builds one a sensor tick); a fork (a run
    process forked from the code server's forkserver) never writes on a connection its parent holds."""
    import multiprocessing as mp

    from orchestration import storage

    url = dagster_storage_url(admin_url)
    engine = storage.shared_engine(url)
    assert storage.shared_engine(url) is engine
    with engine.connect() as conn:
        parent_pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def child() -> None:
        inherited = len(storage._engines)
        with storage.shared_engine(url).connect() as conn:
            writer.send((inherited, conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()))

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(timeout=60)
    inherited, child_pid = reader.recv()
    assert inherited == 0 and child_pid != parent_pid
    with engine.connect() as conn:  # the parent's pooled connection still works after the child exited
        assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() == parent_pid


def production_instance_folder(admin_url: str, name: str, folder, monkeypatch) -> str:
    """A fresh database `name` for Dagster's storage and `folder` as a DAGSTER_HOME with dagster.yaml.example;
    the storage URL (DAGSTER_PG_URL is set to it)."""
    import shutil

    from redrive.settings import PROJECT_ROOT

    drop_database(admin_url, name)
    create_database(admin_url, name)
    url = dagster_storage_url(with_database(admin_url, name))
    monkeypatch.setenv("DAGSTER_PG_URL", url)
    shutil.copyfile(PROJECT_ROOT / "dagster.yaml.example", folder / "dagster.yaml")
    return url
