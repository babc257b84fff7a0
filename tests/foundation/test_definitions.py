"""The code location loads, as `dagster definitions validate` and the UI load it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from devstack.stack import Stack
from orchestration.definitions import build_definitions
from redrive.settings import PROJECT_ROOT, Settings


def test_definitions_build_with_every_job_and_sensor(settings: Settings) -> None:
    """Every job, sensor and resource resolves; a missing resource key would fail here."""
    defs = build_definitions(settings)
    jobs = {job.name for job in defs.resolve_all_job_defs()}
    assert {"stack_healthcheck_job", "rehearsal_job"} <= jobs
    sensors = {sensor.name for sensor in defs.sensors}
    assert {"redrive_alert_delivery", "redrive_run_failure_alerts", "redrive_dead_letter_replays"} <= sensors
    defs.validate_loadable(defs)


def test_dagster_definitions_validate_accepts_workspace(stack: Stack) -> None:
    """`dagster definitions validate -w workspace.yaml` exits 0, as the UI's loader would load it."""
    dagster = os.path.join(os.path.dirname(sys.executable), "dagster")
    result = subprocess.run([dagster, "definitions", "validate", "-w", "workspace.yaml"], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=240, env=os.environ.copy())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Validation successful" in result.stdout + result.stderr


def test_loading_the_code_location_leaves_pandas_unimported() -> None:
    """Every run's process loads the whole code location; pandas (~0.25 s of CPU) waits for matchmaking to read a
    pool, so a file-job or drain run does not pay for it."""
    code = ("import sys; from orchestration.definitions import build_definitions; from redrive.settings import "
            "Settings; build_definitions(Settings()); print(sorted(m for m in ('pandas', 'assets.matchmaking.policy') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True,
                            timeout=120, env=os.environ.copy())
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "['assets.matchmaking.policy']"


def test_a_deployment_writes_the_code_locations_bytecode_before_its_processes_load_it() -> None:
    """Run processes are spawned with the code server's interpreter flags; where PYTHONDONTWRITEBYTECODE is set
    none of them writes bytecode, so the topology writes it at start, or every run compiles every module."""
    import importlib.util

    from devstack.topology import compile_code_location

    source = PROJECT_ROOT / "assets" / "evidence" / "worker.py"
    cached = Path(importlib.util.cache_from_source(str(source)))
    cached.unlink(missing_ok=True)
    compile_code_location()
    assert cached.exists() and cached.stat().st_mtime >= source.stat().st_mtime
