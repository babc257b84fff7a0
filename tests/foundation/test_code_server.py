"""The code server's run processes come from a forkserver that loaded the code location once
(orchestration.code_server); the topology test sees a real run's process forked from it."""

from __future__ import annotations

import logging
import multiprocessing.forkserver
import threading

import pytest
from dagster._grpc import server
from dagster._core.utils import FuturesAwareThreadPoolExecutor

from orchestration import code_server


def test_run_processes_start_from_the_forkserver_unless_told_spawn() -> None:
    assert code_server.start_method({}) == "forkserver"
    assert code_server.start_method({"REDRIVE_RUN_PROCESS_START": " Spawn "}) == "spawn"
    with pytest.raises(SystemExit, match="REDRIVE_RUN_PROCESS_START must be one of forkserver, spawn, not 'fork'"):
        code_server.start_method({"REDRIVE_RUN_PROCESS_START": "fork"})


def test_an_installed_code_server_makes_its_run_processes_with_the_preloading_forkserver(monkeypatch) -> None:
    """Fails when a Dagster upgrade stops keeping the server's multiprocessing context where install() puts it."""
    monkeypatch.setattr(server.DagsterApiServer, "__init__", server.DagsterApiServer.__init__)  # undone after
    monkeypatch.setattr(multiprocessing.forkserver._forkserver, "_preload_modules", ["__main__"])
    started: list[str] = []
    monkeypatch.setattr(code_server.multiprocessing.forkserver, "ensure_running", lambda: started.append("once"))
    code_server.install(preload=("orchestration.preload",))
    code_server.install(preload=("orchestration.preload",))  # a second install wraps nothing twice
    with FuturesAwareThreadPoolExecutor(max_workers=1) as pool:
        api = server.DagsterApiServer(server_termination_event=threading.Event(), logger=logging.getLogger("t"),
                                      server_threadpool_executor=pool)
    for thread in [t for t in threading.enumerate() if t.name == "run-forkserver"]:
        thread.join(5)
    assert api._mp_ctx.get_start_method() == "forkserver"
    assert multiprocessing.forkserver._forkserver._preload_modules == ["orchestration.preload"]
    assert started == ["once"]  # the forkserver starts with the server, not at its first run


def test_a_forkserver_that_cannot_build_the_definitions_says_so_in_one_line_and_runs_build_their_own(
        monkeypatch, caplog) -> None:
    """Each run then pays the build itself (seconds of CPU): the code server's log says it, with the error's class
    only (its message may carry configuration), and `defs()` still builds for the run."""
    from orchestration import definitions

    calls: list[str] = []

    def broken(*_: object) -> None:
        calls.append("build")
        raise ValueError("DATABASE_URL=postgresql://app:hunter2@db/redrive is unreachable")

    monkeypatch.setattr(definitions, "build_definitions", broken)
    monkeypatch.setattr(definitions, "_prebuilt", None)
    with caplog.at_level(logging.WARNING, logger="orchestration.definitions"):
        definitions.prebuild()
    assert definitions._prebuilt is None
    said = [r.getMessage() for r in caplog.records if r.name == "orchestration.definitions"]
    assert said == ["the code server's forkserver could not build the Definitions (ValueError): each run builds "
                    "them itself"]
    assert "hunter2" not in caplog.text
    with pytest.raises(ValueError):
        definitions.defs()  # the run meets the failure itself and reports it as its own
    assert calls == ["build", "build"]
