"""Rehearsal demo: a clean request, one that rides out 429/503, one dead-lettered by a 401 and replayed."""

from __future__ import annotations

import sqlalchemy as sa

from assets.rehearsal import pipeline, repository
from redrive import deadletters
from redrive.clock import SystemClock

THROUGH_DAEMON = True  # its runs and its replay go through the deployed topology under `make demo`


def run_demo(ctx):  # -> orchestration.demo.DemoReport
    from orchestration.demo import DemoReport

    report = DemoReport(pipeline.PIPELINE)
    ctx.sandbox.put_store("demo/contract.txt", b"The supplier may change prices at any time.", "text/plain")
    ids = {k: f"demo-{ctx.session}-{k}" for k in ("clean", "flaky", "denied")}
    # each request's id is in its prompt: its faults and answers are its own, whatever else calls the LLM meanwhile
    marker = {k: f"(rehearsal {v})" for k, v in ids.items()}
    ctx.sandbox.set_default("llm", content='{"verdict": "one-sided"}', when=f"(rehearsal demo-{ctx.session}-")
    with ctx.engine.begin() as conn:
        for request_id in ids.values():
            repository.create(conn, request_id, "demo/contract.txt", f"Is this clause fair to the buyer? (rehearsal {request_id})")

    clean = ctx.run("rehearsal_job", run_config=pipeline.run_config(ids["clean"], {}))
    ctx.sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "2"}}, {"status": 503}, match=marker["flaky"])
    flaky = ctx.run("rehearsal_job", run_config=pipeline.run_config(ids["flaky"], {}))
    ctx.sandbox.script("llm", {"status": 401}, match=marker["denied"])
    denied = ctx.run("rehearsal_job", run_config=pipeline.run_config(ids["denied"], {}))
    assert clean.success and flaky.success and not denied.success, "rehearsal outcomes differ from the script"
    report.retried = ctx.retries_in(flaky)
    report.done = 2
    report.dead_lettered = 1
    report.notes.append(f"{ids['flaky']}: 429 (Retry-After 2) and 503 retried in-run, then done")

    with ctx.engine.begin() as conn:
        letter = deadletters.active_for(conn, pipeline.PIPELINE, ids["denied"])
        assert letter is not None and letter.error_class == "AUTH_DENIED"
        deadletters.request_replay(conn, letter.id, evidence="DEMO-1: API key rotated", confirm_safe=True,
                                   at=SystemClock().now(), operator="demo")
    replays = [r for r in ctx.tick("redrive_dead_letter_replays")  # (other pipelines' letters may replay too)
               if str(letter.id) in r.dagster_run.tags.get("redrive/replay_of", "").split(",")]
    assert replays and all(r.success for r in replays), "replay did not complete"
    with ctx.engine.connect() as conn:
        closed = conn.execute(sa.text("SELECT status FROM dead_letters WHERE id = :i"), {"i": letter.id}).scalar()
    assert closed == "resolved"
    report.done += 1
    report.notes.append(f"{ids['denied']}: 401 → dead letter {letter.id} + alert; "
                        f"replayed from stage '{letter.stage}' → {closed}")
    return report
