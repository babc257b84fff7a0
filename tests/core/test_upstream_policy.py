"""Upstream limits as values: settings per upstream and per pipeline, the rate ring's shape, the waits."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from redrive.settings import Settings
from redrive.upstream_policy import UpstreamLimits
from redrive.upstreams import grant_lateness, wait_before_asking_again


def test_one_json_setting_per_upstream_and_per_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """REDRIVE_UPSTREAM_LLM and the drain maps are read from the environment; unset upstreams are not limited."""
    monkeypatch.setenv("REDRIVE_UPSTREAM_LLM", '{"max_concurrent": 60, "rate_per_second": 45, "retry_share": 0.1}')
    monkeypatch.setenv("REDRIVE_DRAIN_IN_FLIGHT", '{"criticizer": 64}')
    monkeypatch.setenv("REDRIVE_DRAIN_RUNS", '{"criticizer": 2}')
    settings = Settings()
    assert settings.upstream_limits() == {"llm": UpstreamLimits(max_concurrent=60, rate_per_second=45,
                                                                retry_share=0.1)}
    assert (settings.drain_in_flight("criticizer"), settings.drain_in_flight("evidence")) == (64, 8)
    assert (settings.drain_runs("criticizer"), settings.drain_runs("evidence")) == (2, 1)


def test_a_typo_in_an_upstream_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown field (max_concurency) fails loudly instead of silently limiting nothing."""
    monkeypatch.setenv("REDRIVE_UPSTREAM_MAIL", '{"max_concurency": 3}')
    with pytest.raises(ValidationError):
        Settings()


@given(told=st.floats(0, 600), polls=st.integers(1, 1000), roll=st.floats(0, 0.999))
def test_a_waiter_sleeps_what_it_was_told_or_a_bounded_backing_off_poll(told: float, polls: int, roll: float) -> None:
    """A told wait is kept (a little longer, at most a minute at a time); a poll stays within [poll/2, 16 poll]."""
    wait = wait_before_asking_again(told, polls, 0.05, roll)
    if told > 0:
        assert min(told, 60) <= wait <= min(told, 60) * 1.1
    else:
        assert 0.025 <= wait <= 0.8


def test_a_grants_lateness_counts_the_replys_way_back_when_the_database_clock_shows_it() -> None:
    """Asked 120 ms ago, the reply reached the caller 5 ms ago, the database answered 100 ms ago: 100 ms late (the
    commit and a starved thread's wait for the reply count, which the time since the reply alone misses)."""
    assert grant_lateness(since_replied=0.005, since_asked=0.12, since_answered=0.1) == pytest.approx(0.1)


@given(replied=st.floats(0, 5), trip=st.floats(0, 5), answered=st.floats(-3600, 3600))
def test_a_skewed_clock_moves_a_grants_lateness_only_within_the_round_trip(replied: float, trip: float,
                                                                          answered: float) -> None:
    """Whatever another machine's clock says, the lateness is never less than the time since the reply nor more
    than the time since the ask: a clock off by an hour neither excuses a late grant nor wastes an on-time one."""
    lateness = grant_lateness(since_replied=replied, since_asked=replied + trip, since_answered=answered)
    assert replied <= lateness <= replied + trip
