"""Matchmaking fixtures: a code location of the core plus this pipeline, users, and run helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from assets.matchmaking import synthetic
from redrive.settings import PROJECT_ROOT, Settings

TZ = "America/New_York"
DAY = "2026-03-08"  # US clocks spring forward that night
KEY = f"{DAY}|{TZ}"
TIMEZONES = "America/New_York,Europe/Berlin,Asia/Kolkata"
CHUNK = 8


@pytest.fixture
def mm_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """MATCHMAKING_* as an operator would set them, and a registry of only this pipeline.

    Building just the core and matchmaking keeps these tests independent of other pipelines' state.
    """
    from orchestration import registry

    env = {"MATCHMAKING_TIMEZONES": TIMEZONES, "MATCHMAKING_CHUNK_SIZE": str(CHUNK),
           "MATCHMAKING_START_DATE": "2026-01-01"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(registry, "PIPELINES", registry.selected(["matchmaking"]))
    return env


@pytest.fixture
def mm_defs(scaled_settings: Settings, mm_env: dict[str, str]) -> dg.Definitions:
    from orchestration.definitions import build_definitions

    return build_definitions(scaled_settings)


@pytest.fixture
def population(engine: sa.Engine):
    """Insert synthetic users; returns their rows."""
    def make(n: int, *, tz: str = TZ, tag: str = "pop", regions: int = 3):
        rows = synthetic.users(n, timezone=tz, tag=tag, regions=regions)
        with engine.begin() as conn:
            synthetic.insert(conn, rows)
        return rows
    return make


def run(defs: dg.Definitions, instance: dg.DagsterInstance, key: str = KEY, *,
        config: Mapping[str, Any] | None = None, tags: Mapping[str, str] | None = None) -> dg.ExecuteInProcessResult:
    run_config = {"ops": {"daily_match_offers": {"config": dict(config)}}} if config else None
    return defs.resolve_job_def("matchmaking_job").execute_in_process(
        partition_key=key, run_config=run_config, instance=instance, tags=dict(tags or {}), raise_on_error=False)


def offers(engine: sa.Engine) -> list[tuple]:
    """Every offer row, all columns, in id order."""
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT * FROM matchmaking_offers ORDER BY id"))]


def jobs(engine: sa.Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return {str(r.user_id): r for r in conn.execute(sa.text("SELECT * FROM matchmaking_jobs"))}


def dead_letters(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text("SELECT * FROM dead_letters WHERE pipeline = 'matchmaking' ORDER BY id")))


def subprocess_env(db_url: str, **extra: str) -> dict[str, str]:
    return {**os.environ, "DATABASE_URL": db_url, "MATCHMAKING_TIMEZONES": TIMEZONES,
            "REDRIVE_TIME_SCALE": "0.001", "PYTHONPATH": str(PROJECT_ROOT), **extra}


def start_partition_process(db_url: str, log: Path, key: str = KEY, *, go_file: Path | None = None,
                            **env: str) -> subprocess.Popen[str]:
    """`tests.matchmaking.run_partition` in a child process: the job executed in process, on this database.

    Its stderr goes to `log` (a pipe nobody reads could fill up and stall the child)."""
    args = [sys.executable, "-m", "tests.matchmaking.run_partition", key] + ([str(go_file)] if go_file else [])
    with log.open("w") as err:
        return subprocess.Popen(args, cwd=PROJECT_ROOT, env=subprocess_env(db_url, **env), stdout=subprocess.PIPE,
                                stderr=err, text=True)


def wait_for(condition, *, timeout: float = 60.0, what: str = "condition") -> None:
    """Poll a condition of the outside world (another process's progress); fail after `timeout`."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)

