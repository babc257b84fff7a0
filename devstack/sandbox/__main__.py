"""Run the sandbox: `python -m devstack.sandbox --host 127.0.0.1 --port 0`.

Once listening it prints `SANDBOX_URL=http://HOST:PORT` on stdout (flushed), so a
parent process can start it on a free port and read where it landed; `--ready-file`
also writes the URL to a file. SIGTERM and SIGINT shut it down gracefully (exit code 0).
Logs go to stderr, access logs to stdout after the URL line (uvicorn's defaults).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from devstack.sandbox.app import create_app
from devstack.sandbox.client import SERVER_KEEP_ALIVE_SECONDS

# Held-open `timeout` steps must not stall a shutdown for their full length;
# nothing else in the sandbox is worth waiting for.
GRACEFUL_SHUTDOWN_SECONDS = 1


class _QuietShutdownCancel(logging.Filter):
    """Drop uvicorn's traceback for requests cancelled at shutdown (held-open timeout steps)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def bind(host: str, port: int) -> socket.socket:
    """Bind before uvicorn starts, so `--port 0` yields a real port we can announce."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class AnnouncingServer(uvicorn.Server):
    """A uvicorn server that says where it listens only once it really accepts connections."""

    def __init__(self, config: uvicorn.Config, *, url: str, ready_file: Path | None) -> None:
        super().__init__(config)
        self._url = url
        self._ready_file = ready_file

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.should_exit:
            return
        if self._ready_file is not None:
            # Write then rename, so a watcher never reads half a URL; before the
            # stdout line, so whoever reads that line also finds the file.
            partial = self._ready_file.with_name(self._ready_file.name + ".tmp")
            partial.write_text(self._url + "\n")
            os.replace(partial, self._ready_file)
        print(f"SANDBOX_URL={self._url}", flush=True)


def _stopped(signum: int, frame: object) -> None:
    raise SystemExit(0)


def prioritized(priority: str | None) -> str | None:
    """Run at `SANDBOX_PRIORITY` when it is set: `realtime` (SCHED_RR, priority 1) or a niceness (-20..19); what
    went wrong, if anything, as one line.

    A provider answers from its own machines: its meters do not stall because our workers use the cores. On this
    2-core box the sandbox shares them with every run process, and a stall of its loop of 50-230 ms bunches the
    requests that waited into one rate window, which it then counts over the limit (issue 26). Measured with the
    criticizer's deployed drain at 10,000: 11 such stalls at niceness -10 (6 refusals, each within 1 s of one), 1
    in real time (0 refusals). Set before uvicorn starts, so every thread it starts inherits it. Either needs the
    privilege to raise priority (CAP_SYS_NICE); without it the sandbox runs as it is and says so."""
    if not priority:
        return None
    try:
        if priority == "realtime":
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        else:
            os.setpriority(os.PRIO_PROCESS, 0, int(priority))
    except ValueError:
        return f"sandbox: SANDBOX_PRIORITY must be 'realtime' or a niceness from -20 to 19, not {priority!r}; running as it is"
    except OSError as exc:
        return f"sandbox: cannot run at priority {priority} ({exc.strerror}); running as it is"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devstack.sandbox", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0 picks a free port (default: 8765)")
    parser.add_argument("--ready-file", type=Path, help="write the URL here once listening")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument("--no-access-log", dest="access_log", action="store_false")
    parser.add_argument("--mail-token", help="mail sends must carry this bearer token (default: any token)")
    args = parser.parse_args(argv)
    refused = prioritized(os.environ.get("SANDBOX_PRIORITY"))
    if refused:
        print(refused, file=sys.stderr)

    # uvicorn shuts down gracefully on SIGTERM/SIGINT and then re-raises the signal;
    # answering that with a clean exit lets a parent tell "stopped" from "crashed".
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stopped)
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        print(f"sandbox: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        create_app(mail_token=args.mail_token),
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        timeout_keep_alive=int(SERVER_KEEP_ALIVE_SECONDS),  # its admin client forgets idle connections before this
    )
    logging.getLogger("uvicorn.error").addFilter(_QuietShutdownCancel())
    server = AnnouncingServer(config, url=url_of(sock), ready_file=args.ready_file)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
