"""The pure measures `bench upstreams` reports its verdicts with."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from bench.upstreams import recovery_seconds, steady_rate

T0 = datetime(2026, 11, 27, tzinfo=UTC)


def test_the_steady_rate_leaves_out_the_ramp_and_the_slow_tail() -> None:
    """10 answers/s for 20 s, then a tail of 5 answers spread over 30 s: the rate is the 10/s, not what the tail
    would drag the whole run's average down to."""
    steady = [T0 + timedelta(seconds=i / 10) for i in range(200)]
    tail = [T0 + timedelta(seconds=20 + 6 * i) for i in range(1, 6)]
    assert abs(steady_rate(steady + tail) - 10.0) < 0.2
    whole = (len(steady) + len(tail) - 1) / 50
    assert whole < 5  # what the first-to-last span says


def test_too_few_answers_have_no_rate() -> None:
    assert math.isnan(steady_rate([T0]))


def test_recovery_is_the_first_window_back_at_the_share_of_the_baseline() -> None:
    """30 ok/s before, 0 during an outage of seconds 20-40, 10/s for 5 s after, then 30/s again: back at 90 %
    after 5 s."""
    ok = {t: 30 for t in range(0, 20)} | {t: 0 for t in range(20, 40)} | {t: 10 for t in range(40, 45)} | \
        {t: 30 for t in range(45, 80)}
    baseline, back = recovery_seconds(ok, (5, 20), 40)
    assert baseline == 30 and back == 5.0
    assert recovery_seconds({t: 30 for t in range(20)} | {t: 0 for t in range(20, 60)}, (5, 20), 40)[1] is None
