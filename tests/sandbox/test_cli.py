"""`python -m devstack.sandbox` as a parent process sees it."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from devstack.sandbox import SandboxProcess


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
