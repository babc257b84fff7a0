"""ADR-0004 "Failure Handling" through the real components: PostgreSQL errors, the sandbox store, the core.

Transient DB errors are real SQLSTATEs raised by PostgreSQL (a test trigger), the scoring artifact
comes from the sandbox over HTTP, dead letters and alerts go through the core to the sandbox's Slack.
"""

from __future__ import annotations

import json

import dagster as dg
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from assets.matchmaking import batch, policy
from assets.matchmaking.batch import Knobs, PartitionRun
from assets.matchmaking.policy import BUILTIN_WEIGHTS, Partition
from orchestration.cli import app
from redrive.reliability import Reliability
from redrive.stages import DEAD_LETTERED_TAG
from tests.dagster_helpers import launch, tick
from tests.matchmaking.conftest import DAY, KEY, TZ, dead_letters, jobs, offers, run, wait_for

PARTITION = Partition.parse(DAY, TZ)


def cli(db_url: str, *args: str):
    return CliRunner().invoke(app, list(args), env={"DATABASE_URL": db_url}, catch_exceptions=False)


def fail_completion_of(engine: sa.Engine, user_id: str, times: int, sqlstate: str = "40001") -> None:
    """PostgreSQL raises `sqlstate` the next `times` times this user's job is marked completed."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SEQUENCE IF NOT EXISTS mm_fault_{sqlstate}"))
        conn.execute(sa.text(f"""
            CREATE OR REPLACE FUNCTION mm_fault() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
              IF nextval('mm_fault_{sqlstate}') <= {times} THEN
                RAISE EXCEPTION 'injected fault' USING ERRCODE = '{sqlstate}';
              END IF;
              RETURN NEW;
            END $$"""))
        conn.execute(sa.text(f"""
            CREATE TRIGGER mm_fault BEFORE UPDATE ON matchmaking_jobs FOR EACH ROW
            WHEN (NEW.status = 'completed' AND NEW.user_id = '{user_id}'::uuid) EXECUTE FUNCTION mm_fault()"""))


def heal(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER IF EXISTS mm_fault ON matchmaking_jobs"))


def break_profile(engine: sa.Engine, user_id: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE matchmaking_users SET age_min = 40, age_max = 30 WHERE id = :u"), {"u": user_id})


def fix_profile(engine: sa.Engine, user_id: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE matchmaking_users SET age_min = 18, age_max = 60 WHERE id = :u"), {"u": user_id})


def alerts(engine: sa.Engine) -> list[tuple[str, str | None]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT kind, entity_ref FROM alerts ORDER BY id"))]


def test_inconsistent_profile_is_dead_lettered_once_and_the_rerun_redoes_only_it(mm_defs, instance, engine,
                                                                                sandbox, population) -> None:
    """A data inconsistency: not retried, job failed, one dead letter and alert; the partition run fails and its
    reruns touch only that user — still failing without a new alert, then completing once the profile is fixed."""
    rows = population(20)
    bad = rows[7]["id"]
    break_profile(engine, bad)

    first = run(mm_defs, instance)
    assert not first.success
    assert instance.get_run_by_id(first.run_id).tags.get(DEAD_LETTERED_TAG) == "true"
    done = jobs(engine)
    assert done[bad].status == "failed" and done[bad].retry_count == 0
    assert done[bad].error_message.startswith("DATA_INCONSISTENCY: profile invalid: age range")
    assert sum(j.status == "completed" for j in done.values()) == 19
    [letter] = dead_letters(engine)
    assert (letter.error_class, letter.stage, letter.entity_ref, letter.attempts, letter.retryable) == (
        "DATA_INCONSISTENCY", "validate", f"{DAY}:{TZ}:{bad}", 1, False)
    assert alerts(engine) == [("dead_letter", f"{DAY}:{TZ}:{bad}"), ("failure_rate", f"{DAY}:{TZ}")]
    assert sandbox.count("slack.message") == 2
    checks = {e.check_name: e.passed for e in first.get_asset_check_evaluations()}
    assert checks == {"zero_duplicate_offers": True, "completion_rate_at_least_99_9_percent": False}
    failure = first.failure_data_for_node("daily_match_offers")
    assert "1 users failed for good" in failure.error.message and "Traceback" not in failure.error.message
    completed = {u: j for u, j in done.items() if j.status == "completed"}
    before_offers = offers(engine)

    again = run(mm_defs, instance)
    assert not again.success
    [letter] = dead_letters(engine)
    assert letter.occurrences == 2 and letter.status == "open"
    assert sandbox.count("slack.message") == 2 and len(alerts(engine)) == 2
    assert jobs(engine)[bad].retry_count == 1

    fix_profile(engine, bad)
    fixed = run(mm_defs, instance)
    assert fixed.success
    after = jobs(engine)
    assert after[bad].status == "completed" and after[bad].error_message is None
    assert {u: after[u] for u in completed} == completed  # nobody else recomputed
    assert set(before_offers) <= set(offers(engine))
    [letter] = dead_letters(engine)
    assert letter.status == "resolved"
    assert fixed.asset_materializations_for_node("daily_match_offers")[0].metadata[
        "dead_letters_closed"].value == 1


def test_redrive_dlq_replay_redoes_just_that_user(mm_defs, instance, engine, sandbox, population, db_url) -> None:
    """`redrive dlq replay` of a user's dead letter starts the partition's run for that user alone and closes it."""
    rows = population(12)
    bad = rows[3]["id"]
    break_profile(engine, bad)
    assert not run(mm_defs, instance).success
    others = {u: j for u, j in jobs(engine).items() if u != bad}
    [letter] = dead_letters(engine)

    fix_profile(engine, bad)
    out = cli(db_url, "dlq", "replay", str(letter.id), "--note", "SUP-7: profile corrected", "--confirm-safe")
    assert out.exit_code == 0, out.output
    [request] = tick(mm_defs, instance, "redrive_dead_letter_replays")
    assert request.partition_key == KEY
    assert request.run_key.startswith(f"matchmaking:replay-batch:{KEY}:")  # one run for the partition's replays
    assert request.run_config["ops"]["daily_match_offers"]["config"]["user_ids"] == [bad]
    result = launch(mm_defs, instance, request)
    assert result.success
    meta = result.asset_materializations_for_node("daily_match_offers")[0].metadata
    assert meta["users_processed"].value == 1 and meta["jobs_completed"].value == 1
    after = jobs(engine)
    assert after[bad].status == "completed" and after[bad].retry_count == 1
    assert {u: after[u] for u in others} == others
    shown = json.loads(cli(db_url, "dlq", "show", str(letter.id), "--json").output)
    assert shown["status"] == "resolved"
    assert [n["kind"] for n in shown["notes"]] == ["dead_lettered", "replay_requested", "replay_succeeded"]
    assert tick(mm_defs, instance, "redrive_dead_letter_replays") == []


def test_logic_error_in_scoring_is_not_retried_and_stays_with_its_user(mm_defs, instance, engine, sandbox,
                                                                       population, monkeypatch) -> None:
    """A scoring bug for one user (an out-of-range score, or an exception) fails that user alone as LOGIC_ERROR,
    after one attempt; everyone else in the chunk completes."""
    rows = population(16, regions=1)
    victim, crasher = rows[2]["id"], rows[9]["id"]
    real = policy.compute_offers

    def buggy(pool, targets, **kw):
        index = pool.index()
        if index[crasher] in list(targets):
            raise TypeError("unsupported operand")  # a bug that only this user's data reaches
        got = real(pool, targets, **kw)
        got.score[got.user == index[victim]] = 2 * policy.SCORE_SCALE
        return got

    monkeypatch.setattr(policy, "compute_offers", buggy)
    result = run(mm_defs, instance)
    assert not result.success
    letters = {r.entity_ref.rsplit(":", 1)[1]: r for r in dead_letters(engine)}
    assert set(letters) == {victim, crasher}
    assert {(r.error_class, r.stage, r.attempts) for r in letters.values()} == {("LOGIC_ERROR", "score", 1)}
    assert "score outside [0, 1]" in letters[victim].error_message
    assert "TypeError" in letters[crasher].error_message and "unsupported operand" not in letters[crasher].error_message
    done = jobs(engine)
    assert sum(j.status == "completed" for j in done.values()) == 14
    assert all(j.retry_count == 0 for j in done.values())
    meta = result.failure_data_for_node("daily_match_offers").user_failure_data.metadata
    assert meta["retries"].value == 0 and meta["failures_by_code"].value == {"LOGIC_ERROR": 2}


def test_transient_db_errors_are_retried_at_30s_2min_then_succeed(engine, population) -> None:
    """A serialization failure twice: the chunk is retried after 30 s and 2 min (× time_scale), then written once."""
    rows = population(10)
    fail_completion_of(engine, rows[0]["id"], times=2)
    runtime = Reliability(engine=engine, time_scale=0.001)
    sleeps: list[float] = []
    pool = batch.load_pool(engine, PARTITION)
    outcome = PartitionRun(runtime, PARTITION, Knobs(), BUILTIN_WEIGHTS, sleep=sleeps.append).run(pool)
    assert sleeps == pytest.approx([0.030, 0.120])
    assert outcome.retries == 2 and outcome.completed == 10 and outcome.failed == {}
    assert {j.status for j in jobs(engine).values()} == {"completed"}
    assert dead_letters(engine) == []


def test_transient_db_errors_past_the_budget_dead_letter_each_user_of_the_chunk(mm_defs, instance, engine, sandbox,
                                                                                population) -> None:
    """A deadlock that never clears: 4 attempts (30 s, 2 min, 5 min scaled), then the chunk's users each get one
    TRANSIENT_DB_ERROR dead letter; other chunks complete; the burst of alerts reaches Slack as one message."""
    rows = population(20)
    pool = batch.load_pool(engine, PARTITION)
    first_chunk = [str(u) for u in pool.ids[:8]]  # CHUNK = 8, in pool order
    fail_completion_of(engine, first_chunk[0], times=1000, sqlstate="40P01")

    result = run(mm_defs, instance)
    assert not result.success
    letters = dead_letters(engine)
    assert sorted(r.entity_ref.rsplit(":", 1)[1] for r in letters) == sorted(first_chunk)
    assert {(r.error_class, r.stage, r.attempts, r.retryable) for r in letters} == {
        ("TRANSIENT_DB_ERROR", "write", 4, True)}
    done = jobs(engine)
    assert {u for u, j in done.items() if j.status == "failed"} == set(first_chunk)
    assert sum(j.status == "completed" for j in done.values()) == 12
    meta = result.failure_data_for_node("daily_match_offers").user_failure_data.metadata
    assert meta["retries"].value == 3
    assert [k for k, _ in alerts(engine)].count("dead_letter") == 8
    assert sandbox.count("slack.message") == 2  # the first dead letter + the failure-rate alert; 7 held for the burst

    heal(engine)
    assert run(mm_defs, instance).success
    assert {r.status for r in dead_letters(engine)} == {"resolved"}
    assert len(rows) == sum(j.status == "completed" for j in jobs(engine).values())


def test_candidate_deleted_mid_run_fails_only_the_users_offered_them(mm_defs, instance, engine, sandbox,
                                                                     population, monkeypatch) -> None:
    """A candidate deleted between scoring and writing: the chunk's insert hits the foreign key, the chunk is split,
    and only users whose offers named that candidate fail (DATA_INCONSISTENCY); a rerun completes them."""
    population(24, regions=2)
    pool = batch.load_pool(engine, PARTITION)
    everyone = policy.compute_offers(pool, range(len(pool)), day=PARTITION.date, seed="yoked-matchmaking",
                                     weights=BUILTIN_WEIGHTS, k=3)
    gone_row = int(everyone.candidate[0])  # a candidate of a user of the first chunk
    gone = str(pool.ids[gone_row])
    admirers = {str(pool.ids[u]) for u in everyone.user[everyone.candidate == gone_row].tolist()}
    real = policy.compute_offers

    def then_delete(*args, **kw):
        got = real(*args, **kw)
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM matchmaking_users WHERE id = :u"), {"u": gone})
        return got

    monkeypatch.setattr(policy, "compute_offers", then_delete)
    assert not run(mm_defs, instance).success
    letters = dead_letters(engine)
    assert {r.entity_ref.rsplit(":", 1)[1] for r in letters} == admirers - {gone}
    assert {(r.error_class, r.stage) for r in letters} == {("DATA_INCONSISTENCY", "write")}
    assert gone not in jobs(engine)

    monkeypatch.setattr(policy, "compute_offers", real)
    assert run(mm_defs, instance).success
    assert {r.status for r in dead_letters(engine)} == {"resolved"}
    assert {j.status for j in jobs(engine).values()} == {"completed"}


@pytest.fixture
def store_defs(scaled_settings, mm_env, monkeypatch, sandbox):
    """The code location with the scoring weights read from the sandbox store, and a 0.3 s HTTP timeout."""
    from orchestration.definitions import build_definitions

    monkeypatch.setenv("MATCHMAKING_SCORING_PATH", "matchmaking/scoring/w-7.json")
    return build_definitions(scaled_settings.model_copy(update={"http_timeout_seconds": 0.3}))


WEIGHTS = json.dumps({"version": "w-7", "interests": 0.6, "age": 0.1, "distance": 0.25, "variety": 0.05}).encode()


def test_scoring_store_timeouts_are_retried_and_the_weights_version_is_stored(store_defs, instance, engine, sandbox,
                                                                              population) -> None:
    """The store answering 503 then timing out: the step is retried (TIMEOUT, 30 s then 2 min scaled); the offers
    carry the artifact's version."""
    population(10)
    sandbox.put_store("matchmaking/scoring/w-7.json", WEIGHTS, "application/json")
    sandbox.script("store", {"status": 503}, {"kind": "timeout", "seconds": 2})
    result = run(store_defs, instance)
    assert result.success
    assert [r["step"] for r in sandbox.requests("store")][:2] == ["status:503", "timeout"]
    retries = instance.get_records_for_run(result.run_id, of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY).records
    assert len(retries) == 2
    with engine.connect() as conn:
        versions = set(conn.execute(sa.text("SELECT DISTINCT algorithm_version FROM matchmaking_offers")).scalars())
    assert versions == {"mm-score-1/w-7"}
    assert dead_letters(engine) == []


