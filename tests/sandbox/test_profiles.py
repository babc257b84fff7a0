"""Route profiles: latency and provider limits, served over real sockets, and the meters that witness them."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from devstack.sandbox import SandboxClient
from devstack.sandbox.app import timed_collections, watch_loop
from devstack.sandbox.profiles import Latency, RouteMeters, RouteProfile
from devstack.sandbox.state import SandboxState
from devstack.sandbox.faults import Route

from .payloads import LLM_AUTH, chat_body

CHAT = "/llm/v1/chat/completions"


def test_lognormal_latency_is_fitted_to_p50_and_p99() -> None:
    """Drawn latencies have the asked median and 99th percentile (within sampling error), and a seed replays."""
    latency = Latency(p50=1.0, p99=4.0)
    rng = random.Random(3)
    sample = sorted(latency.sample(rng) for _ in range(20_000))
    assert statistics.median(sample) == pytest.approx(1.0, rel=0.05)
    assert sample[int(0.99 * len(sample))] == pytest.approx(4.0, rel=0.12)
    first, again = random.Random(7), random.Random(7)
    assert [latency.sample(first) for _ in range(5)] == [latency.sample(again) for _ in range(5)]


def test_a_latency_needs_one_shape() -> None:
    """`seconds` alone or both of p50 and p99 (p99 ≥ p50); anything else is refused."""
    for bad in ({}, {"seconds": 1, "p50": 1, "p99": 2}, {"p50": 1}, {"p50": 2, "p99": 1}):
        with pytest.raises(ValueError):
            Latency.model_validate(bad)


def test_the_rate_window_admits_at_most_the_rate_in_any_second() -> None:
    """With a fake monotonic clock: 5/s admits 5, refuses the 6th with the wait until the window frees."""
    now = [100.0]
    meters = RouteMeters(lambda: now[0])
    meters.set_profile(Route.MAIL_SEND, RouteProfile(rate_per_second=5))
    decisions = []
    for _ in range(6):
        decisions.append(meters.arrive(Route.MAIL_SEND))
        meters.leave(Route.MAIL_SEND, decisions[-1].admitted)
        now[0] += 0.1
    assert [d.admitted for d in decisions] == [True] * 5 + [False]
    assert decisions[-1].retry_after == 1 and decisions[-1].reason == "rate"
    now[0] = 101.01  # the first admission left the window
    assert meters.arrive(Route.MAIL_SEND).admitted
    snap = meters.snapshot()["mail.send"]
    assert (snap["peak_rate_per_second"], snap["offered_peak_rate_per_second"], snap["limited"]) == (5, 6, 1)


def test_a_refusal_right_after_the_sandboxs_own_stall_is_told_apart() -> None:
    """The sandbox's loop held up 150 ms: requests that came meanwhile are counted at its end, bunched. A refusal
    within the second after it is counted as the stall's; one later, or after a stall too short to record, is not."""
    now = [100.0]
    meters = RouteMeters(lambda: now[0])
    meters.set_profile(Route.LLM, RouteProfile(rate_per_second=2))

    def refused_now() -> None:
        for _ in range(3):  # the third within one second is refused
            meters.leave(Route.LLM, meters.arrive(Route.LLM).admitted)
        now[0] += 1.5

    meters.note_stall(0.04)  # too short to record
    refused_now()
    meters.note_stall(0.15)
    refused_now()  # right after a recorded stall
    refused_now()  # 1.5 s later: not the stall's
    snap, loop = meters.snapshot()["llm"], meters.loop()
    assert (snap["limited"], snap["limited_after_a_stall"], snap["limited_by"]) == (3, 1, {"rate": 3})
    assert loop == {"stalls": 1, "stalls_over_100ms": 1, "longest_stall_ms": 150.0, "collections_over_50ms": 0,
                    "longest_collection_ms": 0.0}
    meters.reset_counters()
    assert meters.loop()["stalls"] == 0


def test_the_watcher_records_a_turn_of_the_loop_that_came_back_late() -> None:
    """The watcher asks to be woken in 10 ms; woken 160 ms later, it records a 150 ms stall."""
    state = SandboxState()
    ticks = [0.0]
    woken = [0.01, 0.16, 0.01]

    async def sleep(_: float) -> None:
        if not woken:
            raise asyncio.CancelledError
        ticks[0] += woken.pop(0)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(watch_loop(state, clock=lambda: ticks[0], sleep=sleep))
    assert state.watching
    assert state.meters.loop()["stalls"] == 1 and state.meters.loop()["longest_stall_ms"] == 150.0


def test_a_long_garbage_collection_is_recorded_as_the_sandboxs_own_pause() -> None:
    """Timed by its gc callback: a 70 ms collection is recorded, a 10 ms one is not."""
    state = SandboxState()
    ticks = [0.0]
    collected = timed_collections(state, clock=lambda: ticks[0])
    for length in (0.07, 0.01):
        collected("start", {})
        ticks[0] += length
        collected("stop", {})
    loop = state.meters.loop()
    assert (loop["collections_over_50ms"], loop["longest_collection_ms"]) == (1, 70.0)


