"""The code server: Dagster's `dagster api grpc`, with each run's process forked from one that loaded the location.

Dagster's code server starts a run's process with multiprocessing's spawn: a new interpreter, which imports Dagster,
dagster-postgres and the code location and builds the Definitions before the run does any work. That is ~4 CPU-s
on this machine for every run (issue 26), whatever the run does: an evidence file job of the seed's 200 rows paid
more for it than for its rows. Here the code server's run processes come from multiprocessing's forkserver, whose
one process imports those modules and builds the Definitions once (`orchestration.preload`); a run's process is a
fork of it and starts with all of that in memory. The run is still Dagster's code server's run: the same target,
event queue, termination event, cancellation and run monitoring; only how its process is made changes. Dagster's
multiprocess executor does the same for a step's process (`start_method: forkserver`, `preload_modules`).

Deployed as the code server's command (devstack.topology, the Dockerfile, docs/deploying.md)::

    python -m orchestration.code_server -m orchestration.definitions --location-name redrive -h 0.0.0.0 -p 4000

Its arguments are `dagster api grpc`'s. `REDRIVE_RUN_PROCESS_START=spawn` keeps Dagster's own way.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import sys
import threading
from collections.abc import Sequence

PRELOAD = ("orchestration.preload",)
"""What the forkserver imports once, before its first fork: Dagster's run entry point, the instance's storage and
the built Definitions."""

START_METHODS = ("forkserver", "spawn")


def start_method(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """Pure: how run processes are made, from REDRIVE_RUN_PROCESS_START (forkserver unless told spawn)."""
    method = (environ.get("REDRIVE_RUN_PROCESS_START") or "forkserver").strip().lower()
    if method not in START_METHODS:
        raise SystemExit(f"REDRIVE_RUN_PROCESS_START must be one of {', '.join(START_METHODS)}, not {method!r}")
    return method


def run_process_context(preload: Sequence[str] = PRELOAD) -> multiprocessing.context.BaseContext:
    """The forkserver context whose server preloads `preload`, started now on a thread of its own: the code
    server answers while it loads, and its first run needs not wait for that."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    threading.Thread(target=multiprocessing.forkserver.ensure_running, name="run-forkserver", daemon=True).start()
    return context


def install(preload: Sequence[str] = PRELOAD) -> None:
    """Make every Dagster code server made in this process start its run processes from the forkserver.

    Dagster's server picks spawn in its constructor (`DagsterApiServer._mp_ctx`) and offers no setting for it;
    the constructor is wrapped so that its context is this one. tests/foundation/test_code_server.py fails when
    a Dagster upgrade moves that attribute."""
    from dagster._grpc import server

    original = server.DagsterApiServer.__init__
    if getattr(original, "_redrive_forkserver", False):
        return

    @functools.wraps(original)
    def __init__(self: server.DagsterApiServer, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        self._mp_ctx = run_process_context(preload)

    __init__._redrive_forkserver = True  # type: ignore[attr-defined]
    server.DagsterApiServer.__init__ = __init__  # type: ignore[method-assign]


def main(argv: Sequence[str] | None = None) -> None:
    """`dagster api grpc` with `argv`, its run processes forked from the preloaded forkserver."""
    from dagster._cli import main as dagster_main

    if start_method() == "forkserver":
        install()
    sys.argv = ["dagster", "api", "grpc", *(sys.argv[1:] if argv is None else argv)]
    dagster_main()


if __name__ == "__main__":
    main()