def test_malformed_weights_dead_letter_the_partition_until_replayed(store_defs, instance, engine, sandbox, population,
                                                                   db_url) -> None:
    """Unreadable weights are a data inconsistency of the partition: no retry, no job touched, one dead letter
    `{date}:{tz}` and one alert; replayed after the artifact is fixed, the partition completes and the letter closes."""
    population(10)
    sandbox.put_store("matchmaking/scoring/w-7.json", b'{"version": "w-7", "interests": ', "application/json")
    result = run(store_defs, instance)
    assert not result.success
    assert instance.get_run_by_id(result.run_id).tags.get(DEAD_LETTERED_TAG) == "true"
    [letter] = dead_letters(engine)
    assert (letter.entity_ref, letter.stage, letter.error_class, letter.attempts) == (
        f"{DAY}:{TZ}", "load_scoring", "DATA_INCONSISTENCY", 1)
    assert jobs(engine) == {} and sandbox.count("slack.message") == 1

    sandbox.put_store("matchmaking/scoring/w-7.json", WEIGHTS, "application/json")
    assert cli(db_url, "dlq", "replay", str(letter.id), "--note", "DS-3: artifact republished",
               "--confirm-safe").exit_code == 0
    [request] = tick(store_defs, instance, "redrive_dead_letter_replays")
    assert request.partition_key == KEY and request.run_config["ops"]["daily_match_offers"]["config"]["user_ids"] == []
    assert launch(store_defs, instance, request).success
    assert {j.status for j in jobs(engine).values()} == {"completed"} and len(jobs(engine)) == 10
    assert [r.status for r in dead_letters(engine)] == ["resolved"]


