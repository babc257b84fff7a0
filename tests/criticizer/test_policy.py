"""002 §8.1-§8.3 at the level of one stage's decision: pure, no database, no Dagster run.

Each §8.1 row is driven from a real error (httpx responses, SQLAlchemy and pydantic errors built by
the libraries) through the stage's own policy, so a change in the core's classifier or vocabulary
that breaks the seed's table for the criticizer fails here.
"""

from __future__ import annotations

import random
import socket
from datetime import timedelta
from email.utils import format_datetime

import httpx
import pytest
import sqlalchemy.orm.exc as sa_orm_exc
from hypothesis import given
from hypothesis import strategies as st

from assets.criticizer import pipeline, policy
from redrive.backoff import CRITICIZER_BACKOFF
from redrive.clock import FrozenClock
from redrive.failures import Failure, classify_http
from redrive.reliability import Reliability
from redrive.stages import decide_for
from tests.core.real_inputs import REQUEST, http_error, json_error, raised, validation_error


def _llm_error(status: int, code: str) -> httpx.HTTPStatusError:
    return http_error(status, {"error": {"code": code, "message": "upstream says no"}})


# (§8.1 category, example, real error, expected error_class, retryable) — written out from the seed.
ROWS = [
    ("network transient", "DNS timeout", lambda: raised(socket.gaierror(-3, "Temporary failure in name resolution")),
     "NETWORK_TRANSIENT", True),
    ("network transient", "socket timeout", lambda: httpx.ReadTimeout("timed out", request=REQUEST),
     "NETWORK_TIMEOUT", True),
    ("network transient", "TCP reset", lambda: raised(ConnectionResetError(104, "Connection reset by peer")),
     "NETWORK_TRANSIENT", True),
    ("network transient", "502", lambda: http_error(502, b"bad gateway"), "NETWORK_TRANSIENT", True),
    ("network transient", "503", lambda: http_error(503, b"busy"), "NETWORK_TRANSIENT", True),
    ("network transient", "504", lambda: http_error(504, b"gateway timeout"), "NETWORK_TRANSIENT", True),
    ("rate limiting", "HTTP 429", lambda: http_error(429, b""), "RATE_LIMITED", True),
    ("rate limiting", "provider rate_limit_exceeded", lambda: _llm_error(400, "rate_limit_exceeded"),
     "RATE_LIMITED", True),
    ("rate limiting", "temporary quota window", lambda: _llm_error(429, "insufficient_quota"), "RATE_LIMITED", True),
    ("upstream internal", "LLM internal_error", lambda: _llm_error(500, "internal_error"), "UPSTREAM_INTERNAL", True),
    ("upstream internal", "webhook provider 5xx", lambda: http_error(500, b"oops"), "UPSTREAM_INTERNAL", True),
    ("validation", "missing required fields", validation_error, "SCHEMA_INVALID", False),
    ("validation", "malformed JSON payload", json_error, "MALFORMED_PAYLOAD", False),
    ("validation", "context window", lambda: _llm_error(400, "context_length_exceeded"), "CONTEXT_LENGTH_EXCEEDED", False),
    ("auth", "invalid API key", lambda: _llm_error(401, "invalid_api_key"), "AUTH_DENIED", False),
    ("auth", "expired token", lambda: http_error(401, b"token expired"), "AUTH_DENIED", False),
    ("auth", "permission denied (403)", lambda: http_error(403, b"forbidden"), "AUTH_DENIED", False),
    ("not found", "404 for the input artifact", lambda: http_error(404, b""), "NOT_FOUND", False),
    ("not found", "deleted destination channel", lambda: http_error(404, b"channel_not_found"), "NOT_FOUND", False),
    ("policy", "moderation block", lambda: _llm_error(400, "content_policy_violation"), "POLICY_REJECTED", False),
    ("policy", "explicit deny", lambda: _llm_error(403, "content_filter"), "POLICY_REJECTED", False),
    ("bug", "null dereference", lambda: raised(AttributeError("'NoneType' object has no attribute 'text'")),
     "CONFIG_OR_RUNTIME_BUG", False),
    ("bug", "invariant violation", lambda: raised(AssertionError("critique without verdict")),
     "CONFIG_OR_RUNTIME_BUG", False),
    ("bug", "bad deploy config", lambda: httpx.UnsupportedProtocol("Request URL is missing an 'http://' protocol."),
     "CONFIG_OR_RUNTIME_BUG", False),
]


@pytest.mark.parametrize("stage", policy.STAGES)
@pytest.mark.parametrize(("category", "example", "make", "error_class", "retryable"), ROWS,
                         ids=[f"{r[0]}: {r[1]}" for r in ROWS])
def test_every_8_1_row_classifies_the_same_in_every_stage(stage, category, example, make, error_class,
                                                           retryable) -> None:
    """Each §8.1 example gets its stable error_class and classification, whichever stage meets it."""
    failure = pipeline.POLICIES[stage].classify(make())
    assert (failure.code, failure.retryable) == (error_class, retryable)


CONFLICTS = [
    ("409 duplicate write race", lambda: http_error(409, b"conflict")),
    ("optimistic-lock version conflict", lambda: raised(sa_orm_exc.StaleDataError("expected 1 row, 0 matched"))),
]


@pytest.mark.parametrize(("example", "make"), CONFLICTS, ids=[c[0] for c in CONFLICTS])
def test_conflicts_retry_only_in_idempotent_stages(example, make) -> None:
    """§8.1: a conflict is retried in fetch and llm (idempotent), dead-lettered at once in notify (posts)."""
    decided = {stage: pipeline.POLICIES[stage].classify(make()) for stage in policy.STAGES}
    assert {s: (f.code, f.retryable) for s, f in decided.items()} == {
        "fetch": ("CONFLICT", True), "llm": ("CONFLICT", True), "notify": ("CONFLICT", False)}
    assert policy.STAGE_IDEMPOTENT == {"fetch": True, "llm": True, "notify": False}


