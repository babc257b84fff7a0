"""Start a sandbox as a child process on a free port and stop it for sure.

Used by the test fixture and the demo: the child binds port 0 itself and announces
`SANDBOX_URL=…`, so there is no window in which another process can take the port.
"""

from __future__ import annotations

import queue
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import TracebackType
from typing import IO

from devstack.sandbox.client import SandboxClient

URL_PREFIX = "SANDBOX_URL="
PROJECT_ROOT = Path(__file__).resolve().parents[2]


class SandboxStartError(RuntimeError):
    """The child exited or stayed silent instead of announcing its URL."""


class SandboxProcess:
    """One `python -m devstack.sandbox --port 0` child; use as a context manager."""

    def __init__(
        self, popen: subprocess.Popen[str], url: str, stderr: IO[bytes], drain: threading.Thread
    ) -> None:
        self._popen = popen
        self._stderr = stderr
        self._drain = drain
        self.url = url

    @classmethod
    def start(
        cls,
        *,
        host: str = "127.0.0.1",
        cwd: Path = PROJECT_ROOT,
        startup_timeout: float = 20.0,
        extra_args: tuple[str, ...] = ("--log-level", "warning", "--no-access-log"),
    ) -> SandboxProcess:
        stderr = tempfile.TemporaryFile()
        popen = subprocess.Popen(
            [sys.executable, "-m", "devstack.sandbox", "--host", host, "--port", "0", *extra_args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        lines: queue.Queue[str | None] = queue.Queue()
        # Keep draining stdout for the child's whole life, so a full pipe can never block it.
        drain = threading.Thread(target=_drain, args=(popen.stdout, lines), daemon=True)
        drain.start()
        try:
            url = _await_url(lines, startup_timeout)
        except SandboxStartError as exc:
            _stop(popen, drain)
            stderr.seek(0)
            tail = stderr.read()[-2000:].decode(errors="replace")
            stderr.close()
            raise SandboxStartError(f"{exc}; stderr:\n{tail}") from None
        return cls(popen, url, stderr, drain)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def client(self, timeout: float = 10) -> SandboxClient:
        return SandboxClient(self.url, timeout=timeout)

    def stop(self) -> int:
        """SIGTERM, wait, SIGKILL if it lingers; returns the exit code. Safe to call twice."""
        code = _stop(self._popen, self._drain)
        self._stderr.close()
        return code

    def __enter__(self) -> SandboxProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _drain(stdout: IO[str] | None, lines: queue.Queue[str | None]) -> None:
    if stdout is None:
        lines.put(None)
        return
    for line in stdout:
        lines.put(line)
    lines.put(None)  # EOF: the child is gone


def _await_url(lines: queue.Queue[str | None], timeout: float) -> str:
    while True:
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            raise SandboxStartError(f"no {URL_PREFIX} line within {timeout}s") from None
        if line is None:
            raise SandboxStartError("sandbox exited before announcing its URL")
        if line.startswith(URL_PREFIX):
            return line[len(URL_PREFIX) :].strip()


def _stop(popen: subprocess.Popen[str], drain: threading.Thread, timeout: float = 10.0) -> int:
    if popen.poll() is None:
        popen.terminate()
        try:
            popen.wait(timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
    code = popen.wait()
    drain.join(timeout)  # reaches EOF once the child is gone
    if popen.stdout is not None:
        popen.stdout.close()
    return code
