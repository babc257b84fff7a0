"""Child processes of the local stack: start on a loopback port, wait until healthy, stop for sure."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a service to bind in a moment: one below the kernel's ephemeral range. A port
    `bind(0)` hands out is an ephemeral one, which any outgoing connection may take before the service binds it (the
    topology's webserver failed to start that way: `address already in use`)."""
    low = ephemeral_low()
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # all of them taken: the kernel's choice, as before
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ephemeral_low() -> int:
    """The first port of the range the kernel gives outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    url: str

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left: nothing outlives the stack."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def spawn(name: str, args: list[str], health_path: str, attempts: int = 3, log_dir: Path | None = None) -> Child:
    """Start `python -m …` on a fresh loopback port (retrying if the port was taken meanwhile)."""
    last_error = ""
    for _ in range(attempts):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, *[a.replace("{port}", str(port)) for a in args]]
        # stderr to a file, never an unread pipe: a full pipe would block the child.
        log_path = (log_dir or Path(tempfile.gettempdir())) / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_file, start_new_session=True)
        if wait_healthy(url + health_path, proc):
            return Child(name, proc, url)
        child = Child(name, proc, url)
        child.stop()
        last_error = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"{name} did not start: {last_error}")
