"""Matchmaking decisions as pure functions: partitions and their clock, eligibility, scores, offers.

No I/O and no Dagster here (STYLE §2). Everything a run writes is a function of the partition
(date, timezone), the user pool, the scoring weights and the seed (ADR-0004 "Deterministic
Generation"); nothing reads the wall clock, so a rerun or a backfill writes the same bytes.

Scoring ``mm-score-1``, for a user ``u`` and a candidate ``c`` of the same region:

* eligible when both profiles are valid, ``c != u``, each one's gender is in the other's
  ``seeking``, each one's age is in the other's range, and their distance is within both
  ``max_distance_km``;
* score = ``w_interests * jaccard(interests) + w_age * (1 - |age gap| / age_span)⁺
  + w_distance * (1 - sqrt(chord² / reach²)) + w_variety * variety``, where ``variety`` in
  [0, 1) is a hash of (seed, date, u, c): the ADR's "same random seed", so offers change from
  day to day without randomness;
* quantized to millionths, ranked by score then by candidate id (stable tie-break), top
  ``DAILY_OFFER_COUNT`` kept.

Pair arithmetic uses only + - * / and sqrt (each correctly rounded in IEEE 754), in one fixed
order, so the vectorized scorer and the per-user :func:`reference_offers` agree to the bit.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:  # imported where a frame is read (~0.25 s of CPU): every run worker loads this module
    import pandas as pd

PIPELINE = "matchmaking"
ALGORITHM = "mm-score-1"
# Fixed forever: offer ids are uuid5(NAMESPACE, "{date}:{user}:{candidate}"). Changing it changes every id.
NAMESPACE = uuid.UUID("1b0e5a52-6c0f-5d8e-9a51-7d0f3c2b8e41")

GENDER_BITS: Mapping[str, int] = {"f": 1, "m": 2, "x": 4}
MIN_AGE = 18
MAX_AGE = 120
EARTH_RADIUS_KM = 6371.0088
SCORE_SCALE = 1_000_000  # scores are kept as integer millionths
_MASK64 = (1 << 64) - 1

# ADR-0004 "Monitoring" and "Validation" thresholds.
MAX_FAILURE_RATE = 0.01
MIN_COMPLETION_RATE = 0.999
MAX_P95_JOB_SECONDS = 300.0
MAX_QUEUE_DEPTH = 1000


# ---------------------------------------------------------------------------------------- partitions


@dataclass(frozen=True, order=True)
class Partition:
    """One (local date, timezone): one run of the asset, one daily batch of offers."""

    date: date
    timezone: str

    @classmethod
    def parse(cls, date_key: str, timezone: str) -> Partition:
        try:
            day = date.fromisoformat(date_key)
            ZoneInfo(timezone)
        except (ValueError, KeyError) as exc:
            raise ValueError(f"not a matchmaking partition: date {date_key!r}, timezone {timezone!r}") from exc
        return cls(day, timezone)

    @property
    def entity_ref(self) -> str:
        """The partition's name in dead letters and run keys: ``{date}:{timezone}``."""
        return f"{self.date.isoformat()}:{self.timezone}"

    def user_ref(self, user_id: str) -> str:
        """ADR-0004's composite job key ``{date}:{timezone}:{userId}``."""
        return f"{self.entity_ref}:{user_id}"

    def offer_window(self, hour: int) -> tuple[datetime, datetime]:
        """(offered_at, expires_at) in UTC: local ``hour``:00 of the date, and of the next date.

        Derived from the partition, never from ``now()`` (the ADR's ``new Date()`` would make every
        rerun write different rows). On DST days the window is 23 or 25 hours long.
        """
        return offer_instant(self.date, self.timezone, hour), offer_instant(
            self.date + timedelta(days=1), self.timezone, hour
        )


def offer_instant(day: date, timezone: str, hour: int) -> datetime:
    """The UTC instant of local ``hour``:00 on ``day`` (fold=0: the first one if the hour repeats)."""
    return datetime.combine(day, time(hour), tzinfo=ZoneInfo(timezone)).astimezone(UTC)


