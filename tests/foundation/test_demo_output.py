"""`make demo` shows a failure it injects on purpose as one line, never Dagster's stack trace (issue 16 §6), and
runs the pipelines' demos at once, each on its own context, through the deployed topology."""

from __future__ import annotations

import threading
import uuid
from types import SimpleNamespace

import sqlalchemy as sa

from assets.rehearsal import pipeline, repository
from orchestration.demo import DemoContext


def test_an_injected_failure_is_one_line_without_a_stack_trace(defs, instance, scaled_settings, sandbox,
                                                               engine: sa.Engine, capfd) -> None:
    """A rehearsal run dead-lettered by a scripted 401 prints `✗ rehearsal_job: … AUTH_DENIED …`, and nothing else."""
    ctx = DemoContext(defs, instance, scaled_settings, sandbox, engine, uuid.uuid4().hex[:6])
    sandbox.put_store("demo/contract.txt", b"The supplier may change prices at any time.", "text/plain")
    with engine.begin() as conn:
        repository.create(conn, "denied-1", "demo/contract.txt", "Is this clause fair to the buyer?")
    sandbox.script("llm", {"status": 401})
    capfd.readouterr()

    result = ctx.run("rehearsal_job", run_config=pipeline.run_config("denied-1", {}))

    out, err = capfd.readouterr()
    assert not result.success
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert len(lines) == 1, out + err
    assert lines[0].startswith("    ✗ rehearsal_job: ") and "AUTH_DENIED" in lines[0]
    assert "Stack Trace" not in out + err and "Traceback" not in out + err


def test_demos_run_at_once_each_on_its_own_context_and_a_failed_check_is_one_line(capfd) -> None:
    """`make demo` runs the pipelines' demos on threads of their own, each with its own copy of the context; the
    reports come back in the registry's order, and a demo whose check fails is one line naming where."""
    from orchestration.demo import DemoReport, run_demos

    class Ctx:
        copies: list[Ctx] = []

        def for_demo(self) -> Ctx:
            copy = Ctx()
            Ctx.copies.append(copy)
            return copy

    seen: dict[str, tuple[str, object]] = {}

    def demo(name: str, fails: bool = False) -> SimpleNamespace:
        def run_demo(ctx):
            seen[name] = (threading.current_thread().name, ctx)
            assert not fails, f"{name} outcome differs from the script"
            return DemoReport(name, done=1)
        return SimpleNamespace(run_demo=run_demo)

    root = Ctx()
    reports = run_demos(root, [("first", demo("first")), ("broken", demo("broken", fails=True)),
                               ("last", demo("last"))])

    assert [r.pipeline if r else None for r in reports] == ["first", None, "last"]
    assert all(thread.startswith("demo") for thread, _ in seen.values())
    contexts = [ctx for _, ctx in seen.values()]
    assert len({id(c) for c in contexts}) == 3 and root not in contexts
    out, err = capfd.readouterr()
    [line] = err.splitlines()
    assert line.startswith("  broken: demo check FAILED: AssertionError: broken outcome differs from the script (")
    assert "Traceback" not in out + err


def test_a_failed_run_that_two_demos_wait_on_is_shown_once(capsys) -> None:
    """Under the daemon a replay run can be one that two demos' ticks both take: its failure prints once."""
    from orchestration.demo import DaemonDemoContext

    class Api:
        def clone(self) -> Api:
            return Api()

        def wait_run(self, run_id: str) -> str:
            return "FAILURE"

        def failures(self, run_id: str) -> list[str]:
            return ["Failure: ask attempt 1/5 of r: AUTH_DENIED: upstream answered 401"]

    instance = SimpleNamespace(get_run_by_id=lambda run_id: SimpleNamespace(job_name="rehearsal_job"))
    root = DaemonDemoContext(None, instance, None, None, None, "s", api=Api())
    one, two = root.for_demo(), root.for_demo()
    assert one.api is not two.api and one.since is not two.since  # GraphQL clients and tick bookkeeping apart

    assert not one.outcome("run-1").success and not two.outcome("run-1").success
    two.outcome("run-2")

    lines = capsys.readouterr().out.splitlines()
    assert lines == ["    ✗ rehearsal_job: Failure: ask attempt 1/5 of r: AUTH_DENIED: upstream answered 401"] * 2


def test_every_pipeline_demo_runs_through_the_daemon_on_the_settings_it_declares() -> None:
    """`make demo` drives every pipeline through the deployed topology, whose code location reads the settings
    the demos declare (the matchmaking weights in the artifact store) on top of the demo's pace."""
    import importlib

    from orchestration.demo import DAEMON_ENV, deployment_env, through_daemon
    from orchestration.demos import matchmaking
    from orchestration.registry import PIPELINES

    demos = [importlib.import_module(p.demo) for p in PIPELINES]
    assert [p.name for p, m in zip(PIPELINES, demos) if not through_daemon(m)] == []
    env = deployment_env(demos)
    assert env["MATCHMAKING_SCORING_PATH"] == matchmaking.WEIGHTS_PATH
    assert {k: env[k] for k in DAEMON_ENV} == DAEMON_ENV
    assert deployment_env([SimpleNamespace(), SimpleNamespace(DEPLOYMENT_ENV={"X_Y": "1"})]) == {**DAEMON_ENV,
                                                                                                "X_Y": "1"}
