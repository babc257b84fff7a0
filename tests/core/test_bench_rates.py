"""The pure measures `bench upstreams` reports its verdicts with."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from bench.upstreams import allowed_per_second, deployed_cap, marginal_cost, recovery_seconds, scale_out, steady_rate

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


def test_what_a_provider_route_allows_is_the_smaller_of_concurrency_over_latency_and_its_rate() -> None:
    assert allowed_per_second({"latency": 0.2, "max_concurrent": 32}) == 160.0
    assert allowed_per_second({"latency": 0.3, "rate_per_second": 20}) == 20.0
    # the LLM: 64 at once over a mean of ~1.19 s (p50 1 s, p99 4 s) is ~53.6/s, above its 50/s
    assert allowed_per_second({"p50": 1.0, "p99": 4.0, "max_concurrent": 64, "rate_per_second": 50}) == 50.0
    assert 53 < allowed_per_second({"p50": 1.0, "p99": 4.0, "max_concurrent": 64}) < 54


def test_the_cap_below_the_target_is_named_in_the_order_it_binds() -> None:
    assert deployed_cap(0.93, 0.99, rate_bound=True) == "met"
    assert "cores" in deployed_cap(0.7, 0.95, rate_bound=True)
    assert "rate share" in deployed_cap(0.88, 0.4, rate_bound=True, share=0.9)
    assert "rate share" not in deployed_cap(0.88, 0.4, rate_bound=False, share=0.9)
    assert "our engine" in deployed_cap(0.5, 0.4, rate_bound=True, share=0.9)
    assert "a drain run's process" in deployed_cap(0.3, 0.75, rate_bound=True, run_busy=0.93)


def test_scale_out_names_the_cores_only_when_they_ran_out() -> None:
    verdicts = scale_out({1: 10.0, 2: 19.0, 4: 30.0}, {1: 0.3, 2: 0.6, 4: 0.97}, cores=2)
    assert verdicts[2].startswith("1.90×") and "ran out" not in verdicts[2]
    assert verdicts[4].startswith("3.00×") and "2 cores ran out (97% busy)" in verdicts[4]


def test_the_cost_of_each_more_entity_is_told_apart_from_what_a_run_costs_whatever_its_size() -> None:
    """30 CPU-s to start a deployment and 20 ms an entity: 70 s at 2,000, 190 s at 8,000. Per entity, the whole run
    says 35 and 23.75 ms; each more entity costs 20 ms, and the run 30 s."""
    per_entity, fixed = marginal_cost({2000: 70.0, 8000: 190.0})
    assert math.isclose(per_entity, 20.0) and math.isclose(fixed, 30.0)
    # three sizes with noise: the least-squares line, not the two ends
    per_entity, fixed = marginal_cost({1000: 50.5, 2000: 69.0, 4000: 110.5})
    assert 19.5 < per_entity < 20.5 and 29.0 < fixed < 31.0
    # one size: nothing tells the run's cost apart, so all of it is per entity
    assert marginal_cost({2000: 70.0}) == (35.0, 0.0)