def parse_entity_ref(ref: str) -> tuple[Partition, str | None]:
    """``{date}:{timezone}`` or ``{date}:{timezone}:{user_id}`` back to its parts; also Dagster's partition key
    ``{date}|{timezone}``, which the run-failure sensors file a failed partition run's dead letter under."""
    parts = ref.replace("|", ":", 1).split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"not a matchmaking entity: {ref!r}")
    partition = Partition.parse(parts[0], parts[1])
    user = str(uuid.UUID(parts[2])) if len(parts) == 3 else None
    return partition, user


def partitions_due(tick: datetime, timezones: Iterable[str], hour: int, *, start: date,
                   interval: timedelta = timedelta(hours=1)) -> list[Partition]:
    """The partitions whose local ``hour``:00 falls in ``(tick - interval, tick]``.

    Each (date, timezone) has exactly one such instant and hourly windows tile the timeline, so
    an hourly tick requests every local date exactly once per timezone — on DST days too, and in
    zones with half-hour offsets (their 9:00 falls inside a window and is picked at its end).
    """
    if tick.tzinfo is None:
        raise ValueError("tick must be timezone-aware")
    tick = tick.astimezone(UTC)
    earlier = tick - interval
    due = []
    for tz in timezones:
        zone = ZoneInfo(tz)
        for day in sorted({tick.astimezone(zone).date(), earlier.astimezone(zone).date()}):
            if day >= start and earlier < offer_instant(day, tz, hour) <= tick:
                due.append(Partition(day, tz))
    return due


# -------------------------------------------------------------------------------------------- weights


class ScoringWeights(BaseModel):
    """The scoring artifact: weights of ``mm-score-1`` under a version stored with every offer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str = Field(pattern=r"^[A-Za-z0-9._-]{1,40}$")
    interests: float = Field(default=0.5, ge=0, le=1)
    age: float = Field(default=0.2, ge=0, le=1)
    distance: float = Field(default=0.25, ge=0, le=1)
    variety: float = Field(default=0.05, ge=0, le=1)
    age_span_years: float = Field(default=20.0, gt=0, le=100)

    @model_validator(mode="after")
    def _bounded(self) -> ScoringWeights:
        total = self.interests + self.age + self.distance + self.variety
        if not 0 < total <= 1 + 1e-9:
            raise ValueError(f"weights must sum to a value in (0, 1], got {total}")
        return self

    @property
    def algorithm_version(self) -> str:
        return f"{ALGORITHM}/{self.version}"


BUILTIN_WEIGHTS = ScoringWeights(version="builtin-1")


def parse_weights(body: bytes) -> ScoringWeights:
    """The artifact's bytes as weights; malformed JSON or a wrong shape raises (a data inconsistency)."""
    return ScoringWeights.model_validate(json.loads(body))


# ----------------------------------------------------------------------------------------------- pool

# What the repository loads per user (one row each, ordered by region then id).
POOL_COLUMNS = (
    "id", "region", "gender_bits", "seeking_bits", "seeking_unknown", "age", "age_min", "age_max",
    "latitude", "longitude", "max_distance_km", "interests_bits", "interests_unknown",
)


@dataclass(frozen=True, eq=False)
class Pool:
    """The eligible users of one partition as arrays, in (region, id) order, with per-user features."""

    ids: np.ndarray  # str
    region: np.ndarray  # int32 block code; -1 for invalid users
    gender: np.ndarray  # int8 bit
    seeking: np.ndarray  # int8 bits
    age: np.ndarray  # int16 (clipped; only valid profiles are scored)
    age_min: np.ndarray
    age_max: np.ndarray
    ux: np.ndarray  # unit vector on the sphere
    uy: np.ndarray
    uz: np.ndarray
    reach2: np.ndarray  # squared chord of max_distance_km
    interests: np.ndarray  # uint64 bits
    key64: np.ndarray  # uint64 hash of the id
    valid: np.ndarray  # bool
    problems: Mapping[int, str]  # row -> why the profile is invalid
    blocks: Mapping[int, tuple[int, int]]  # region code -> [start, end) rows

    def __len__(self) -> int:
        return len(self.ids)

    def index(self) -> dict[str, int]:
        return {u: i for i, u in enumerate(self.ids.tolist())}


