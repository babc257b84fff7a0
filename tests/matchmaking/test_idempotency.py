"""ADR-0004 idempotency through Dagster and real PostgreSQL: reruns, races between processes, a SIGKILL."""

from __future__ import annotations

import os
import signal
from datetime import UTC, datetime

import sqlalchemy as sa

from assets.matchmaking import batch, policy
from assets.matchmaking.policy import BUILTIN_WEIGHTS, Partition
from tests.matchmaking.conftest import (
    DAY,
    TZ,
    dead_letters,
    jobs,
    offers,
    run,
    start_partition_process,
    wait_for,
)


def expected_offers(engine: sa.Engine, k: int = 3) -> dict[str, list[tuple[str, int]]]:
    """What the policy says each user of the partition gets: {user: [(candidate, rank)]}."""
    partition = Partition.parse(DAY, TZ)
    pool = batch.load_pool(engine, partition)
    got = policy.compute_offers(pool, [i for i in range(len(pool)) if pool.valid[i]], day=partition.date,
                                seed="yoked-matchmaking", weights=BUILTIN_WEIGHTS, k=k)
    out: dict[str, list[tuple[str, int]]] = {str(pool.ids[i]): [] for i in range(len(pool)) if pool.valid[i]}
    for u, c, r in zip(got.user.tolist(), got.candidate.tolist(), got.rank.tolist(), strict=True):
        out[str(pool.ids[u])].append((str(pool.ids[c]), r))
    return out


def offers_by_user(engine: sa.Engine) -> dict[str, list[tuple[str, int]]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT user_id::text, candidate_id::text, rank FROM matchmaking_offers "
                                    "ORDER BY user_id, rank"))
        out: dict[str, list[tuple[str, int]]] = {}
        for u, c, r in rows:
            out.setdefault(u, []).append((c, r))
    return out


def test_a_partition_gives_every_user_their_offers_dated_by_the_partition(mm_defs, instance, engine,
                                                                          population) -> None:
    """One run: every user completed with exactly the policy's offers, offered at local 9:00 (13:00 UTC that day)."""
    rows = population(30)
    result = run(mm_defs, instance)
    assert result.success
    expected = expected_offers(engine)
    got = offers_by_user(engine)
    assert {u: v for u, v in expected.items() if v} == got
    done = jobs(engine)
    assert len(done) == 30 and {j.status for j in done.values()} == {"completed"}
    assert all(j.retry_count == 0 and j.error_message is None for j in done.values())
    with engine.connect() as conn:
        windows = set(conn.execute(sa.text("SELECT DISTINCT offered_at, expires_at, algorithm_version, timezone "
                                           "FROM matchmaking_offers")))
    assert windows == {(datetime(2026, 3, 8, 13, tzinfo=UTC), datetime(2026, 3, 9, 13, tzinfo=UTC),
                        "mm-score-1/builtin-1", TZ)}
    # the job's offers document is the same set as the offer rows
    some = rows[0]["id"]
    assert [(o["candidate_id"], o["rank"]) for o in done[some].offers] == got.get(some, [])
    [mat] = result.asset_materializations_for_node("daily_match_offers")
    meta = {k: v.value for k, v in mat.metadata.items()}
    assert meta["users_processed"] == 30 and meta["jobs_completed"] == 30 and meta["jobs_failed"] == 0
    assert meta["offers_written"] == sum(len(v) for v in got.values()) and meta["duplicate_offers"] == 0
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {"zero_duplicate_offers": True, "completion_rate_at_least_99_9_percent": True}


def test_materializing_twice_leaves_the_same_rows_and_recomputes_nobody(mm_defs, instance, engine,
                                                                        population) -> None:
    """The second run returns completed users as they are: same offer rows, same completed_at, no retry counted."""
    population(25)
    assert run(mm_defs, instance).success
    first_offers, first_jobs = offers(engine), jobs(engine)
    second = run(mm_defs, instance)
    assert second.success
    assert offers(engine) == first_offers
    assert jobs(engine) == first_jobs  # every column, completed_at and retry_count included
    [mat] = second.asset_materializations_for_node("daily_match_offers")
    assert mat.metadata["jobs_already_completed"].value == 25 and mat.metadata["users_processed"].value == 0


