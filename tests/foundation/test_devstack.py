"""The local stack starts what is missing, stops all of it, and runs again on a clean slate."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from devstack.process import ephemeral_low, free_port
from redrive.settings import PROJECT_ROOT

# the same against any PostgreSQL: `make test-ci` (CI's second pass, on DATABASE_URL) leaves it out
pytestmark = pytest.mark.first_pass


def _ours(data_dir: Path) -> list[str]:
    """Processes that belong to a stack rooted at data_dir: its postgres, or moto/sandbox children of it."""
    found = []
    for proc in psutil.process_iter(attrs=["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if str(data_dir) in cmd:
            found.append(f"{proc.info['pid']}: {cmd[:120]}")
    return found


def _run_stack(data_dir: Path, marker: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "DAGSTER_PG_URL", "AWS_ENDPOINT_URL", "SANDBOX_URL", "DAGSTER_HOME",
                        "SLACK_WEBHOOK_URL", "ALERT_EMAIL_TO"}}
    env["REDRIVE_DATA_DIR"] = str(data_dir)
    probe = (
        "import os, httpx, sqlalchemy as sa;"
        "e = sa.create_engine(os.environ['DATABASE_URL']);"
        "c = e.connect(); c.execute(sa.text('select 1')); c.close(); e.dispose();"
        "assert httpx.get(os.environ['SANDBOX_URL'] + '/_admin/health').status_code == 200;"
        "assert httpx.get(os.environ['AWS_ENDPOINT_URL'] + '/moto-api/').status_code == 200;"
        f"open({str(marker)!r}, 'a').write(os.environ['AWS_ENDPOINT_URL'] + ' ' + os.environ['SANDBOX_URL'] + chr(10))"
    )
    return subprocess.run([sys.executable, "-m", "devstack", "run", "--purpose", "lifecycle", "--",
                           sys.executable, "-c", probe],
                          cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_a_services_port_is_free_and_outside_the_range_outgoing_connections_take() -> None:
    """The ports the stack and the topology hand their services are bindable and below the kernel's ephemeral range,
    so no outgoing connection (a client's source port) can take one before the service binds it."""
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < ephemeral_low() for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_stack_runs_twice_and_leaves_nothing_running(project_tmp: Path) -> None:
    """Two runs in a row: each reaches Postgres, moto and the sandbox; afterwards no process of it is left."""
    data_dir = project_tmp / "data"
    marker = project_tmp / "endpoints.txt"
    for _ in range(2):
        result = _run_stack(data_dir, marker)
        assert result.returncode == 0, result.stderr[-3000:]
        assert _ours(data_dir) == []
    endpoints = marker.read_text().splitlines()
    assert len(endpoints) == 2
    assert (data_dir / "pg" / "PG_VERSION").exists()  # the data folder is reused, not re-initialised
    postmaster = data_dir / "pg" / "postmaster.pid"
    assert not postmaster.exists()


STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_ctrl_c_kills_a_command_that_ignores_it_and_what_it_started() -> None:
    """`devstack run`'s Ctrl-C: a command that outlives Ctrl-C and SIGTERM is SIGKILLed with its children."""
    from devstack.__main__ import interrupt

    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    grandchild = psutil.Process(int(proc.stdout.readline()))  # type: ignore[union-attr]
    try:
        code = interrupt(proc, grace=0.5)
        assert code == -9, code  # killed, not stopped on its own
        gone, alive = psutil.wait_procs([grandchild], timeout=10)
        assert alive == [], "the command's own child outlived it"
    finally:  # whatever the outcome, the suite inherits neither
        for leftover in (psutil.Process(proc.pid) if proc.poll() is None else None, grandchild):
            if leftover is not None and leftover.is_running():
                leftover.kill()


def test_ctrl_c_returns_the_exit_code_of_a_command_that_stops() -> None:
    """A command that handles Ctrl-C and exits is waited for and its code returned; nothing is killed."""
    from devstack.__main__ import interrupt

    # its own Ctrl-C handler: a suite started in the background runs with SIGINT ignored, and children inherit that
    proc = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                             "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                             "try:\n    print('up', flush=True); time.sleep(600)\n"
                             "except KeyboardInterrupt:\n    sys.exit(3)"], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"up"  # type: ignore[union-attr]
    assert interrupt(proc, grace=60) == 3


def test_a_command_that_ignores_ctrl_c_is_stopped_by_sigterm_and_what_it_left_is_killed() -> None:
    """Started in the background, a command may ignore Ctrl-C: SIGTERM stops it, and its children go with it."""
    from devstack.__main__ import interrupt

    # SIGTERM as a fresh process has it, whatever this suite's process handed down (a fresh clone's suite once saw
    # the child outlive SIGTERM by 0.5 s: inherited as blocked or ignored, or a loaded machine; the grace covers both)
    script = STUBBORN.replace("signal.signal(signal.SIGTERM, signal.SIG_IGN)\nchild",
                              "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
                              "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\nchild")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    grandchild = psutil.Process(int(proc.stdout.readline()))  # type: ignore[union-attr]
    try:
        assert interrupt(proc, grace=5) == -15
        assert psutil.wait_procs([grandchild], timeout=10)[1] == [], "the command's own child outlived it"
    finally:
        if grandchild.is_running():
            grandchild.kill()