def _int(df: pd.DataFrame, column: str) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd

    values = pd.to_numeric(df[column], errors="coerce")
    missing = values.isna().to_numpy()
    return values.fillna(0).to_numpy(dtype=np.int64), missing


def profile_problems(df: pd.DataFrame) -> dict[int, str]:
    """Rows whose profile cannot be matched (ADR-0004 "data inconsistency") and why: field names, never values."""
    import pandas as pd

    n = len(df)
    reasons: list[list[str]] = [[] for _ in range(n)]

    def flag(mask: np.ndarray, why: str) -> None:
        for i in np.flatnonzero(mask):
            reasons[i].append(why)

    gender, _ = _int(df, "gender_bits")
    seeking, _ = _int(df, "seeking_bits")
    age, age_missing = _int(df, "age")
    amin, amin_missing = _int(df, "age_min")
    amax, amax_missing = _int(df, "age_max")
    reach, reach_missing = _int(df, "max_distance_km")
    lat = pd.to_numeric(df["latitude"], errors="coerce").to_numpy(dtype=np.float64)
    lon = pd.to_numeric(df["longitude"], errors="coerce").to_numpy(dtype=np.float64)
    region = df["region"].fillna("").astype(str).str.strip().to_numpy()

    flag(gender == 0, "gender must be one of f, m, x")
    flag((seeking == 0) | df["seeking_unknown"].fillna(True).to_numpy(dtype=bool),
         "seeking must be a non-empty subset of f, m, x")
    flag(age_missing, "birth_date is missing")
    flag(~age_missing & (age < MIN_AGE), f"user is under {MIN_AGE} on the partition date")
    flag(~age_missing & (age > MAX_AGE), f"birth_date is implausible (over {MAX_AGE} years)")
    flag(amin_missing | amax_missing | (amin < MIN_AGE) | (amin > amax),
         f"age range must satisfy {MIN_AGE} <= age_min <= age_max")
    flag(~(np.isfinite(lat) & np.isfinite(lon) & (np.abs(lat) <= 90) & (np.abs(lon) <= 180)),
         "latitude/longitude out of range")
    flag(reach_missing | (reach <= 0), "max_distance_km must be positive")
    flag(region == "", "region is missing")
    flag(df["interests_unknown"].fillna(True).to_numpy(dtype=bool), "interest tags must be in 0..63")
    return {i: "; ".join(r) for i, r in enumerate(reasons) if r}


def id_key64(user_id: str) -> int:
    """The low 64 bits of a UUID: the user's input to the variety hash."""
    return uuid.UUID(user_id).int & _MASK64


