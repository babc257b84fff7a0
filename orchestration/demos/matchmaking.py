"""Matchmaking demo: one (date, timezone) partition of 400 fresh users, with the scoring weights read from
the sandbox store while it answers 503 and then times out (retried), two users whose profiles are
inconsistent (dead-lettered and alerted once each), a rerun that touches only them, a `dlq replay` of one
after its fix and a plain rerun for the other."""

from __future__ import annotations

import json
from typing import Any

import dagster as dg
import sqlalchemy as sa

from assets.matchmaking import synthetic
from orchestration.pipelines.matchmaking import pipeline_defs
from assets.matchmaking.pipeline import ASSET, JOB, PIPELINE
from assets.matchmaking.policy import Partition
from assets.matchmaking.settings import MatchmakingSettings
from redrive import deadletters
from redrive.clock import SystemClock
from redrive.schema import dead_letters
from sensors.core import dead_letter_replay_sensor

PARTITION = Partition.parse("2026-03-08", "America/New_York")  # the night US clocks spring forward
KEY = f"{PARTITION.date.isoformat()}|{PARTITION.timezone}"
WEIGHTS_PATH = "matchmaking/scoring/demo-1.json"
WEIGHTS = {"version": "demo-1", "interests": 0.55, "age": 0.15, "distance": 0.25, "variety": 0.05}
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}  # runs fail on purpose here


def run_demo(ctx):  # -> orchestration.demo.DemoReport
    from orchestration.demo import DemoReport, evaluate_sensor, failure_line

    report = DemoReport(PIPELINE)
    # As an operator who publishes scoring weights to the artifact store configures it (MATCHMAKING_SCORING_PATH).
    built = pipeline_defs(ctx.settings, MatchmakingSettings(scoring_path=WEIGHTS_PATH))
    defs = dg.Definitions(assets=built.assets, jobs=built.jobs, resources=ctx.defs.resources,
                          sensors=[dead_letter_replay_sensor(built.replay_targets)])
    job = defs.resolve_job_def(JOB)

    def run(**kwargs: Any) -> dg.ExecuteInProcessResult:
        result = job.execute_in_process(partition_key=kwargs.pop("partition_key", KEY), instance=ctx.instance,
                                        run_config={**QUIET, **kwargs.pop("run_config", {})},
                                        raise_on_error=False, **kwargs)
        if not result.success:
            print(failure_line(JOB, result), flush=True)  # one line, never Dagster's stack trace
        return result

    def metadata(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
        if result.success:
            entries = result.asset_materializations_for_node(ASSET)[0].metadata
        else:
            entries = result.failure_data_for_node(ASSET).user_failure_data.metadata
        return {k: v.value for k, v in entries.items()}

    ctx.sandbox.put_store(WEIGHTS_PATH, json.dumps(WEIGHTS).encode(), "application/json")
    tag = f"demo-{ctx.session}"
    people = synthetic.users(400, timezone=PARTITION.timezone, tag=tag, regions=4)
    broken = {people[17]["id"]: {"age_min": 45, "age_max": 30}, people[211]["id"]: {"gender": None}}
    with ctx.engine.begin() as conn:
        synthetic.insert(conn, [{**p, **broken.get(p["id"], {})} for p in people])
    mine = [p["id"] for p in people]

    # 1. the store answers 503, then holds the request and answers 504: both retried (TIMEOUT, 30 s / 2 min × scale)
    ctx.sandbox.script("store", {"status": 503}, {"kind": "timeout", "seconds": 1})
    first = run()
    retries = ctx.retries_in(first)
    meta = metadata(first)
    assert not first.success and retries == 2, "the store faults were not retried as scripted"
    assert meta["failures_by_code"] == {"DATA_INCONSISTENCY": 2}, meta["failures_by_code"]
    letters = _letters(ctx.engine, list(broken))
    assert len(letters) == 2 and all(d.status == "open" for d in letters.values())
    report.retried += retries
    report.dead_lettered = 2
    report.notes.append(f"{KEY}: store 503 + timeout retried {retries}×; {meta['jobs_completed']} users got "
                        f"{meta['offers_written']} offers; 2 inconsistent profiles dead-lettered and alerted "
                        f"(run failed on purpose, tagged dead-lettered)")

    # 2. a rerun before any fix touches only the two failed users, and alerts nobody again
    again = metadata(run())
    assert again["users_processed"] == 2 and again["jobs_completed"] == 0, again
    report.notes.append(f"rerun: {again['users_processed']} users retried, {again['jobs_already_completed']} "
                        f"completed users returned, not recomputed; no new alert")

    # 3. fix one profile, replay its dead letter the operator's way: the replay sensor runs that user alone
    first_bad, second_bad = list(broken)
    _fix(ctx.engine, first_bad)
    with ctx.engine.begin() as conn:
        deadletters.request_replay(conn, letters[first_bad].id, evidence="DEMO-4: profile age range corrected",
                                   confirm_safe=True, at=SystemClock().now(), operator="demo")
    requests = evaluate_sensor(defs, ctx.instance, "redrive_dead_letter_replays")
    mine_requests = [r for r in requests if str(letters[first_bad].id) in r.tags.get("redrive/replay_of", "").split(",")]
    assert len(mine_requests) == 1, "the replay sensor did not request the user's run"
    request = mine_requests[0]
    replay = run(partition_key=request.partition_key, run_config=request.run_config,
                 tags={**request.tags, "dagster/run_key": request.run_key})
    assert replay.success and metadata(replay)["users_processed"] == 1

    # 4. fix the other and rerun the partition: it completes, closing the last dead letter
    _fix(ctx.engine, second_bad)
    last = run()
    assert last.success and metadata(last)["jobs_completed"] == 1
    after = _letters(ctx.engine, list(broken))
    assert {d.status for d in after.values()} == {"resolved"}, {k: d.status for k, d in after.items()}
    with ctx.engine.connect() as conn:
        done = conn.execute(sa.text("SELECT count(*) FROM matchmaking_jobs WHERE date = :d AND status = 'completed' "
                                    "AND user_id = ANY(CAST(:u AS uuid[]))"), {"d": PARTITION.date, "u": mine}).scalar()
    assert done == 400, done
    report.done = done
    report.notes.append("one fixed profile replayed with `dlq replay` (1 user run), the other by a partition rerun; "
                        "both dead letters resolved")
    return report


def _fix(engine: sa.Engine, user_id: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE matchmaking_users SET age_min = 18, age_max = 60, gender = 'x', "
                             "seeking = ARRAY['f', 'm', 'x'] WHERE id = :u"), {"u": user_id})


def _letters(engine: sa.Engine, users: list[str]) -> dict[str, deadletters.DeadLetter]:
    """The dead letters of these users in the demo's partition, whatever their status."""
    refs = {PARTITION.user_ref(u): u for u in users}
    with engine.connect() as conn:
        rows = conn.execute(sa.select(dead_letters).where(dead_letters.c.pipeline == PIPELINE,
                                                          dead_letters.c.entity_ref.in_(list(refs))))
        return {refs[r.entity_ref]: deadletters.DeadLetter.from_row(r) for r in rows}
