"""`make dev`: the local stack and `dagster dev` come up, the UI loads the code location, and all of it stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from devstack.process import free_port
from redrive.settings import PROJECT_ROOT

# the same against any PostgreSQL: `make test-ci` (CI's second pass, on DATABASE_URL) leaves it out
pytestmark = pytest.mark.first_pass

QUERY = ('{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus '
         'locationOrLoadError { __typename ... on PythonError { message } } } } } }')


def test_dagster_dev_loads_code_location_without_errors(project_tmp: Path) -> None:
    """GraphQL reports the `redrive` location LOADED as a repository location; SIGTERM leaves nothing behind."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in {"DAGSTER_HOME"}}
    env["REDRIVE_DATA_DIR"] = str(project_tmp / "data")
    env["DAGSTER_HOME"] = str(project_tmp / "dagster_home")
    os.makedirs(env["DAGSTER_HOME"])
    dagster = str(Path(sys.executable).parent / "dagster")
    proc = subprocess.Popen([sys.executable, "-m", "devstack", "run", "--purpose", "uitest", "--", dagster, "dev",
                             "-w", "workspace.yaml", "-p", str(port)], cwd=PROJECT_ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=(log := open(project_tmp / "dev.log", "wb")),
                            start_new_session=True)
    entries = None
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                reply = httpx.post(f"http://127.0.0.1:{port}/graphql", json={"query": QUERY}, timeout=5).json()
                entries = reply["data"]["workspaceOrError"]["locationEntries"]
                if entries and entries[0]["loadStatus"] == "LOADED":
                    break
            except (httpx.HTTPError, KeyError, TypeError, ValueError):
                pass
            time.sleep(1)  # polling a server we started; not a timing assertion
    finally:
        children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(180)  # dagster dev and the stack stop their children; slow on a loaded machine
            stopped = True
        except subprocess.TimeoutExpired:
            stopped = False
        _, alive = psutil.wait_procs(children, timeout=30)
        _kill_left_over(proc, alive)  # the test fails below, but the rest of the suite never inherits them
    log.close()
    tail = (project_tmp / "dev.log").read_text(errors="replace").splitlines()[-5:]
    assert stopped, f"dagster dev did not stop within 180 s of SIGTERM; its last lines: {tail}"
    assert alive == [], f"processes left after SIGTERM: {[p.pid for p in alive]}"
    assert entries and entries[0]["name"] == "redrive"
    assert entries[0]["locationOrLoadError"]["__typename"] == "RepositoryLocation", entries


def _kill_left_over(proc: subprocess.Popen[bytes], alive: list[psutil.Process]) -> None:
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