def test_stage_policies_are_the_seeds_numbers() -> None:
    """§8.2/§8.3: every stage has 5 attempts and the 1 s ×2 → 60 s full-jitter backoff with a 300 s ceiling."""
    for stage in ("fetch", "llm", "notify"):
        p = pipeline.POLICIES[stage]
        assert p.max_attempts == 5 and p.backoff is CRITICIZER_BACKOFF
    assert (CRITICIZER_BACKOFF.initial, CRITICIZER_BACKOFF.multiplier, CRITICIZER_BACKOFF.max_delay,
            CRITICIZER_BACKOFF.retry_after_ceiling) == (1.0, 2.0, 60.0, 300.0)


# ------------------------------------------------------------------------------ §8.2 with a clock

def _rate_limited(clock: FrozenClock, retry_after: str) -> Failure:
    """A real 429 from the sandbox's wire format, classified at the frozen clock's now."""
    failure = classify_http(429, b'{"error": {"code": "rate_limit_exceeded"}}', {"Retry-After": retry_after},
                            clock.now())
    return pipeline.POLICIES["llm"].vocabulary.apply(failure)  # type: ignore[union-attr]


def _due_in(clock: FrozenClock, failure: Failure, attempt: int, key: str) -> float:
    """The stage's decision as the Dagster edge takes it, turned into seconds from the frozen now."""
    runtime = Reliability(engine=None, clock=clock)  # type: ignore[arg-type]
    decision = decide_for(pipeline.POLICIES["llm"], failure, attempt, runtime, key)
    assert decision.retry
    due_at = decision.retry_at(runtime.now())
    assert due_at is not None
    return (due_at - clock.now()).total_seconds()


@pytest.mark.parametrize("attempt", [1, 2, 3, 4])
def test_retry_after_120_waits_at_least_120_and_at_most_300_seconds(attempt: int) -> None:
    """§8.2.2: max(backoff, 120) under the 5-minute ceiling, on every attempt that may still retry."""
    clock = FrozenClock()
    for entity in range(50):  # 50 independent jitter draws
        waited = _due_in(clock, _rate_limited(clock, "120"), attempt, f"criticizer:req-{entity}:llm:{attempt}")
        assert 120.0 <= waited <= 300.0


def test_retry_after_as_http_date_is_read_against_the_injected_clock() -> None:
    """A Retry-After date 120 s after the frozen now means 120 s, whatever the real time is."""
    clock = FrozenClock()
    header = format_datetime(clock.now() + timedelta(seconds=120), usegmt=True)
    assert _due_in(clock, _rate_limited(clock, header), 1, "criticizer:req-1:llm:1") == 120.0


@pytest.mark.parametrize("retry_after", ["900", "86400"])
def test_retry_after_over_the_ceiling_is_capped_at_300_seconds(retry_after: str) -> None:
    """§8.2.2: a Retry-After of 900 s (or a day) waits exactly the 300 s ceiling."""
    clock = FrozenClock()
    for attempt in (1, 4):
        assert _due_in(clock, _rate_limited(clock, retry_after), attempt, f"k:{attempt}") == 300.0


@given(attempt=st.integers(min_value=1, max_value=4), seed=st.integers(min_value=0, max_value=10**9))
def test_without_retry_after_the_wait_is_full_jitter_under_the_exponential_cap(attempt: int, seed: int) -> None:
    """§8.2: random(0, min(60, 1 × 2^(attempt-1))) seconds; never negative, never over the cap."""
    failure = pipeline.POLICIES["llm"].classify(http_error(503, b"busy"))
    decision, due_at = policy.next_attempt(failure, attempt, random.Random(seed), FrozenClock().now())
    assert decision.retry and 0.0 <= decision.delay <= min(60.0, 2.0 ** (attempt - 1))
    assert due_at == FrozenClock().now() + timedelta(seconds=decision.delay)


def test_jitter_is_drawn_afresh_for_each_attempt() -> None:
    """§8.2.1: no precomputed schedule — each (request, stage, attempt) draws its own delay."""
    runtime = Reliability(engine=None)  # type: ignore[arg-type]
    failure = pipeline.POLICIES["llm"].classify(http_error(503, b"busy"))
    delays = [decide_for(pipeline.POLICIES["llm"], failure, 4, runtime, f"criticizer:req-{i}:llm:4").delay
              for i in range(20)]
    assert len(set(delays)) == 20  # 20 requests at the same attempt do not wake together
    again = decide_for(pipeline.POLICIES["llm"], failure, 4, runtime, "criticizer:req-0:llm:4").delay
    assert again == delays[0]  # reproducible for one request, stage and attempt


def test_non_retryable_stops_at_once_and_budget_of_five_is_exhausted() -> None:
    """§8.2.3 and §8.3: a 401 stops at attempt 1 with budget left; a 503 at attempt 5 is exhausted."""
    rng, now = random.Random(1), FrozenClock().now()
    denied = pipeline.POLICIES["llm"].classify(_llm_error(401, "invalid_api_key"))
    decision, due = policy.next_attempt(denied, 1, rng, now)
    assert (decision.retry, decision.reason, decision.attempts_left, due) == (False, "permanent", 4, None)
    busy = pipeline.POLICIES["llm"].classify(http_error(503, b"busy"))
    assert policy.next_attempt(busy, 4, rng, now)[0].retry
    decision, due = policy.next_attempt(busy, 5, rng, now)
    assert (decision.retry, decision.reason, due) == (False, "exhausted", None)
