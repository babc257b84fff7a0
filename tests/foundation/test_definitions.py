"""The code location loads, as `dagster definitions validate` and the UI load it."""

from __future__ import annotations

import os
import subprocess
import sys

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
