"""Pure matchmaking policy: profiles, scoring, selection, ids and the partition clock (no database)."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from assets.matchmaking import policy
from assets.matchmaking.policy import BUILTIN_WEIGHTS, Partition, ScoringWeights

DAY = date(2026, 3, 8)


def frame(rows: list[dict]) -> pd.DataFrame:
    base = {"region": "r", "gender_bits": 1, "seeking_bits": 2, "seeking_unknown": False, "age": 30, "age_min": 25,
            "age_max": 35, "latitude": 40.0, "longitude": -74.0, "max_distance_km": 50, "interests_bits": 7,
            "interests_unknown": False}
    return pd.DataFrame([{**base, **r} for r in rows], columns=list(policy.POOL_COLUMNS))


def uid(i: int) -> str:
    return str(uuid.UUID(int=i + 1))


def random_frame(seed: int, n: int, regions: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        age = int(rng.integers(18, 60))
        rows.append({
            "id": str(uuid.UUID(bytes=rng.bytes(16))), "region": f"r{int(rng.integers(regions))}",
            "gender_bits": int(rng.choice([1, 2, 4])), "seeking_bits": int(rng.integers(1, 8)), "age": age,
            "age_min": max(18, age - int(rng.integers(0, 12))), "age_max": age + int(rng.integers(0, 12)),
            "latitude": 40 + float(rng.normal(0, 0.3)), "longitude": -74 + float(rng.normal(0, 0.3)),
            "max_distance_km": int(rng.choice([5, 20, 60, 200])),
            # few interest tags and identical ages make exact score ties common
            "interests_bits": int(rng.integers(0, 16)),
        })
    return frame(rows)


def as_tuples(pool: policy.Pool, offers: policy.Offers) -> list[tuple[str, str, int, int]]:
    columns = (offers.user.tolist(), offers.candidate.tolist(), offers.rank.tolist(), offers.score.tolist())
    out = [(str(pool.ids[u]), str(pool.ids[c]), r, s) for u, c, r, s in zip(*columns, strict=True)]
    return sorted(out)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 60), k=st.integers(1, 6),
       budget=st.sampled_from([1_000, 50, 7]))
def test_vectorized_offers_equal_the_per_user_reference(seed: int, n: int, k: int, budget: int) -> None:
    """The chunked NumPy scorer selects exactly what the plain-Python spec selects, tie-breaks included."""
    pool = policy.build_pool(random_frame(seed, n))
    weights = ScoringWeights(version="t", variety=0.0 if seed % 2 else 0.05)  # no variety: more ties
    targets = np.flatnonzero(pool.valid)
    got = policy.compute_offers(pool, targets, day=DAY, seed="s", weights=weights, k=k, pair_budget=budget)
    expected = sorted((str(pool.ids[u]), str(pool.ids[c]), r, s) for u in targets.tolist()
                      for c, r, s in policy.reference_offers(pool, u, day=DAY, seed="s", weights=weights, k=k))
    assert as_tuples(pool, got) == expected
    assert policy.offer_invariant_violations(pool, got, k) == {}


def test_ties_go_to_the_smaller_candidate_id() -> None:
    """Identical candidates score the same; the one with the smaller id ranks first, whatever the row order."""
    rows = [{"id": uid(0), "gender_bits": 2, "seeking_bits": 1}] + [{"id": uid(i)} for i in (5, 3, 9, 1)]
    for order in (rows, rows[::-1]):
        pool = policy.build_pool(frame(order))
        me = pool.index()[uid(0)]
        got = policy.compute_offers(pool, [me], day=DAY, seed="s", weights=ScoringWeights(version="t", variety=0),
                                    k=3)
        assert [str(pool.ids[c]) for c in got.candidate.tolist()] == [uid(1), uid(3), uid(5)]
        assert got.rank.tolist() == [1, 2, 3] and len(set(got.score.tolist())) == 1


def test_same_inputs_same_offers_and_the_seed_and_date_move_them() -> None:
    """Same pool, weights, seed and date → identical offers; the variety term changes them by date or seed."""
    pool = policy.build_pool(random_frame(11, 200, regions=1))
    targets = np.flatnonzero(pool.valid)

    def pick(day: date, seed: str) -> list:
        return as_tuples(pool, policy.compute_offers(pool, targets, day=day, seed=seed, weights=BUILTIN_WEIGHTS, k=3))

    assert pick(DAY, "a") == pick(DAY, "a")
    assert pick(DAY, "a") != pick(date(2026, 3, 9), "a")
    assert pick(DAY, "a") != pick(DAY, "b")
    shuffled = policy.build_pool(random_frame(11, 200, regions=1).sample(frac=1, random_state=3))
    assert as_tuples(shuffled, policy.compute_offers(shuffled, np.flatnonzero(shuffled.valid), day=DAY, seed="a",
                                                     weights=BUILTIN_WEIGHTS, k=3)) == pick(DAY, "a")


def test_eligibility_is_mutual() -> None:
    """One-sided interest, an age outside the other's range, or a distance beyond either reach: no offer."""
    me = {"id": uid(0), "gender_bits": 2, "seeking_bits": 1, "age": 30, "age_min": 25, "age_max": 35,
          "max_distance_km": 100}
    others = [
        {"id": uid(1)},  # f seeking m, 30, in range: eligible
        {"id": uid(2), "seeking_bits": 1},  # f seeking f: not interested in me
        {"id": uid(3), "age": 40, "age_min": 35, "age_max": 45},  # outside my range
        {"id": uid(4), "age_min": 31, "age_max": 40},  # I am outside theirs
        {"id": uid(5), "latitude": 40.5, "max_distance_km": 10},  # ~55 km: beyond their 10 km
        {"id": uid(6), "region": "elsewhere"},  # other region
    ]
    pool = policy.build_pool(frame([me, *others]))
    got = policy.compute_offers(pool, [pool.index()[uid(0)]], day=DAY, seed="s", weights=BUILTIN_WEIGHTS, k=10)
    assert [str(pool.ids[c]) for c in got.candidate.tolist()] == [uid(1)]


