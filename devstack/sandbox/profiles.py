"""Route profiles: how slow a route answers and what limits it enforces, as a provider would.

A profile is set per route by the admin (`POST /_admin/routes/{route}/profile`):

    {"latency": {"seconds": 0.2}}                          every admitted request waits 200 ms
    {"latency": {"p50": 1.0, "p99": 4.0}, "seed": 7}       lognormal fitted to p50 and p99, seeded
    {"max_concurrent": 64, "rate_per_second": 50}          beyond either: 429 with Retry-After

A request over a limit is answered at once with 429 and a `Retry-After`, consumes no fault step and
performs no side effect, like a provider's gateway in front of its service. The route's meter records
what was admitted (peak concurrency, peak requests in any 1 s window) and what was offered (the same
counting refused requests too) and how many were refused, so a test can prove a client never exceeded
a limit: `limited == 0` and the offered peaks are within the limits.

The sandbox shares the machine with what it serves; a provider does not. When the sandbox's own event
loop is held up (its process starved of CPU), the requests that reached its socket meanwhile are counted
together at the end, as if they had come bunched. The meters therefore also record the loop's stalls
(`note_stall`, fed by `app.py`'s watcher) and, per route, how many refusals came within a second after one:
a refusal a stall explains is the sandbox's own doing, not the client's.

This module decides and counts; `app.py` sleeps and answers.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from devstack.sandbox.faults import Route

# The standard normal quantile at 0.99: a lognormal with median m and p99 q has sigma = ln(q/m) / Z99.
Z99 = 2.3263478740408408
WINDOW_SECONDS = 1.0
STALL_SECONDS = 0.05  # a pause of the sandbox's own loop at least this long is recorded

Monotonic = Callable[[], float]


class Latency(BaseModel):
    """Fixed (`seconds`) or a lognormal given by its median and 99th percentile."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seconds: float | None = Field(default=None, ge=0, le=600)
    p50: float | None = Field(default=None, gt=0, le=600)
    p99: float | None = Field(default=None, gt=0, le=600)

    @model_validator(mode="after")
    def _one_shape(self) -> Latency:
        fixed = self.seconds is not None
        spread = self.p50 is not None or self.p99 is not None
        if fixed == spread:
            raise ValueError("give either 'seconds', or both 'p50' and 'p99'")
        if spread and (self.p50 is None or self.p99 is None):
            raise ValueError("a distribution needs both 'p50' and 'p99'")
        if spread and self.p99 < self.p50:  # type: ignore[operator]
            raise ValueError(f"p99 ({self.p99}) must be at least p50 ({self.p50})")
        return self

    def sample(self, rng: random.Random) -> float:
        """One draw; exactly one random number per request, so a seed replays the sequence."""
        if self.seconds is not None:
            return self.seconds
        assert self.p50 is not None and self.p99 is not None
        mu = math.log(self.p50)
        sigma = math.log(self.p99 / self.p50) / Z99
        return min(600.0, rng.lognormvariate(mu, sigma))


class RouteProfile(BaseModel):
    """Body of `POST /_admin/routes/{route}/profile`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    latency: Latency | None = None
    max_concurrent: int | None = Field(default=None, ge=1)
    rate_per_second: float | None = Field(default=None, gt=0)
    # A fixed Retry-After (seconds) for refused requests; by default the time until a slot of the
    # rate window frees, rounded up to whole seconds (at least 1), as most providers answer.
    retry_after: int | None = Field(default=None, ge=0, le=3600)
    seed: int = 0


@dataclass(frozen=True)
class Admission:
    """The meter's decision for one arriving request."""

    admitted: bool
    delay: float = 0.0
    retry_after: int = 0
    reason: str = ""


@dataclass
class _Meter:
    """One route's counters; all times from a monotonic clock."""

    profile: RouteProfile | None = None
    rng: random.Random = field(default_factory=random.Random)
    in_flight: int = 0
    offered_in_flight: int = 0
    admitted_times: deque[float] = field(default_factory=deque)
    offered_times: deque[float] = field(default_factory=deque)
    peak_concurrency: int = 0
    peak_rate: int = 0
    offered_peak_concurrency: int = 0
    offered_peak_rate: int = 0
    admitted: int = 0
    limited: int = 0
    limited_at: list[float] = field(default_factory=list)
    limited_by: dict[str, int] = field(default_factory=dict)  # refusals by the limit that refused them

    def snapshot(self, stalls: list[tuple[float, float]]) -> dict[str, Any]:
        profile = self.profile
        return {
            "limited_by": dict(self.limited_by),
            "limited_after_a_stall": sum(1 for t in self.limited_at if _after_a_stall(t, stalls)),
            "profile": None if profile is None else profile.model_dump(exclude_none=True),
            "in_flight": self.in_flight,
            "admitted": self.admitted,
            "limited": self.limited,
            "peak_concurrency": self.peak_concurrency,
            "peak_rate_per_second": self.peak_rate,
            "offered_peak_concurrency": self.offered_peak_concurrency,
            "offered_peak_rate_per_second": self.offered_peak_rate,
        }