def build_pool(df: pd.DataFrame) -> Pool:
    """Arrays and per-user features from the repository's frame, put in (region, id) order."""
    import pandas as pd

    missing = [c for c in POOL_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"pool frame lacks columns {missing}")
    df = df.assign(id=df["id"].astype(str)).sort_values(["region", "id"], na_position="last", kind="mergesort")
    df = df.reset_index(drop=True)
    problems = profile_problems(df)
    n = len(df)
    valid = np.ones(n, dtype=bool)
    valid[list(problems)] = False
    ids = df["id"].astype(str).to_numpy()
    region_names = df["region"].fillna("").astype(str).to_numpy()
    region = np.full(n, -1, dtype=np.int32)
    blocks: dict[int, tuple[int, int]] = {}
    start = 0
    for end in [*(np.flatnonzero(region_names[1:] != region_names[:-1]) + 1).tolist(), n]:
        if end > start:
            code = len(blocks)
            blocks[code] = (start, end)
            region[start:end] = code
        start = end
    region[~valid] = -1
    lat = np.radians(np.nan_to_num(pd.to_numeric(df["latitude"], errors="coerce").to_numpy(dtype=np.float64)))
    lon = np.radians(np.nan_to_num(pd.to_numeric(df["longitude"], errors="coerce").to_numpy(dtype=np.float64)))
    km = np.clip(pd.to_numeric(df["max_distance_km"], errors="coerce").fillna(0).to_numpy(dtype=np.float64),
                 0.0, math.pi * EARTH_RADIUS_KM)
    reach = 2.0 * np.sin(km / (2.0 * EARTH_RADIUS_KM))
    interests = pd.to_numeric(df["interests_bits"], errors="coerce").fillna(0).to_numpy(dtype=np.int64)
    small = np.int16  # compact integer features: the eligibility matrix is memory-bound
    return Pool(
        ids=ids,
        region=region,
        gender=_int(df, "gender_bits")[0].astype(np.int8),
        seeking=_int(df, "seeking_bits")[0].astype(np.int8),
        age=np.clip(_int(df, "age")[0], -1, 999).astype(small),
        age_min=np.clip(_int(df, "age_min")[0], -1, 999).astype(small),
        age_max=np.clip(_int(df, "age_max")[0], -1, 999).astype(small),
        ux=np.cos(lat) * np.cos(lon),
        uy=np.cos(lat) * np.sin(lon),
        uz=np.sin(lat),
        reach2=reach * reach,
        interests=interests.view(np.uint64),
        key64=np.array([id_key64(u) for u in ids.tolist()], dtype=np.uint64),
        valid=valid,
        problems=problems,
        blocks=blocks,
    )


# -------------------------------------------------------------------------------------------- scoring