@pytest.mark.parametrize(("change", "why"), [
    ({"gender_bits": 0}, "gender"),
    ({"seeking_bits": 0}, "seeking"),
    ({"seeking_unknown": True}, "seeking"),
    ({"age": None}, "birth_date"),
    ({"age": 17}, "under 18"),
    ({"age": 130}, "implausible"),
    ({"age_min": 40, "age_max": 30}, "age range"),
    ({"age_min": 16}, "age range"),
    ({"latitude": 91.0}, "latitude"),
    ({"longitude": float("nan")}, "latitude"),
    ({"max_distance_km": 0}, "max_distance_km"),
    ({"region": None}, "region"),
    ({"interests_unknown": True}, "interest"),
])
def test_inconsistent_profiles_are_named_and_never_matched(change: dict, why: str) -> None:
    """Each broken profile rule is reported by field name (no values) and the user is neither offered nor scored."""
    pool = policy.build_pool(frame([{"id": uid(0), "gender_bits": 2, "seeking_bits": 1}, {"id": uid(1), **change}]))
    bad = pool.index()[uid(1)]
    assert not pool.valid[bad] and why in pool.problems[bad]
    assert "40" not in pool.problems[bad] and "91" not in pool.problems[bad]
    got = policy.compute_offers(pool, [pool.index()[uid(0)]], day=DAY, seed="s", weights=BUILTIN_WEIGHTS, k=3)
    assert len(got) == 0
    with pytest.raises(ValueError, match="invalid profiles"):
        policy.compute_offers(pool, [bad], day=DAY, seed="s", weights=BUILTIN_WEIGHTS, k=3)


def test_invariant_check_names_each_broken_user() -> None:
    """Offers that are out of range, to oneself, repeated or over the count are a logic error per user."""
    pool = policy.build_pool(frame([{"id": uid(i), "seeking_bits": 1} for i in range(6)]))
    good = policy.Offers(*(np.array(v) for v in ([0, 0], [1, 2], [1, 2], [900_000, 800_000])))
    assert policy.offer_invariant_violations(pool, good, 3) == {}
    cases = {
        "score outside": ([1], [2], [1], [1_000_001]),
        "themself": ([1], [1], [1], [5]),
        "same candidate": ([1, 1], [2, 2], [1, 2], [5, 5]),
        "more than": ([1, 1, 1], [2, 3, 4], [1, 2, 3], [5, 5, 5]),
        "ranks": ([1], [2], [2], [5]),
        "decrease": ([1, 1], [2, 3], [1, 2], [5, 9]),
    }
    for why, arrays in cases.items():
        bad = policy.Offers(*(np.array(v) for v in arrays))
        k = 2 if why == "more than" else 3
        found = policy.offer_invariant_violations(pool, policy.Offers.concat([good, bad]), k)
        assert set(found) == {1} and why in found[1], (why, found)


