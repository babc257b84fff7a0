"""Real worker processes for the fault tests, and a slow door to the sandbox's PDF gateway.

The sandbox can fail a call or hold it and then fail it, but not hold it and then *succeed*; a
worker paused mid-call or terminated mid-call needs exactly that. `SlowGateway` forwards to the
sandbox (which still does the conversion and records the effect) after a delay that a test can change.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from redrive.settings import PROJECT_ROOT


class SlowGateway:
    """A local HTTP server in front of the sandbox's /pdf/v1 that waits ``delay`` seconds (and its gate) before forwarding."""

    def __init__(self, upstream: str, delay: float) -> None:
        self.upstream = upstream.rstrip("/")
        self.delay = delay
        self.gate = threading.Event()  # cleared by a test: calls wait (up to 4 min) until it is set again
        self.gate.set()
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                time.sleep(gateway.delay)
                gateway.gate.wait(240)
                answer = httpx.request(method, f"{gateway.upstream}{self.path.removeprefix('/pdf/v1')}",
                                       content=body or None, timeout=30)
                self.send_response(answer.status_code)
                self.send_header("Content-Type", answer.headers.get("content-type", "application/octet-stream"))
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                self._forward("POST")

            def do_GET(self) -> None:  # noqa: N802
                self._forward("GET")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/pdf/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class WorkerProcess:
    """`python -m assets.conversion.worker` as a child process with its own environment; JSON logs to a file."""

    def __init__(self, name: str, env: Mapping[str, str], log_dir: Path, *, until_idle: float = 3.0) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "assets.conversion.worker", "--worker-id", name, "--until-idle", str(until_idle)],
            cwd=PROJECT_ROOT, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def stop(self) -> None:
        """Best-effort cleanup: resume if paused, then terminate."""
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(self.proc.pid, sig)
                except ProcessLookupError:
                    break
            self.proc.wait(timeout=10)
        if not self._log.closed:
            self._log.close()

    def events(self) -> list[dict[str, Any]]:
        """The worker's event lines written so far (other JSON lines — httpx, alembic — and text are skipped)."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "event" in record:
                    out.append(record)
        return out


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.01) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def worker_env(db_url: str, gateway_url: str, uploads: Path, results: Path, **knobs: Any) -> dict[str, str]:
    """Environment of a worker process: the test's database and folders, short leases, waits × 0.001."""
    env = {
        "DATABASE_URL": db_url,
        "GATEWAY_URL": gateway_url,
        "UPLOADS_DIR": str(uploads),
        "RESULTS_DIR": str(results),
        "WORKER_LEASE_TTL_SEC": "2",
        "WORKER_LEASE_EXTEND_SEC": "0.5",
        "WORKER_IDLE_SLEEP_SEC": "0.05",
        "GATEWAY_TIMEOUT_MS": "10000",
        "REDRIVE_TIME_SCALE": "0.001",
        "REDRIVE_LOG_FORMAT": "json",
    }
    env.update({k.upper(): str(v) for k, v in knobs.items()})
    return env
