"""The local stack: embedded PostgreSQL, moto (S3, SQS) and the sandbox, started for one command.

`local_stack()` starts only what the environment does not already name
(DATABASE_URL, AWS_ENDPOINT_URL, SANDBOX_URL), exports the endpoints to the
environment so Dagster's run workers inherit them, and stops everything it started
on exit, also on Ctrl-C. Ports are chosen fresh each time, so a second run never
meets a port left by the first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from devstack.moto import MOTO_ENV, start_moto
from devstack.postgres import EmbeddedPostgres, create_database, with_database
from devstack.process import Child, spawn
from redrive.db import dagster_storage_url
from redrive.settings import PROJECT_ROOT, Settings

APP_DATABASE = "redrive"
DAGSTER_DATABASE = "dagster"

DAGSTER_YAML = """\
# Written by devstack for local runs; see dagster.yaml.example for production.
storage:
  custom:
    module: orchestration.storage
    class: PooledPostgresStorage
    config:
      postgres_url:
        env: DAGSTER_PG_URL
run_coordinator:
  # Dagster's QueuedRunCoordinator, which also tags asset-page launches and backfill runs with their pipeline.
  module: orchestration.run_coordinator
  class: PipelineTaggingRunCoordinator
  config:
    max_concurrent_runs: 8
    tag_concurrency_limits:
      - key: redrive/pipeline
        value: conversion
        limit: 1
# As dagster.yaml.example: only infrastructure failures re-run a run, never a dead-lettered or deferred one.
run_retries:
  enabled: true
  max_retries: 1
  retry_on_asset_or_op_failure: false
# As dagster.yaml.example: a run stuck in STARTING is failed, so a drain sensor does not wait on it forever.
run_monitoring:
  enabled: true
  start_timeout_seconds: 180
  poll_interval_seconds: 30
telemetry:
  enabled: false
"""


@dataclass
class Stack:
    env: dict[str, str] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)
    database_url: str = ""
    postgres: EmbeddedPostgres | None = None


@contextlib.contextmanager
def exported(env: dict[str, str]) -> Iterator[None]:
    """This process's environment with `env` set, as it was after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def dagster_home(purpose: str) -> Path:
    home = PROJECT_ROOT / ".dagster_home" / purpose
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    return home


@contextlib.contextmanager
def local_stack(purpose: str = "dev", *, migrate: bool = True) -> Iterator[Stack]:
    """Start what is missing, export it, yield, stop it. `purpose` keeps test data apart from the demo's."""
    settings = Settings()
    stack = Stack()
    children: list[Child] = []
    try:
        if settings.database_url:
            stack.database_url = settings.database_url
            admin_url = with_database(settings.database_url, "postgres")
        else:
            # tests and the chaos run (which restarts its server) each have a server of their own
            folder = {"test": "pg-test", "chaos": "pg-chaos"}.get(purpose, "pg")
            stack.postgres = EmbeddedPostgres(settings.redrive_data_dir / folder)
            admin_url = stack.postgres.start()
            stack.started.append("postgres")
            create_database(admin_url, APP_DATABASE)
            stack.database_url = with_database(admin_url, APP_DATABASE)
            stack.env["DATABASE_URL"] = stack.database_url
        if not settings.dagster_pg_url:
            create_database(admin_url, DAGSTER_DATABASE)
            stack.env["DAGSTER_PG_URL"] = dagster_storage_url(with_database(admin_url, DAGSTER_DATABASE))
        if not os.environ.get("DAGSTER_HOME"):
            stack.env["DAGSTER_HOME"] = str(dagster_home(purpose))

        if not settings.aws_endpoint_url:
            moto = start_moto(settings.redrive_data_dir / "logs")
            children.append(moto)
            stack.started.append("moto")
            stack.env.update(MOTO_ENV)
            stack.env["AWS_ENDPOINT_URL"] = moto.url
        if not settings.sandbox_url:
            sandbox = spawn("sandbox", ["-m", "devstack.sandbox", "--port", "{port}", "--no-access-log"],
                            "/_admin/health", log_dir=settings.redrive_data_dir / "logs")
            children.append(sandbox)
            stack.started.append("sandbox")
            stack.env["SANDBOX_URL"] = sandbox.url
            stack.env.setdefault("SLACK_WEBHOOK_URL", f"{sandbox.url}/slack/webhook/redrive-alerts")
            stack.env.setdefault("ALERT_EMAIL_TO", "oncall@example.com")

        with exported(stack.env):
            if migrate:
                from redrive.db import upgrade_head

                upgrade_head(stack.database_url)
            yield stack
    finally:
        for child in reversed(children):
            child.stop()
        if stack.postgres is not None:
            stack.postgres.stop()
