"""`python -m devstack.sandbox` as a parent process sees it."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from devstack.sandbox import SandboxProcess
from devstack.sandbox.__main__ import prioritized


def test_port_zero_announces_a_real_port_and_sandboxes_run_side_by_side() -> None:
    """Two `--port 0` sandboxes announce different non-zero ports, keep separate state, and exit 0 on SIGTERM."""
    with SandboxProcess.start() as one, SandboxProcess.start() as two:
        ports = {urlsplit(one.url).port, urlsplit(two.url).port}
        assert len(ports) == 2 and 0 not in ports and None not in ports
        with one.client() as first, two.client() as second:
            assert first.health() and second.health()
            first.put_store("only-here", b"1", "text/plain")
            assert second.effects() == []
        codes = (one.stop(), two.stop())
    assert codes == (0, 0)


def test_ready_file_holds_the_url(tmp_path: Path) -> None:
    """With --ready-file the announced URL is also written to that file once listening."""
    ready = tmp_path / "sandbox.url"
    with SandboxProcess.start(extra_args=("--ready-file", str(ready), "--log-level", "warning")) as process:
        assert ready.read_text().strip() == process.url


def test_sandbox_priority_is_every_threads_niceness_or_real_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """`SANDBOX_PRIORITY` is the niceness, or the real-time policy, of the sandbox's process and of every thread it
    has (set before uvicorn starts, so the threads it starts inherit it); the benchmarks set `realtime` so a stalled
    loop does not bunch requests into one rate window."""
    monkeypatch.setenv("SANDBOX_PRIORITY", "19")
    with SandboxProcess.start() as process:
        with process.client() as client:
            assert client.health()
        threads = [int(t.name) for t in Path(f"/proc/{process.pid}/task").iterdir()]
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in threads} == {19}
        assert os.sched_getscheduler(process.pid) == os.SCHED_OTHER
    monkeypatch.delenv("SANDBOX_PRIORITY")
    with SandboxProcess.start() as process:
        assert os.getpriority(os.PRIO_PROCESS, process.pid) == os.getpriority(os.PRIO_PROCESS, 0)
    if os.geteuid() != 0:
        pytest.skip("real time needs CAP_SYS_NICE")
    monkeypatch.setenv("SANDBOX_PRIORITY", "realtime")
    with SandboxProcess.start() as process:
        with process.client() as client:
            assert client.health()
        threads = [int(t.name) for t in Path(f"/proc/{process.pid}/task").iterdir()]
        assert {os.sched_getscheduler(t) for t in threads} == {os.SCHED_RR}


def test_a_bad_or_refused_priority_is_one_line_and_changes_nothing() -> None:
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert prioritized(None) is None and prioritized("") is None
    assert prioritized("soon") == (
        "sandbox: SANDBOX_PRIORITY must be 'realtime' or a niceness from -20 to 19, not 'soon'; running as it is")
    assert os.getpriority(os.PRIO_PROCESS, 0) == before
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