def date_key(seed: str, day: date) -> int:
    """64 bits naming (seed, date): the variety term changes daily and with the seed, never otherwise."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{day.isoformat()}".encode()).digest()[:8], "big")


_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _variety_np(key_u: np.ndarray, key_c: np.ndarray, day_key: int) -> np.ndarray:
    """splitmix64 of (u, c, day) as a float in [0, 1); uint64 arithmetic wraps, as intended."""
    with np.errstate(over="ignore"):
        z = (key_u ^ np.uint64(day_key)) + key_c * np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _variety_py(key_u: int, key_c: int, day_key: int) -> float:
    z = ((key_u ^ day_key) + key_c * _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


@dataclass(frozen=True)
class Offers:
    """Selected offers as parallel arrays: pool rows of user and candidate, 1-based rank, score in millionths."""

    user: np.ndarray
    candidate: np.ndarray
    rank: np.ndarray
    score: np.ndarray

    @classmethod
    def empty(cls) -> Offers:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z, z)

    @classmethod
    def concat(cls, parts: Sequence[Offers]) -> Offers:
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("user", "candidate", "rank", "score")))

    def __len__(self) -> int:
        return len(self.user)

    def only(self, users: Iterable[int]) -> Offers:
        keep = np.isin(self.user, np.fromiter(users, dtype=np.int64))
        return Offers(self.user[keep], self.candidate[keep], self.rank[keep], self.score[keep])


def _block_scores(pool: Pool, t: np.ndarray, c: np.ndarray, w: ScoringWeights, day_key: int) -> np.ndarray:
    """Score (millionths) of every pair t × c; -1 where the pair is not mutually eligible.

    Eligibility is decided on the whole matrix with cheap integer tests; the floating-point score is then
    computed only for the eligible pairs (typically a fifth of them), as flat arrays.
    """
    T, C = t[:, None], c[None, :]
    eligible = (pool.gender[C] & pool.seeking[T]) != 0
    eligible &= (pool.gender[T] & pool.seeking[C]) != 0
    eligible &= (pool.age[C] >= pool.age_min[T]) & (pool.age[C] <= pool.age_max[T])
    eligible &= (pool.age[T] >= pool.age_min[C]) & (pool.age[T] <= pool.age_max[C])
    eligible &= T != C
    rows, cols = np.nonzero(eligible)
    u, v = t[rows], c[cols]
    dx = pool.ux[u] - pool.ux[v]
    dy = pool.uy[u] - pool.uy[v]
    dz = pool.uz[u] - pool.uz[v]
    d2 = dx * dx + dy * dy + dz * dz
    reach2 = np.minimum(pool.reach2[u], pool.reach2[v])
    near_enough = d2 <= reach2
    rows, cols, u, v, d2, reach2 = (a[near_enough] for a in (rows, cols, u, v, d2, reach2))
    inter = np.bitwise_count(pool.interests[u] & pool.interests[v]).astype(np.float64)
    union = np.bitwise_count(pool.interests[u] | pool.interests[v]).astype(np.float64)
    jaccard = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    age_fit = np.maximum(0.0, 1.0 - np.abs(pool.age[u] - pool.age[v]).astype(np.float64) / w.age_span_years)
    near = 1.0 - np.sqrt(np.divide(d2, reach2, out=np.ones_like(d2), where=reach2 > 0))
    variety = _variety_np(pool.key64[u], pool.key64[v], day_key)
    score = w.interests * jaccard + w.age * age_fit + w.distance * near + w.variety * variety
    out = np.full(eligible.shape, -1, dtype=np.int64)
    out[rows, cols] = np.rint(score * SCORE_SCALE).astype(np.int64)
    return out


def _top_k(scores: np.ndarray, t: np.ndarray, c: np.ndarray, k: int) -> Offers:
    """Top k per row by score, ties to the smaller candidate id (columns are in id order)."""
    rows, cols = scores.shape
    # One integer key per pair: score first, then the earlier column; ineligible pairs stay negative.
    key = np.where(scores >= 0, scores * cols + (cols - 1 - np.arange(cols))[None, :], -1)
    kk = min(k, cols)
    if kk < cols:
        part = np.argpartition(-key, kk - 1, axis=1)[:, :kk]
    else:
        part = np.broadcast_to(np.arange(cols), (rows, cols))
    picked = np.take_along_axis(key, part, axis=1)
    order = np.argsort(-picked, axis=1, kind="stable")
    part = np.take_along_axis(part, order, axis=1)
    picked = np.take_along_axis(picked, order, axis=1)
    keep = picked >= 0
    r, j = np.nonzero(keep)
    return Offers(
        user=t[r].astype(np.int64),
        candidate=c[part[r, j]].astype(np.int64),
        rank=(j + 1).astype(np.int64),
        score=(picked[r, j] // cols).astype(np.int64),
    )


def compute_offers(pool: Pool, targets: Sequence[int] | np.ndarray, *, day: date, seed: str,
                   weights: ScoringWeights, k: int, pair_budget: int = 262_144) -> Offers:
    """Offers of the given valid pool rows, vectorized per region in slices of at most ``pair_budget`` pairs."""
    targets = np.asarray(targets, dtype=np.int64)
    if len(targets) and not pool.valid[targets].all():
        raise ValueError("compute_offers got users with invalid profiles")
    day_key = date_key(seed, day)
    parts = []
    regions = pool.region[targets]
    for code in np.unique(regions).tolist():
        start, end = pool.blocks[code]
        cands = np.arange(start, end, dtype=np.int64)
        cands = cands[pool.valid[start:end]]
        mine = np.sort(targets[regions == code])
        step = max(1, pair_budget // max(1, len(cands)))
        for s in range(0, len(mine), step):
            t = mine[s:s + step]
            parts.append(_top_k(_block_scores(pool, t, cands, weights, day_key), t, cands, k))
    return Offers.concat(parts)


def reference_pair_score(pool: Pool, user: int, candidate: int, *, day_key: int,
                         weights: ScoringWeights) -> int | None:
    """The specification for one pair in plain Python: the score in millionths, or None if not mutually eligible.

    Tests and the benchmark's per-user baseline use it; :func:`compute_offers` must agree exactly.
    """
    u, c = user, candidate
    if u == c or not (pool.valid[u] and pool.valid[c]) or pool.region[u] != pool.region[c]:
        return None
    a, ac = int(pool.age[u]), int(pool.age[c])
    if not (int(pool.gender[c]) & int(pool.seeking[u]) and int(pool.gender[u]) & int(pool.seeking[c])):
        return None
    if not (int(pool.age_min[u]) <= ac <= int(pool.age_max[u]) and int(pool.age_min[c]) <= a <= int(pool.age_max[c])):
        return None
    dx = float(pool.ux[u]) - float(pool.ux[c])
    dy = float(pool.uy[u]) - float(pool.uy[c])
    dz = float(pool.uz[u]) - float(pool.uz[c])
    d2 = dx * dx + dy * dy + dz * dz
    reach2 = min(float(pool.reach2[u]), float(pool.reach2[c]))
    if not d2 <= reach2:
        return None
    bu, bc = int(pool.interests[u]), int(pool.interests[c])
    union = (bu | bc).bit_count()
    jaccard = float((bu & bc).bit_count()) / float(union) if union else 0.0
    age_fit = max(0.0, 1.0 - float(abs(a - ac)) / weights.age_span_years)
    near = 1.0 - math.sqrt(d2 / reach2) if reach2 > 0 else 0.0
    variety = _variety_py(int(pool.key64[u]), int(pool.key64[c]), day_key)
    score = weights.interests * jaccard + weights.age * age_fit + weights.distance * near + weights.variety * variety
    return round(score * SCORE_SCALE)


def select_top(pool: Pool, scored: Iterable[tuple[int, int]], k: int) -> list[tuple[int, int, int]]:
    """[(candidate row, rank, score)] of the k best (candidate row, score) pairs: score, then candidate id."""
    ordered = sorted(scored, key=lambda e: (-e[1], str(pool.ids[e[0]])))
    return [(c, rank, s) for rank, (c, s) in enumerate(ordered[:k], start=1)]


def reference_offers(pool: Pool, user: int, *, day: date, seed: str, weights: ScoringWeights,
                     k: int) -> list[tuple[int, int, int]]:
    """One user's offers, candidate by candidate in plain Python: [(candidate row, rank, score)]."""
    if not pool.valid[user]:
        raise ValueError("reference_offers got a user with an invalid profile")
    start, end = pool.blocks[int(pool.region[user])]
    day_key = date_key(seed, day)
    scored = ((c, reference_pair_score(pool, user, c, day_key=day_key, weights=weights)) for c in range(start, end))
    return select_top(pool, ((c, s) for c, s in scored if s is not None), k)


