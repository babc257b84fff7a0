"""Shared fixtures: the local stack once per session, a fresh migrated database per test.

The stack is the same one `make demo` uses (embedded PostgreSQL, moto, sandbox),
started with purpose "test" so its PostgreSQL data folder is not the demo's. With
DATABASE_URL set (CI's second pass) that server is used instead. Each test that
needs the database gets its own, cloned from a template migrated once (procrastinate's
trick): fresh state in ~100 ms, no test sees another's rows.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from devstack.postgres import create_database, drop_database, with_database
from devstack.stack import Stack, local_stack
from redrive import logs
from redrive.db import engine_for, upgrade_head
from redrive.settings import Settings

pytest_plugins = ("tests.browser",)  # `driver` (headless Chromium) and `serve_app` (an app on a real port)
_counter = itertools.count()
logs.install()  # as the code location does: no test log may carry a secret either


@pytest.fixture(autouse=True)
def _root_logger_restored() -> Iterator[None]:
    """A command run in-process (CliRunner) sets up the root logger as its process would; the next test starts
    from the logger as it was, so what one test configured never prints into another's captured output."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    with local_stack("test", migrate=False) as running:
        yield running


@pytest.fixture(scope="session")
def admin_url(stack: Stack) -> str:
    return with_database(stack.database_url, "postgres")


@pytest.fixture(scope="session")
def template_db(admin_url: str) -> Iterator[str]:
    name = f"redrive_tmpl_{os.getpid()}"
    drop_database(admin_url, name)
    create_database(admin_url, name)
    url = with_database(admin_url, name)
    upgrade_head(url)
    engine_for(url).dispose()
    yield name
    drop_database(admin_url, name)


@pytest.fixture
def db_url(admin_url: str, template_db: str) -> Iterator[str]:
    """A fresh database with all migrations applied, dropped after the test."""
    name = f"redrive_t_{os.getpid()}_{next(_counter)}"
    create_database(admin_url, name, template=template_db)
    url = with_database(admin_url, name)
    yield url
    engine_for(url).dispose()
    drop_database(admin_url, name)


@pytest.fixture
def project_tmp() -> Iterator[Path]:
    """A scratch folder inside the project's .data (not /tmp: another pytest session may prune /tmp's
    numbered folders while this one runs, and the embedded PostgreSQL must be able to traverse it)."""
    import shutil
    import uuid

    folder = Settings().redrive_data_dir / "test-scratch" / uuid.uuid4().hex[:10]
    folder.mkdir(parents=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def engine(db_url: str) -> sa.Engine:
    return engine_for(db_url)


@pytest.fixture
def sandbox(stack: Stack):
    from devstack.sandbox import SandboxClient

    client = SandboxClient(os.environ["SANDBOX_URL"])
    client.reset()
    yield client
    client.reset()


@pytest.fixture
def settings(db_url: str, stack: Stack) -> Settings:
    """Settings as a test's code location sees them: its own database, the session's moto and sandbox."""
    return Settings(database_url=db_url)


TIME_SCALE = 0.001  # every backoff wait × 0.001: a 3 s Retry-After becomes 3 ms; configuration, not code


@pytest.fixture
def scaled_settings(db_url: str, stack: Stack) -> Settings:
    return Settings(database_url=db_url, redrive_time_scale=TIME_SCALE, alert_burst_window_seconds=300)


@pytest.fixture
def defs(scaled_settings: Settings):
    """The whole code location, built on this test's database with shortened waits."""
    from orchestration.definitions import build_definitions

    return build_definitions(scaled_settings)


@pytest.fixture
def instance():
    """A throwaway Dagster instance (runs, event log) for one test."""
    import dagster as dg

    # no compute-log capture: it forks a process per step and the tests read the event log, not stdout
    overrides = {"compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager",
                                  "class": "NoOpComputeLogManager"}}
    with dg.instance_for_test(overrides=overrides) as inst:
        yield inst


@pytest.fixture
def screenshot_dir(tmp_path: Path) -> Path:
    """Where a browser test saves its screenshots: the folder REDRIVE_SCREENSHOTS names (`make screenshots`
    sets docs/images), else this test's temporary folder, so the suite writes nothing into the tracked tree."""
    from redrive.settings import PROJECT_ROOT

    asked = os.environ.get("REDRIVE_SCREENSHOTS")
    folder = (PROJECT_ROOT / asked) if asked else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
