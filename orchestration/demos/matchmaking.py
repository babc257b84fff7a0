"""Matchmaking demo: one (date, timezone) partition of 400 fresh users, with the scoring weights read from
the sandbox store while it answers 503 and then times out (retried), two users whose profiles are
inconsistent (dead-lettered and alerted once each), a rerun that touches only them, a `dlq replay` of one
after its fix and a plain rerun for the other."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from assets.matchmaking import synthetic
from assets.matchmaking.pipeline import ASSET, JOB, PIPELINE
from assets.matchmaking.policy import Partition
from redrive import deadletters
from redrive.clock import SystemClock
from redrive.schema import dead_letters

PARTITION = Partition.parse("2026-03-08", "America/New_York")  # the night US clocks spring forward
KEY = f"{PARTITION.date.isoformat()}|{PARTITION.timezone}"
WEIGHTS_PATH = "matchmaking/scoring/demo-1.json"
WEIGHTS = {"version": "demo-1", "interests": 0.55, "age": 0.15, "distance": 0.25, "variety": 0.05}
# As an operator who publishes scoring weights to the artifact store configures the code location.
DEPLOYMENT_ENV = {"MATCHMAKING_SCORING_PATH": WEIGHTS_PATH}
THROUGH_DAEMON = True  # its runs go through the run queue, its replay through the daemon's replay sensor


def run_demo(ctx):  # -> orchestration.demo.DemoReport
    from orchestration.demo import DemoReport

    report = DemoReport(PIPELINE)

    def run(**kwargs: Any):  # -> the context's run outcome
        return ctx.run(JOB, partition_key=kwargs.pop("partition_key", KEY), **kwargs)

    def metadata(result) -> dict[str, Any]:
        """The asset's counts: its materialization's metadata, or its failure's (a run failed on purpose)."""
        return ctx.metadata_of(result, ASSET)

    _repair_leftovers(ctx.engine)
    ctx.sandbox.put_store(WEIGHTS_PATH, json.dumps(WEIGHTS).encode(), "application/json")
    tag = f"demo-{ctx.session}"
    people = synthetic.users(400, timezone=PARTITION.timezone, tag=tag, regions=4)
    broken = {people[17]["id"]: {"age_min": 45, "age_max": 30}, people[211]["id"]: {"gender": None}}
    with ctx.engine.begin() as conn:
        synthetic.insert(conn, [{**p, **broken.get(p["id"], {})} for p in people])
    mine = [p["id"] for p in people]

    # 1. the store answers 503, then holds the request and answers 504: both retried (TIMEOUT, 30 s / 2 min × scale)
    ctx.sandbox.script("store", {"status": 503}, {"kind": "timeout", "seconds": 1}, match=WEIGHTS_PATH)
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
    replays = [r for r in ctx.tick("redrive_dead_letter_replays")  # (other pipelines' letters may replay too)
               if str(letters[first_bad].id) in r.dagster_run.tags.get("redrive/replay_of", "").split(",")]
    assert len(replays) == 1, "the replay sensor did not start the user's run"
    [replay] = replays
    # it completes that user, and still ends failed: the other user is dead-lettered, so the partition stays red
    replayed = metadata(replay)
    assert not replay.success and replayed["users_processed"] == 1 and replayed["jobs_completed"] == 1, replayed
    assert replayed["users_dead_lettered"] == 1, replayed

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
    report.notes.append("one fixed profile replayed with `dlq replay` (1 user run, failed on purpose while the other "
                        "is dead-lettered: the partition stays red), the other by a partition rerun (green); "
                        "both dead letters resolved")
    return report


def _repair_leftovers(engine: sa.Engine) -> None:
    """Profiles an interrupted earlier demo left broken in the partition are repaired first, so the dead letters
    this run counts are its own two (the rerun completes the others and resolves theirs)."""
    with engine.connect() as conn:
        left = conn.execute(sa.text("SELECT user_id FROM matchmaking_jobs WHERE date = :d AND timezone = :tz "
                                    "AND status <> 'completed'"), {"d": PARTITION.date, "tz": PARTITION.timezone})
        users = [str(u) for (u,) in left]
    for user in users:
        _fix(engine, user)


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