# ---------------------------------------------------------------------------------------- invariants


def offer_invariant_violations(pool: Pool, offers: Offers, k: int) -> dict[int, str]:
    """Users whose offers break what the algorithm promises — a logic error, never retried (ADR-0004)."""
    bad: dict[int, str] = {}
    if not len(offers):
        return bad
    order = np.lexsort((offers.rank, offers.user))
    u, c, r, s = offers.user[order], offers.candidate[order], offers.rank[order], offers.score[order]
    first = np.r_[True, u[1:] != u[:-1]]
    expected_rank = np.arange(len(u)) - np.maximum.accumulate(np.where(first, np.arange(len(u)), 0)) + 1

    def flag(users: np.ndarray, why: str) -> None:
        for i in np.unique(users).tolist():
            bad.setdefault(int(i), why)

    flag(u[r != expected_rank], "ranks are not 1..n")
    flag(u[r > k], f"more than {k} offers")
    flag(u[u == c], "an offer to the user themself")
    flag(u[(s < 0) | (s > SCORE_SCALE)], "score outside [0, 1]")
    flag(u[~first & (s > np.r_[s[:1], s[:-1]])], "scores do not decrease with rank")
    flag(u[~pool.valid[c] | (pool.region[c] != pool.region[u])], "candidate outside the user's valid region pool")
    by_candidate = np.lexsort((c, u))
    uu, cc = u[by_candidate], c[by_candidate]
    flag(uu[1:][(uu[1:] == uu[:-1]) & (cc[1:] == cc[:-1])], "the same candidate twice")
    return bad


