"""Issue 26 §2: an entity waiting on the LLM holds no OS thread, so one drain run keeps many in flight."""

from __future__ import annotations

from assets.criticizer import api
from redrive.drain import Drain
from tests.criticizer.conftest import webhook_posts
from tests.threads import thread_growth

N = 60


def test_one_run_keeps_sixty_requests_waiting_on_the_llm_at_once_on_a_few_threads(run, submit, engine,
                                                                                  sandbox) -> None:
    """60 requests against an LLM that takes 3 s: the sandbox sees all 60 waiting at once, while the run's
    process gains no thread per request (the threaded engine added one per entity in flight: 60)."""
    for i in range(N):
        submit(f"wide-{i}")
    sandbox.set_profile("llm", latency=3.0)  # long enough for all 60 to get there, on a loaded machine too
    with thread_growth() as grew:
        result = run("wide-0", config={"ops": {"criticizer_drain": {"config": {
            "concurrency": N, "batch_size": N, "linger_seconds": 0.0}}}})
    assert result.success
    assert {api.status(engine, f"wide-{i}").status for i in range(N)} == {"done"}
    assert all(len(webhook_posts(sandbox, f"wide-{i}")) == 1 for i in range(N))
    assert sandbox.meters("llm")["peak_concurrency"] >= N * 0.9  # all of them waited on the LLM together
    # bounded by the run's pools, not by the requests: its I/O threads, its call threads for the fast upstreams
    # (store, webhook, Slack), the heartbeat and Dagster's own; a thread per request would be 60 more
    bound = Drain.io_threads + Drain.call_threads + 6
    assert bound < N and grew[0] <= bound, grew


def test_llm_calls_in_flight_are_spread_over_small_connection_pools(sandbox) -> None:
    """httpcore's pool walks all its connections twice a request (encode/httpcore#1035): one pool holding 48
    connections cost 9.5 ms of CPU a request and capped a process near 100 requests/s. The loop's clients take
    the calls in turn, so 48 calls in flight open about 48 connections but no pool holds more than its share."""
    import asyncio
    import json
    import math

    from pydantic import BaseModel

    from redrive import aio
    from resources.http import POOLS, async_pools
    from resources.llm import LlmResource
    from tests.criticizer.conftest import CRITIQUE, sandbox_url

    class Verdict(BaseModel):
        verdict: str

    calls = 48
    sandbox.set_default("llm", content=json.dumps(CRITIQUE))
    sandbox.set_profile("llm", latency=1.0)
    llm = LlmResource(base_url=sandbox_url("/llm/v1"), api_key="k")

    async def all_at_once() -> tuple[list[str], list[int]]:
        try:
            verdicts = await asyncio.gather(*(llm.achat_json([{"role": "user", "content": f"critique {i}"}], Verdict)
                                              for i in range(calls)))
            held = [len(client._transport._pool.connections) for client in async_pools().clients]  # type: ignore[attr-defined]
            return [v.verdict for v in verdicts], held
        finally:
            await aio.close_loop_locals()

    verdicts, held = asyncio.run(all_at_once())
    assert verdicts == ["revise"] * calls
    assert sandbox.meters("llm")["peak_concurrency"] >= calls * 0.9  # they did wait on the LLM together
    assert len(held) == POOLS > 1 and sum(held) >= calls * 0.9
    assert max(held) <= math.ceil(calls / POOLS) + 1, held
