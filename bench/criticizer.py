"""What the criticizer's reliability costs per request, and what replay-from-failed-stage saves.

    python -m bench criticizer                                  # under the bench stack (make bench runs all)
    BENCH_CRITICIZER_REQUESTS=5 python -m bench criticizer      # smaller

Baseline (same session, same sandbox and PostgreSQL): for each request, the three calls a bare
script would make — GET the artifact, POST the LLM, POST the webhook — with no Dagster, no
checkpoints, no classification. Measured against it:
- **drain**: the same number of requests through one drain run of `criticizer_job` (one in-process
  Dagster run for all of them: claims, a checkpoint per stage, delivery records, the request row),
  with 8 requests in flight and with 1;
- **replay, failed stage** vs **replay, full restart**: requests dead-lettered at llm (a 401), then
  replayed — half from the failed stage (fetch reused from its checkpoint), half `--from-start`,
  each half in one drain run — comparing time and artifact bytes fetched.
Artifacts are 256 KiB so the fetch is not free. Medians per request are reported, with ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid
from typing import Any

import dagster as dg
import sqlalchemy as sa

from assets.criticizer import api, pipeline, policy
from bench._support import scratch_database
from devstack.sandbox import SandboxClient
from orchestration.definitions import build_definitions
from redrive import deadletters
from redrive.clock import SystemClock
from redrive.db import engine_for
from resources.database import resolve_database_url
from redrive.settings import Settings

ARTIFACT_BYTES = 256 * 1024
CRITIQUE = {"verdict": "approve", "score": 8, "summary": "Fine.", "findings": []}


def _submit(engine: sa.Engine, sandbox: SandboxClient, request_id: str) -> str:
    path = f"bench/criticizer/{request_id}.txt"
    sandbox.put_store(path, (request_id.encode() + b"\n") * (ARTIFACT_BYTES // (len(request_id) + 1)), "text/plain")
    api.submit(engine, {"request_id": request_id, "artifact_url": f"{sandbox.base_url}/store/{path}",
                        "rubric": "Is it fine?", "webhook_url": f"{sandbox.base_url}/slack/webhook/bench/{request_id}"})
    return request_id


def _baseline(defs: dg.Definitions, sandbox: SandboxClient, request_id: str) -> float:
    http, llm = defs.resources["criticizer_http"], defs.resources["llm"]
    started = time.perf_counter()
    body = http.fetch_artifact(f"{sandbox.base_url}/store/bench/criticizer/{request_id}.txt")
    messages = policy.critique_messages("Is it fine?", "artifact", body.decode())
    critique = llm.chat_json(messages, policy.Critique).model_dump(mode="json")
    http.post_webhook(f"{sandbox.base_url}/slack/webhook/bench/{request_id}",
                      policy.webhook_payload(request_id, "artifact", critique, "0" * 64), {})
    return time.perf_counter() - started


def _drain(defs: dg.Definitions, instance: dg.DagsterInstance, concurrency: int) -> tuple[float, dict[str, Any]]:
    """One drain run of the criticizer job over whatever is due; its wall time and counts."""
    job = defs.resolve_job_def("criticizer_job")
    config = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}},
              "ops": {"criticizer_drain": {"config": {"concurrency": concurrency, "linger_seconds": 0.5}}}}
    started = time.perf_counter()
    result = job.execute_in_process(run_config=config, instance=instance, raise_on_error=False)
    assert result.success, "drain run failed"
    return time.perf_counter() - started, result.output_for_node("criticizer_drain")


def _fetched_bytes(sandbox: SandboxClient, request_ids: list[str]) -> int:
    wanted = {f"bench/criticizer/{r}.txt" for r in request_ids}
    return sum(1 for e in sandbox.effects("store.fetch") if e.get("path") in wanted) * ARTIFACT_BYTES


def main(n: int | None = None) -> int:
    """A database of its own on the bench server, so other work on the shared one cannot touch its rows."""
    n = n or int(os.environ.get("BENCH_CRITICIZER_REQUESTS", "20"))
    session = uuid.uuid4().hex[:6]
    with scratch_database(f"bench_criticizer_{session}") as url:
        return _measure(n, session, Settings(database_url=url, redrive_time_scale=0.001))


def _measure(n: int, session: str, settings: Settings) -> int:
    engine = engine_for(resolve_database_url(settings))
    sandbox = SandboxClient(os.environ["SANDBOX_URL"])
    sandbox.set_default("llm", content=json.dumps(CRITIQUE))
    defs = build_definitions(settings)
    with dg.instance_for_test() as instance:
        warm = _submit(engine, sandbox, f"bench-{session}-warm")
        _baseline(defs, sandbox, warm)  # warm connections and caches
        _drain(defs, instance, 1)
        base, piped, piped_1 = [], [], []
        for r in range(3):  # alternate, so drift in the machine's load hits all alike
            ids = [_submit(engine, sandbox, f"bench-{session}-{r}-{i}") for i in range(n)]
            started = time.perf_counter()
            for request_id in ids:
                _baseline(defs, sandbox, request_id)
            base.append((time.perf_counter() - started) / n)
            seconds, counts = _drain(defs, instance, 8)
            assert counts["done"] == n, counts
            piped.append(seconds / n)
            ids = [_submit(engine, sandbox, f"bench-{session}-{r}-c1-{i}") for i in range(n)]
            seconds, counts = _drain(defs, instance, 1)
            assert counts["done"] == n, counts
            piped_1.append(seconds / n)

        # replays: dead-letter 2n requests at llm, replay half from the failed stage, half from the start
        failing = [_submit(engine, sandbox, f"bench-{session}-dl-{i}") for i in range(2 * n)]
        sandbox.script("llm", *[{"status": 401}] * len(failing))
        assert _drain(defs, instance, 8)[1]["dead_lettered"] == len(failing)
        timings: dict[str, list[float]] = {"failed_stage": [], "start": []}
        groups = {"failed_stage": failing[0::2], "start": failing[1::2]}
        before = {mode: _fetched_bytes(sandbox, group) for mode, group in groups.items()}
        for mode, group in groups.items():
            with engine.begin() as conn:
                for request_id in group:
                    letter = deadletters.active_for(conn, pipeline.PIPELINE, request_id)
                    assert letter is not None
                    deadletters.request_replay(conn, letter.id, evidence="bench", confirm_safe=True,
                                               at=SystemClock().now(), from_start=mode == "start")
            seconds, counts = _drain(defs, instance, 8)  # one drain run works every replayed request
            assert counts["done"] == len(group), counts
            timings[mode].append(seconds / len(group))
        fetched = {mode: _fetched_bytes(sandbox, group) - before[mode] for mode, group in groups.items()}
        runs = len(instance.get_runs())

    med = {k: statistics.median(v) * 1000 for k, v in
           {"baseline": base, "pipeline": piped, "pipeline_1": piped_1, **{f"replay_{m}": t for m, t in timings.items()}}.items()}
    print(f"criticizer: {n} requests, {ARTIFACT_BYTES // 1024} KiB artifacts, median ms per request")
    print(f"  baseline (3 bare HTTP calls)      {med['baseline']:8.1f} ms")
    ratio = med["pipeline"] / med["baseline"]
    print(f"  drain run, 8 in flight            {med['pipeline']:8.1f} ms   ×{ratio:.2f} baseline")
    print(f"  drain run, 1 in flight            {med['pipeline_1']:8.1f} ms   "
          f"×{med['pipeline_1'] / med['baseline']:.2f} baseline")
    print(f"  Dagster runs for {6 * n + 2 * n + 1} requests and {2 * n} replays: {runs}")
    print(f"  replay from failed stage          {med['replay_failed_stage']:8.1f} ms   "
          f"{fetched['failed_stage'] // 1024} KiB fetched")
    print(f"  replay full restart               {med['replay_start']:8.1f} ms   "
          f"{fetched['start'] // 1024} KiB fetched")
    print(f"  failed-stage / full-restart time  ×{med['replay_failed_stage'] / med['replay_start']:.2f}; "
          f"artifact bytes re-fetched: {fetched['failed_stage']} vs {fetched['start']}")
    return 0


if __name__ == "__main__":
    from devstack.stack import local_stack

    with local_stack("bench"):
        raise SystemExit(main())