def test_the_running_sandbox_watches_its_own_loop(sandbox: SandboxClient) -> None:
    """The sandbox's process starts the watcher with the app: its meters can tell its own stalls apart."""
    assert sandbox.loop()["watching"] is True


def test_fixed_latency_delays_every_answer(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A route with 0.3 s latency answers no sooner; another route stays instant."""
    sandbox.set_profile("llm", latency=0.3)
    started = time.monotonic()
    assert http.post(CHAT, json=chat_body(), headers=LLM_AUTH).status_code == 200
    assert time.monotonic() - started >= 0.3
    started = time.monotonic()
    assert http.get("/pdf/v1/health").status_code == 200
    assert time.monotonic() - started < 0.3


def test_a_delay_step_slows_one_answer(sandbox: SandboxClient, http: httpx.Client) -> None:
    """`{"kind": "delay"}` answers normally (with its effect) after the wait; the next request is not delayed."""
    sandbox.script("llm", {"kind": "delay", "seconds": 0.3})
    started = time.monotonic()
    assert http.post(CHAT, json=chat_body(), headers=LLM_AUTH).status_code == 200
    assert time.monotonic() - started >= 0.3
    assert sandbox.count("llm.call") == 1
    assert [r["step"] for r in sandbox.requests("llm")] == ["delay"]


def test_beyond_max_concurrent_a_provider_429_with_retry_after(sandbox: SandboxClient) -> None:
    """8 clients at once against 3 concurrent: 3 succeed, 5 get 429 + Retry-After, no step or effect spent
    on them; the meter shows 3 admitted at once and more offered."""
    sandbox.set_profile("llm", latency=0.5, max_concurrent=3, retry_after=2)
    sandbox.script("llm", {"kind": "ok"}, {"kind": "ok"}, {"kind": "ok"}, {"status": 503})

    def call(_: int) -> httpx.Response:
        with httpx.Client(base_url=sandbox.base_url, timeout=5) as client:
            return client.post(CHAT, json=chat_body(), headers=LLM_AUTH)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(call, range(8)))
    statuses = sorted(a.status_code for a in answers)
    assert statuses == [200] * 3 + [429] * 5
    refused = [a for a in answers if a.status_code == 429]
    assert {a.headers["Retry-After"] for a in refused} == {"2"}
    assert refused[0].json()["error"]["code"] == "rate_limit_exceeded"
    assert sandbox.count("llm.call") == 3
    assert [s["status"] for s in sandbox.faults()["llm"]["pending"]] == [503]  # refusals consumed no step
    meter = sandbox.meters("llm")
    assert meter["peak_concurrency"] == 3 and meter["offered_peak_concurrency"] > 3  # the client went over
    assert (meter["admitted"], meter["limited"]) == (3, 5)
    assert sorted(r["step"] for r in sandbox.requests("llm")).count("limited:concurrency") == 5


def test_beyond_the_rate_a_provider_429_and_the_meter_shows_the_peak(sandbox: SandboxClient,
                                                                     http: httpx.Client) -> None:
    """At 4 requests/s, 6 quick calls: 4 admitted, 2 refused; the meter's peak rate is 4, offered 6."""
    sandbox.set_profile("mail.send", rate_per_second=4)
    statuses = [
        http.post("/mail/v1/messages", json={"to": "a@example.com", "subject": "s", "text": "t",
                                             "idempotency_token": f"tok-{i}"}).status_code
        for i in range(6)
    ]
    assert statuses == [202] * 4 + [429] * 2 or statuses == [200] * 4 + [429] * 2
    meter = sandbox.meters("mail.send")
    assert (meter["peak_rate_per_second"], meter["offered_peak_rate_per_second"], meter["limited"]) == (4, 6, 2)
    assert sandbox.count("mail.send") == 4


def test_a_client_within_the_limits_is_never_refused(sandbox: SandboxClient) -> None:
    """4 threads against 4 concurrent: the meter proves the limit held (limited 0, offered peak ≤ 4)."""
    sandbox.set_profile("llm", p50=0.02, p99=0.08, max_concurrent=4, seed=11)

    def calls(_: int) -> list[int]:
        with httpx.Client(base_url=sandbox.base_url, timeout=5) as client:
            return [client.post(CHAT, json=chat_body(), headers=LLM_AUTH).status_code for _ in range(5)]

    with ThreadPoolExecutor(4) as pool:
        statuses = [s for batch in pool.map(calls, range(4)) for s in batch]
    assert statuses == [200] * 20
    meter = sandbox.meters("llm")
    assert meter["limited"] == 0 and meter["offered_peak_concurrency"] <= 4
    assert meter["admitted"] == 20


def test_a_bad_profile_is_refused_with_its_reason(sandbox: SandboxClient, http: httpx.Client) -> None:
    """An admin typo (unknown field, p99 below p50) is a 422 that says what is wrong."""
    answer = http.post("/_admin/routes/llm/profile", json={"latency": {"p50": 2, "p99": 1}})
    assert answer.status_code == 422
    assert "p99" in answer.json()["error"]["message"]
    assert http.post("/_admin/routes/llm/profile", json={"max_concurency": 3}).status_code == 422
    assert http.post("/_admin/routes/nope/profile", json={}).status_code == 404