def test_offer_ids_are_uuid5_of_date_user_candidate_under_a_fixed_namespace() -> None:
    """The ADR's generateDeterministicId, pinned: changing the namespace or the input would change every id."""
    oid = policy.offer_id(DAY, uid(1), uid(2))
    assert oid == str(uuid.uuid5(policy.NAMESPACE, f"2026-03-08:{uid(1)}:{uid(2)}"))
    assert oid == "cee4f6f9-d4d0-5417-a681-a5694eadd9a2"
    assert policy.offer_id(DAY, uid(2), uid(1)) != oid
    for i in range(200):  # the fast path is uuid.uuid5 exactly
        user, cand = str(uuid.uuid4()), str(uuid.uuid4())
        assert policy.offer_id(DAY, user, cand) == str(uuid.uuid5(policy.NAMESPACE, f"2026-03-08:{user}:{cand}"))


@pytest.mark.parametrize(("day", "tz", "offered", "expires"), [
    ("2026-03-07", "America/New_York", "2026-03-07T14:00", "2026-03-08T13:00"),  # 23 h: clocks spring forward
    ("2026-03-08", "America/New_York", "2026-03-08T13:00", "2026-03-09T13:00"),
    ("2026-10-31", "America/New_York", "2026-10-31T13:00", "2026-11-01T14:00"),  # 25 h: clocks fall back
    ("2026-03-28", "Europe/Berlin", "2026-03-28T08:00", "2026-03-29T07:00"),
    ("2026-10-25", "Europe/Berlin", "2026-10-25T08:00", "2026-10-26T08:00"),
    ("2026-06-01", "Asia/Kolkata", "2026-06-01T03:30", "2026-06-02T03:30"),
])
def test_offer_window_is_local_9am_of_the_partition_in_utc(day: str, tz: str, offered: str, expires: str) -> None:
    """offered_at/expires_at come from the partition (local 9:00 → next local 9:00), DST included — never now()."""
    got = Partition.parse(day, tz).offer_window(9)
    assert got == (datetime.fromisoformat(offered).replace(tzinfo=UTC),
                   datetime.fromisoformat(expires).replace(tzinfo=UTC))


def test_entity_refs_round_trip_and_bad_ones_are_refused() -> None:
    """`{date}:{tz}` and `{date}:{tz}:{user}` parse back; anything else is a clear ValueError."""
    p = Partition.parse("2026-03-08", "America/Argentina/Buenos_Aires")
    assert policy.parse_entity_ref(p.entity_ref) == (p, None)
    assert policy.parse_entity_ref(p.user_ref(uid(3))) == (p, uid(3))
    # a failed partition run's letter carries Dagster's key (the chaos run's declined retries): replayable too
    assert policy.parse_entity_ref("2026-03-08|America/Argentina/Buenos_Aires") == (p, None)
    for bad in ("2026-03-08", "2026-13-01:UTC", "2026-03-08:Mars/Base", "2026-03-08:UTC:nope", "a:b:c:d",
                "2026-03-08|UTC|x"):
        with pytest.raises(ValueError):
            policy.parse_entity_ref(bad)


def test_weights_artifact_is_validated() -> None:
    """Weights summing over 1, negative, unknown fields or a bad version are refused; valid ones carry their version."""
    assert policy.parse_weights(b'{"version": "w-2", "interests": 0.7, "age": 0.1, "distance": 0.1, "variety": 0.1}'
                                ).algorithm_version == "mm-score-1/w-2"
    for body in (b'{"version": "w", "interests": 0.9, "age": 0.9}', b'{"version": "w", "age": -0.1}',
                 b'{"version": "w", "colour": 1}', b'{"version": "a b"}', b'{"interests": 0.5}'):
        with pytest.raises(ValidationError):
            policy.parse_weights(body)
    with pytest.raises(ValueError):
        policy.parse_weights(b"{not json")


def test_threshold_breaches_follow_the_adr() -> None:
    """Failure rate > 1 %, p95 > 5 min, > 1000 unfinished jobs and any duplicate each raise their alert kind."""
    calm = policy.PartitionHealth(jobs=1000, completed=990, failed=10, unfinished=0, offers=2970, duplicate_offers=0)
    assert policy.threshold_breaches(calm, 300.0) == []
    hot = policy.PartitionHealth(jobs=5000, completed=3000, failed=51, unfinished=1949, offers=1, duplicate_offers=1)
    assert [k for k, _ in policy.threshold_breaches(hot, 301.0)] == [
        "failure_rate", "job_duration", "queue_depth", "duplicate_offers"]
    assert policy.p95([1.0] * 95 + [9.0] * 5) == 1.0 and policy.p95([1.0] * 94 + [9.0] * 6) == 9.0