def test_a_stray_offer_fails_the_duplicate_check_and_alerts(mm_defs, instance, engine, sandbox, population) -> None:
    """An offer outside a user's recorded set (written around the pipeline) fails the check and alerts, once."""
    rows = population(12, regions=1)
    assert run(mm_defs, instance).success
    done = jobs(engine)
    user = rows[0]["id"]
    offered = {o["candidate_id"] for o in done[user].offers}
    stranger = next(r["id"] for r in rows if r["id"] != user and r["id"] not in offered)
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO matchmaking_offers (id, date, timezone, user_id, candidate_id, rank, compatibility_score, "
            "algorithm_version, offered_at, expires_at) VALUES (gen_random_uuid(), :d, :tz, :u, :c, 9, 0.1, 'manual', "
            "'2026-03-08 13:00Z', '2026-03-09 13:00Z')"), {"d": DAY, "tz": TZ, "u": user, "c": stranger})
    result = run(mm_defs, instance)
    assert result.success
    [check] = [e for e in result.get_asset_check_evaluations() if e.check_name == "zero_duplicate_offers"]
    assert not check.passed and check.metadata["duplicate_offers"].value == 1
    assert ("duplicate_offers", f"{DAY}:{TZ}") in alerts(engine)
    run(mm_defs, instance)
    assert alerts(engine).count(("duplicate_offers", f"{DAY}:{TZ}")) == 1


