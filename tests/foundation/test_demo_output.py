"""`make demo` shows a failure it injects on purpose as one line, never Dagster's stack trace (issue 16 §6)."""

from __future__ import annotations

import uuid

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
