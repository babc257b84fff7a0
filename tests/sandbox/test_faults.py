"""Fault scripts as pure decisions, without a server."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from devstack.sandbox.faults import (
    ContentStep,
    FaultBook,
    FaultScriptError,
    OkStep,
    RandomFaults,
    Route,
    ScriptRequest,
    StatusStep,
)


def test_script_is_consumed_in_order_then_route_behaves_normally() -> None:
    """Steps come out in the order they were appended, and an empty script means normal behaviour."""
    book = FaultBook()
    book.append(Route.LLM, ScriptRequest.model_validate({"steps": [{"status": 429}, {"kind": "ok"}]}).steps)
    labels = [(p.label, p.source) for p in (book.next_step(Route.LLM) for _ in range(3))]
    assert labels == [("status:429", "script"), ("ok", "script"), ("ok", "normal")]


def test_matched_steps_go_only_to_requests_containing_their_text() -> None:
    """A step scripted for "req-b" waits for a request that mentions req-b; others take the route's script."""
    book = FaultBook()
    book.append(Route.LLM, [StatusStep(status=503)], match="req-b")
    book.append(Route.LLM, [StatusStep(status=429)])
    assert book.matches_pending(Route.LLM) and not book.matches_pending(Route.MAIL_SEND)
    served = [(p.label, p.source) for p in (book.next_step(Route.LLM, text) for text in
                                            ("about req-a", "about req-a", "about req-b", "about req-b"))]
    assert served == [("status:429", "script"), ("ok", "normal"), ("status:503", "script"), ("ok", "normal")]
    assert not book.matches_pending(Route.LLM)
    assert book.snapshot()["llm"]["matched"] == {}


def test_script_wins_over_random_faults() -> None:
    """A pending scripted step is served before any random draw."""
    book = FaultBook()
    book.start_random(Route.MAIL_SEND, RandomFaults(seed=1, rates={"503": 1.0}))
    book.append(Route.MAIL_SEND, [OkStep()])
    assert book.next_step(Route.MAIL_SEND).source == "script"
    assert book.next_step(Route.MAIL_SEND).label == "status:503"


def test_random_draws_depend_on_seed_and_not_on_key_order() -> None:
    """The same seed gives the same faults whatever order the rates were written in."""
    a = RandomFaults(seed=7, rates={"429": 0.2, "timeout": 0.1})
    b = RandomFaults(seed=7, rates={"timeout": 0.1, "429": 0.2})
    rng_a, rng_b = random.Random(a.seed), random.Random(b.seed)
    assert [a.draw(rng_a).label for _ in range(200)] == [b.draw(rng_b).label for _ in range(200)]


def test_random_retry_after_is_only_added_to_429_and_503() -> None:
    """Retry-After accompanies throttling answers, not plain server errors."""
    faults = RandomFaults(seed=0, rates={"429": 0.5, "500": 0.5}, retry_after="2")
    rng = random.Random(0)
    steps = [faults.draw(rng) for _ in range(50)]
    assert {s.status: s.headers for s in steps if isinstance(s, StatusStep)} == {
        429: {"Retry-After": "2"},
        500: {},
    }


@pytest.mark.parametrize(
    "rates",
    [{"418x": 0.1}, {"429": 1.5}, {"429": 0.6, "503": 0.6}, {"200": 0.1}],
)
def test_random_faults_reject_nonsense_rates(rates: dict[str, float]) -> None:
    """Unknown outcomes, rates outside [0, 1] and totals above 1 are refused."""
    with pytest.raises(ValidationError):
        RandomFaults(seed=0, rates=rates)


def test_content_steps_are_refused_outside_llm() -> None:
    """A content step on a non-llm route is an admin mistake, reported rather than ignored."""
    with pytest.raises(FaultScriptError):
        FaultBook().append(Route.MAIL_SEND, [ContentStep(kind="content", content="x")])