# ------------------------------------------------------------------------------------------- offers


def offer_id(day: date, user_id: str, candidate_id: str) -> str:
    """ADR-0004 ``generateDeterministicId``: uuid5 of ``{date}:{user}:{candidate}`` under :data:`NAMESPACE`.

    Equal to ``str(uuid.uuid5(NAMESPACE, name))`` (RFC 4122 §4.3), without building UUID objects:
    a partition writes hundreds of thousands of them.
    """
    name = f"{day.isoformat()}:{user_id}:{candidate_id}".encode()
    digest = bytearray(hashlib.sha1(_NAMESPACE_BYTES + name).digest()[:16])
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    h = digest.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_NAMESPACE_BYTES = NAMESPACE.bytes


@dataclass(frozen=True)
class OfferRow:
    id: str
    user_id: str
    candidate_id: str
    rank: int
    score: float


def offer_rows(pool: Pool, offers: Offers, day: date) -> dict[str, list[OfferRow]]:
    """Offers per user id, in rank order, with their deterministic ids."""
    out: dict[str, list[OfferRow]] = {}
    ids = pool.ids
    order = np.lexsort((offers.rank, offers.user))
    for u, c, r, s in zip(offers.user[order].tolist(), offers.candidate[order].tolist(),
                          offers.rank[order].tolist(), offers.score[order].tolist(), strict=True):
        user_id, candidate_id = str(ids[u]), str(ids[c])
        out.setdefault(user_id, []).append(
            OfferRow(offer_id(day, user_id, candidate_id), user_id, candidate_id, r, s / SCORE_SCALE))
    return out


def offers_document(rows: Sequence[OfferRow]) -> str:
    """The job row's ``offers`` JSONB (ADR-0004 returns it for a completed job), byte-stable."""
    return json.dumps([{"id": o.id, "candidate_id": o.candidate_id, "rank": o.rank, "score": o.score}
                       for o in rows], separators=(",", ":"), sort_keys=True)


# ---------------------------------------------------------------------------------------- monitoring


@dataclass(frozen=True)
class PartitionHealth:
    """A partition's jobs and offers as the checks and the ADR's monitoring see them."""

    jobs: int
    completed: int
    failed: int
    unfinished: int  # pending or running
    offers: int
    duplicate_offers: int

    @property
    def completion_rate(self) -> float:
        return self.completed / self.jobs if self.jobs else 1.0

    @property
    def failure_rate(self) -> float:
        return self.failed / self.jobs if self.jobs else 0.0


def p95(values: Sequence[float]) -> float:
    """Nearest-rank 95th percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def threshold_breaches(health: PartitionHealth, job_p95_seconds: float) -> list[tuple[str, str]]:
    """ADR-0004 "Monitoring": (kind, summary) for each threshold the partition is over."""
    out = []
    if health.failure_rate > MAX_FAILURE_RATE:
        out.append(("failure_rate", f"job failure rate {health.failure_rate:.2%} > {MAX_FAILURE_RATE:.0%} "
                                    f"({health.failed} of {health.jobs} jobs failed)"))
    if job_p95_seconds > MAX_P95_JOB_SECONDS:
        out.append(("job_duration", f"job duration p95 {job_p95_seconds:.0f}s > {MAX_P95_JOB_SECONDS:.0f}s"))
    if health.unfinished > MAX_QUEUE_DEPTH:
        out.append(("queue_depth", f"{health.unfinished} jobs pending or running > {MAX_QUEUE_DEPTH}"))
    if health.duplicate_offers > 0:
        out.append(("duplicate_offers", f"{health.duplicate_offers} duplicate offers"))
    return out