def _after_a_stall(t: float, stalls: list[tuple[float, float]]) -> bool:
    """Whether `t` falls within a second after the end of a stall (end, length): a window that holds the
    stall's end also holds what it bunched there."""
    return any(end <= t < end + WINDOW_SECONDS for end, _ in stalls)


def _slide(times: deque[float], now: float) -> None:
    while times and times[0] <= now - WINDOW_SECONDS:
        times.popleft()


class RouteMeters:
    """Profiles and counters of every route; one lock, held only for arithmetic."""

    def __init__(self, monotonic: Monotonic = time.monotonic) -> None:
        self._now = monotonic
        self._lock = threading.Lock()
        self._meters: dict[Route, _Meter] = {}
        self._stalls: list[tuple[float, float]] = []  # (end, length) of each loop stall of STALL_SECONDS or more
        self._collections: list[float] = []  # lengths of the garbage collector's pauses of STALL_SECONDS or more

    def set_profile(self, route: Route, profile: RouteProfile) -> None:
        """Replace the route's profile (its counters stay; `reset_counters` clears them)."""
        with self._lock:
            meter = self._meters.setdefault(route, _Meter())
            meter.profile = profile
            meter.rng = random.Random(profile.seed)

    def clear_profile(self, route: Route) -> bool:
        with self._lock:
            meter = self._meters.get(route)
            had = meter is not None and meter.profile is not None
            if meter is not None:
                meter.profile = None
            return had

    def reset_counters(self) -> None:
        """Forget peaks and counts, keep profiles and what is in flight now."""
        with self._lock:
            for route, meter in list(self._meters.items()):
                fresh = _Meter(profile=meter.profile, rng=meter.rng, in_flight=meter.in_flight,
                               offered_in_flight=meter.offered_in_flight)
                self._meters[route] = fresh
            self._stalls = []
            self._collections = []

    def note_collection(self, length: float) -> None:
        """The garbage collector held this process `length` seconds (a stall it explains). Called from inside
        the collector, which may have interrupted a holder of the lock: a bare append, no lock."""
        if length >= STALL_SECONDS:
            self._collections.append(length)

    def note_stall(self, length: float) -> None:
        """The sandbox's event loop was held up `length` seconds, ending now (recorded from STALL_SECONDS)."""
        if length >= STALL_SECONDS:
            with self._lock:
                self._stalls.append((self._now(), length))

    def arrive(self, route: Route) -> Admission:
        """Count an arriving request and decide: admitted (with its latency) or refused (429)."""
        with self._lock:
            meter = self._meters.setdefault(route, _Meter())
            now = self._now()
            meter.offered_in_flight += 1
            meter.offered_peak_concurrency = max(meter.offered_peak_concurrency, meter.offered_in_flight)
            _slide(meter.offered_times, now)
            meter.offered_times.append(now)
            meter.offered_peak_rate = max(meter.offered_peak_rate, len(meter.offered_times))
            _slide(meter.admitted_times, now)
            profile = meter.profile
            refusal = None if profile is None else self._refusal(meter, profile, now)
            if refusal is not None:
                meter.limited += 1
                meter.limited_at.append(now)
                meter.limited_by[refusal.reason] = meter.limited_by.get(refusal.reason, 0) + 1
                return refusal
            meter.in_flight += 1
            meter.admitted += 1
            meter.peak_concurrency = max(meter.peak_concurrency, meter.in_flight)
            meter.admitted_times.append(now)
            meter.peak_rate = max(meter.peak_rate, len(meter.admitted_times))
            latency = None if profile is None else profile.latency
            return Admission(True, delay=0.0 if latency is None else latency.sample(meter.rng))

    @staticmethod
    def _refusal(meter: _Meter, profile: RouteProfile, now: float) -> Admission | None:
        if profile.max_concurrent is not None and meter.in_flight >= profile.max_concurrent:
            wait = 1 if profile.retry_after is None else profile.retry_after
            return Admission(False, retry_after=wait, reason="concurrency")
        if profile.rate_per_second is not None and len(meter.admitted_times) + 1 > profile.rate_per_second:
            free_in = meter.admitted_times[0] + WINDOW_SECONDS - now
            wait = max(1, math.ceil(free_in)) if profile.retry_after is None else profile.retry_after
            return Admission(False, retry_after=wait, reason="rate")
        return None

    def leave(self, route: Route, admitted: bool) -> None:
        """The request was answered (or dropped)."""
        with self._lock:
            meter = self._meters.setdefault(route, _Meter())
            meter.offered_in_flight = max(0, meter.offered_in_flight - 1)
            if admitted:
                meter.in_flight = max(0, meter.in_flight - 1)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {route.value: self._meters.get(route, _Meter()).snapshot(self._stalls) for route in Route}

    def loop(self) -> dict[str, Any]:
        """The sandbox's own event loop: how often and how long it was held up."""
        with self._lock:
            lengths = [length for _, length in self._stalls]
            collections = list(self._collections)
        return {"stalls": len(lengths), "stalls_over_100ms": sum(1 for x in lengths if x >= 0.1),
                "longest_stall_ms": round(max(lengths, default=0.0) * 1000, 1),
                "collections_over_50ms": len(collections),
                "longest_collection_ms": round(max(collections, default=0.0) * 1000, 1)}