def test_bad_user_ids_in_run_config_are_refused_before_anything_is_written(mm_defs, instance, engine,
                                                                           population) -> None:
    """A replay config naming a non-UUID user fails with a one-line reason and writes nothing."""
    population(5)
    result = run(mm_defs, instance, config={"user_ids": ["42; DROP TABLE users"]})
    assert not result.success
    assert "user_ids: '42; DROP TABLE users' is not a UUID" in result.failure_data_for_node(
        "daily_match_offers").error.message
    assert jobs(engine) == {} and dead_letters(engine) == []


def test_a_long_store_backoff_becomes_a_durable_timer_and_its_run_completes(scaled_settings, mm_env, monkeypatch,
                                                                             instance, engine, sandbox,
                                                                             population) -> None:
    """With waits over the durable threshold, a store 503 leaves the run as a timer; the timer's run (partition,
    attempt 2) completes the partition and consumes it."""
    from orchestration.definitions import build_definitions

    monkeypatch.setenv("MATCHMAKING_SCORING_PATH", "matchmaking/scoring/w-7.json")
    defs = build_definitions(scaled_settings.model_copy(update={"redrive_durable_wait_threshold_seconds": 1.0}))
    population(6)
    sandbox.put_store("matchmaking/scoring/w-7.json", WEIGHTS, "application/json")
    sandbox.script("store", {"status": 503})
    first = run(defs, instance)
    assert not first.success and jobs(engine) == {} and dead_letters(engine) == []
    assert instance.get_run_by_id(first.run_id).tags.get("redrive/deferred") == "true"
    with engine.connect() as conn:
        [timer] = conn.execute(sa.text("SELECT entity_ref, attempt, status FROM deferred_attempts")).all()
    assert tuple(timer) == (f"{DAY}:{TZ}", 2, "waiting")

    # due 30 ms (30 s × time_scale) after the failure, by the real clock the sensor reads
    wait_for(lambda: bool(tick(defs, instance, "matchmaking_deferred_retries")), what="the timer", timeout=10)
    [request] = tick(defs, instance, "matchmaking_deferred_retries")
    assert request.partition_key == KEY and request.run_key == f"matchmaking:run:{DAY}:{TZ}:attempt-2"
    assert launch(defs, instance, request).success
    assert len(jobs(engine)) == 6
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT status FROM deferred_attempts")).scalar() == "requested"