def test_two_processes_materializing_at_once_write_one_set(mm_defs, instance, engine, population, db_url,
                                                           tmp_path) -> None:
    """Two concurrent runs of one partition (separate processes) leave exactly the single run's rows, no duplicate."""
    population(48)
    assert run(mm_defs, instance).success
    reference = offers(engine)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM matchmaking_jobs"))  # offers go with their jobs (ON DELETE CASCADE)
    assert offers(engine) == []

    go = tmp_path / "go"
    slow = {"MATCHMAKING_CHUNK_SIZE": "4", "MATCHMAKING_BATCH_PAUSE_SECONDS": "0.05"}
    procs = [start_partition_process(db_url, tmp_path / f"child-{i}.log", go_file=go, **slow) for i in range(2)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    go.touch()
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [(tmp_path / f"child-{i}.log").read_text()[-2000:] for i in (0, 1)]
    spans = []
    for out, _ in outputs:
        lines = dict(line.split(" ", 1) for line in out.strip().splitlines() if " " in line)
        spans.append((float(lines["started"]), float(lines["ended"].split()[0])))
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], "the two runs did not overlap"

    assert offers(engine) == reference
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM matchmaking_jobs WHERE status = 'completed'")).scalar() == 48
        per_user = conn.execute(sa.text("SELECT max(n) FROM (SELECT count(*) n FROM matchmaking_offers "
                                        "GROUP BY date, user_id, candidate_id) x")).scalar()
    assert per_user == 1


def test_sigkill_mid_partition_then_rerun_completes_the_rest_once(mm_defs, instance, engine, db_url,
                                                                  tmp_path) -> None:
    """Killed while a chunk is claimed but unwritten: the rerun redoes that chunk and the untouched users only.

    Regions are laid out so the fifth chunk's users all want one candidate whose row the test locks: the
    child blocks writing chunk 5 (chunks 1–4 done, chunk 5 `running`, the last user untouched) and is
    killed there with SIGKILL.
    """
    from assets.matchmaking import synthetic

    people = synthetic.users(20, timezone=TZ, tag="kill", regions=2)  # regions "kill-metro-0/1": chunks 1-4
    admirers = [{**people[0], "id": f"ffffffff-0000-0000-0000-00000000000{i}", "region": "zz", "gender": "x",
                 "seeking": ["f", "m", "x"], "age_min": 18, "age_max": 99, "latitude": 40.0, "longitude": -74.0,
                 "max_distance_km": 100, "interests": [i, 10 + i]} for i in range(1, 6)]
    # shares a tag with every admirer (who share none among themselves): everyone's first choice
    star = {**admirers[0], "id": "ffffffff-ffff-ffff-ffff-ffffffffffff", "interests": [1, 2, 3, 4, 5]}
    with engine.begin() as conn:
        synthetic.insert(conn, [*people, *admirers, star])

    with engine.connect() as holder:
        tx = holder.begin()
        holder.execute(sa.text("SELECT 1 FROM matchmaking_users WHERE id = :s FOR UPDATE"), {"s": star["id"]})
        child = start_partition_process(db_url, tmp_path / "child.log", MATCHMAKING_CHUNK_SIZE="5",
                                        MATCHMAKING_LOCK_TIMEOUT_MS="120000")

        def blocked() -> bool:
            with engine.connect() as conn:
                return bool(conn.execute(sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'")).scalar())

        wait_for(blocked, what="the child to block on the locked candidate")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        tx.rollback()
    assert child.returncode == -signal.SIGKILL

    before = jobs(engine)
    statuses = sorted(j.status for j in before.values())
    assert statuses == ["completed"] * 20 + ["running"] * 5, statuses
    assert star["id"] not in before
    completed_before = {u: j for u, j in before.items() if j.status == "completed"}
    offers_before = {o for o in offers(engine)}

    result = run(mm_defs, instance)
    assert result.success
    after = jobs(engine)
    assert len(after) == 26 and {j.status for j in after.values()} == {"completed"}
    for user, job in completed_before.items():
        assert after[user] == job  # not recomputed: started_at, completed_at, offers, retry_count unchanged
    assert {a["id"]: after[a["id"]].retry_count for a in admirers} == {a["id"]: 1 for a in admirers}
    assert after[star["id"]].retry_count == 0
    assert offers_before <= set(offers(engine))
    assert offers_by_user(engine) == {u: v for u, v in expected_offers(engine).items() if v}
    assert dead_letters(engine) == []
    [mat] = result.asset_materializations_for_node("daily_match_offers")
    assert mat.metadata["users_processed"].value == 6 and mat.metadata["jobs_already_completed"].value == 20
