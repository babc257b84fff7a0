"""Synthetic user pools for the demo, the tests and the benchmark: reproducible from (tag, seed).

Users live in metro regions (a few dozen km across), with genders, preferences, ages and interest
tags drawn so that roughly a third of same-region pairs are mutually eligible. Ids are uuid5 of
the tag and the index, so a second `make demo` (another tag) adds new users instead of clashing.
"""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Sequence
from datetime import date, timedelta
from typing import Any

import sqlalchemy as sa

from assets.matchmaking.repository import matchmaking_users

_NS = uuid.UUID("5d2f7c1e-2a4b-5c3d-8e9f-0a1b2c3d4e5f")


def user_id(tag: str, i: int) -> str:
    return str(uuid.uuid5(_NS, f"{tag}:{i}"))


def users(n: int, *, timezone: str, tag: str, regions: int = 4, seed: int = 7,
          today: date = date(2026, 3, 1)) -> list[dict[str, Any]]:
    """`n` valid, active profiles in `regions` metro areas of one timezone."""
    rng = random.Random(f"{tag}:{seed}")
    centers = [(rng.uniform(25, 55), rng.uniform(-120, 20)) for _ in range(regions)]
    out = []
    for i in range(n):
        r = i % regions
        lat0, lon0 = centers[r]
        gender = rng.choices("fmx", weights=(48, 48, 4))[0]
        seeking = {"f": ["m"], "m": ["f"], "x": ["f", "m", "x"]}[gender]
        if rng.random() < 0.1:
            seeking = ["f", "m"]
        age = rng.randint(20, 55)
        out.append({
            "id": user_id(tag, i),
            "timezone": timezone,
            "active": True,
            "region": f"{tag}-metro-{r}",
            "gender": gender,
            "seeking": seeking,
            "birth_date": today - timedelta(days=int(age * 365.25) + rng.randint(0, 300)),
            "age_min": max(18, age - rng.randint(3, 10)),
            "age_max": age + rng.randint(3, 10),
            "latitude": round(lat0 + rng.gauss(0, 0.15), 6),
            "longitude": round(lon0 + rng.gauss(0, 0.15) / max(0.2, math.cos(math.radians(lat0))), 6),
            "max_distance_km": rng.choice([10, 25, 50, 100]),
            "interests": sorted(rng.sample(range(64), rng.randint(3, 8))),
        })
    return out


def insert(conn: sa.Connection, rows: Sequence[dict[str, Any]], batch: int = 5000) -> None:
    for start in range(0, len(rows), batch):
        conn.execute(sa.insert(matchmaking_users), list(rows[start:start + batch]))
