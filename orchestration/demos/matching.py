"""Matching demo: documents of one tenant through the SQS worker, with faults scripted in the sandbox LLM.

1. set-up creates the queue pair; ingestion publishes; the queue sensor starts the drain runs (the daemon's ticks,
   or ticks by hand in process) until the documents are settled;
2. a 429 and a 503 are ridden out by in-process retries (2 s → 4 s, × the demo's time scale);
3. a 401 fails a document at once: dead letter + Slack/email alert, message deleted;
4. 503s on every call of three deliveries: visibility steps, then failed + alert, message in the DLQ
   (MATCHING_VISIBILITY_SCALE shrinks the 5/30 minute steps to 1 s/2 s);
5. a crashed worker's document is alerted by the stuck detector, re-queued by the operator;
6. the 401 is replayed with `redrive dlq replay`'s API after "rotating the key" and resolves.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import dagster as dg

from assets.matching import ingestion, repository
from assets.matching.policy import PIPELINE
from redrive import deadletters
from redrive.clock import SystemClock
from sensors.matching import ACTIVE

MATCH_FIRST = json.dumps({"matches": [{"candidate": 1, "confidence": 0.91, "reason": "same purchase order"}]})
QUEUE_SENSOR = "matching_queue_sensor"
DRAIN_STEP = "drain_matching_queue"
COUNTS = ("succeeded", "failed", "retry_later", "left_for_dlq")  # a drain's outcome counts in its metadata
# The deployed code location's knobs for the demo's pace: 5/30 min visibility steps as 1 s/2 s, stuck checks every 5 s.
DEPLOYMENT_ENV = {"MATCHING_VISIBILITY_SCALE": "0.001", "MATCHING_STUCK_SENSOR_INTERVAL_SECONDS": "5"}
THROUGH_DAEMON = True  # under the topology the daemon's ticks of the queue sensor start the drain runs
SETTLE_SECONDS = 300


class Drained(NamedTuple):
    counts: dict[str, int]  # the drains' outcomes
    calls: int  # LLM calls they made
    runs: int  # drain runs the queue sensor started


def _drain_until(ctx, settled: Callable[[], bool]) -> Drained:
    """Tick the queue sensor until `settled`; what the drain runs it started did: their outcome counts and LLM
    calls, read from each run's event log (so the same in process and under the daemon)."""
    runs: list[Any] = []
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        runs += ctx.tick(QUEUE_SENSOR)
        assert all(r.success for r in runs), "a matching drain run failed"
        if settled():
            break
        assert time.monotonic() < deadline, f"matching: not settled after {SETTLE_SECONDS}s"
        time.sleep(0.2)  # a visibility step not yet over: the next tick drains it
    counts: Counter[str] = Counter()
    calls = 0
    for run in runs:
        reported = ctx.metadata_of(run, DRAIN_STEP)
        counts.update({k: int(reported[k]) for k in COUNTS if reported.get(k)})
        calls += int(reported.get("llm_calls", 0))
    return Drained(dict(counts), calls, len(runs))


def _idle(ctx) -> None:
    """Wait until no drain run is active (one the daemon started after the demo's last tick may still poll)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while ctx.instance.get_runs(filters=dg.RunsFilter(job_name="matching_drain_job", statuses=ACTIVE), limit=1):
        assert time.monotonic() < deadline, "a matching drain run is still active"
        time.sleep(0.5)


def run_demo(ctx):  # -> orchestration.demo.DemoReport
    from orchestration.demo import DemoReport

    report = DemoReport(PIPELINE)
    tenant = f"demo-{ctx.session}"
    ids = {k: f"{tenant}-{k}" for k in ("po-1001", "inv-1001", "dn-1001", "inv-3003", "inv-4004", "inv-5005")}
    matching = ctx.defs.resources["matching"]
    queue = matching.queue()

    marker = f"[matching {tenant}]"  # in each text, so in every prompt about it: the LLM faults are its own

    def document(key: str, doc_type: str, refs: list[str], text: str) -> dict[str, Any]:
        return {"id": ids[key], "tenant": tenant, "doc_type": doc_type, "counterparty": "ACME GmbH",
                "references": refs, "amount": "1200.00", "currency": "EUR", "document_date": "2026-02-20",
                "text": f"{text} {marker}"}

    def status_is(wanted: dict[str, str]) -> Callable[[], bool]:
        def settled() -> bool:
            with ctx.engine.connect() as conn:
                found = {key: (repository.get(conn, ids[key]) or {}).get("matching_status") for key in wanted}
            return found == wanted
        return settled

    def in_dlq(key: str) -> bool:
        return ids[key] in [json.loads(m.body).get("document_id")
                            for m in queue.receive(10, 0, dlq=True, visibility_timeout=0)]

    def script_llm(*steps: dict[str, Any]) -> None:
        ctx.sandbox.script("llm", *steps, match=marker)

    assert ctx.run("matching_setup_job").success, "queue set-up failed"
    ctx.sandbox.set_default("llm", content=MATCH_FIRST, when=marker)

    # 1. the first document: no candidates yet, no LLM call; the queue sensor requests the drain
    ingestion.ingest(ctx.engine, queue, [document("po-1001", "purchase_order", ["PO-1001"], "40 steel beams")])
    drained = [_drain_until(ctx, status_is({"po-1001": "succeeded"}))]
    assert drained[-1].counts == {"succeeded": 1}, f"first drain: {drained[-1]}"

    # 2. invoice and delivery note for that order; the LLM answers 429 then 503 first
    script_llm({"status": 429, "headers": {"Retry-After": "2"}}, {"status": 503})
    ingestion.ingest(ctx.engine, queue, [
        document("inv-1001", "invoice", ["INV-1001", "PO-1001"], "invoice for 40 steel beams"),
        document("dn-1001", "delivery_note", ["DN-1001", "PO-1001"], "delivered 40 steel beams"),
    ])
    drained.append(_drain_until(ctx, status_is({"inv-1001": "succeeded", "dn-1001": "succeeded"})))
    counts, calls, _ = drained[-1]
    assert counts == {"succeeded": 2} and calls == 4, f"retry drain: {counts}, {calls} LLM calls"
    with ctx.engine.connect() as conn:
        clusters = repository.clusters_of(conn, tenant)
        assert len({clusters[ids[k]] for k in ("po-1001", "inv-1001", "dn-1001")}) == 1
        assert repository.cluster_inconsistencies(conn, tenant) == []
    report.done += 3
    report.retried += calls - 2
    report.notes.append(f"{ids['inv-1001']}, {ids['dn-1001']}: 429 (Retry-After 2) and 503 retried in process; "
                        f"matched with {ids['po-1001']} into one cluster")

    # 3. a 401: non-transient, failed at once
    script_llm({"status": 401})
    ingestion.ingest(ctx.engine, queue, [document("inv-3003", "invoice", ["INV-3003"], "steel beams, second lot")])
    drained.append(_drain_until(ctx, status_is({"inv-3003": "failed"})))
    assert drained[-1].counts == {"failed": 1}, drained[-1]
    with ctx.engine.connect() as conn:
        denied = deadletters.active_for(conn, PIPELINE, ids["inv-3003"])
    assert denied is not None and denied.error_class == "AUTH_DENIED"
    report.dead_lettered += 1

    # 4. 503 on every call of three deliveries: 5 min → 30 min visibility (1 s → 2 s here), then the DLQ
    script_llm(*[{"status": 503}] * 9)
    ingestion.ingest(ctx.engine, queue, [document("inv-4004", "invoice", ["INV-4004"], "steel beams, third lot")])
    # failed after its third delivery; SQS moves the message to the DLQ at the next receive (the next drain's)
    drained.append(_drain_until(ctx, lambda: status_is({"inv-4004": "failed"})() and in_dlq("inv-4004")))
    counts, calls, _ = drained[-1]
    assert counts == {"retry_later": 2, "left_for_dlq": 1} and calls == 9, f"DLQ drain: {counts}, {calls}"
    with ctx.engine.connect() as conn:
        parked = repository.get(conn, ids["inv-4004"])
    assert parked and (parked["matching_status"], parked["matching_attempts"]) == ("failed", 3)
    report.retried += 6 + 2  # in-process retries (2 per delivery) and two SQS redeliveries
    report.dead_lettered += 1
    report.notes.append(f"{ids['inv-4004']}: 3 deliveries × 3 LLM attempts of 503, visibility 1 s then 2 s "
                        "(5/30 min scaled), failed + alert, message in the DLQ")

    # 5. a worker crashed mid-delivery 11 minutes ago: the stuck detector alerts once; the operator re-queues
    _idle(ctx)  # no drain still polling, so the "crashed worker" below is the one that takes the message
    ingestion.ingest(ctx.engine, queue, [document("inv-5005", "invoice", ["INV-5005"], "steel beams, fourth lot")])
    [taken] = queue.receive(1, 0)  # the crashed worker took the message on its last delivery …
    queue.delete(taken.receipt_handle)  # … and it is gone (in production: in the DLQ)
    with ctx.engine.begin() as conn:
        repository.mark_in_progress(conn, ids["inv-5005"], SystemClock().now() - timedelta(minutes=11))
    ctx.tick("matching_stuck_documents")
    ctx.tick("matching_stuck_documents")  # a second tick: no second alert
    requeue = {"ops": {"requeue_for_matching": {"config": {"document_ids": [ids["inv-5005"]]}}}}
    assert ctx.run("matching_requeue_job", run_config=requeue).success
    drained.append(_drain_until(ctx, status_is({"inv-5005": "succeeded"})))

    # 6. the LLM key is rotated; the 401 is replayed through the dead-letter replay sensor
    with ctx.engine.begin() as conn:
        deadletters.request_replay(conn, denied.id, evidence="DEMO-6: LLM API key rotated", confirm_safe=True,
                                   at=SystemClock().now(), operator="demo")
    replays = [r for r in ctx.tick("redrive_dead_letter_replays")  # (other letters may be replaying too)
               if str(denied.id) in r.dagster_run.tags.get("redrive/replay_of", "").split(",")]
    assert replays and all(r.success for r in replays), "replay run failed"
    drained.append(_drain_until(ctx, status_is({"inv-3003": "succeeded"})))
    assert drained[-1].counts == {"succeeded": 1}, drained[-1]
    with ctx.engine.connect() as conn:
        closed = deadletters.get(conn, denied.id)
        statuses = repository.status_counts(conn, ids.values())
    assert closed is not None and closed.status == "resolved"
    assert statuses == {"succeeded": 5, "failed": 1}, statuses
    report.done += 2
    report.notes.append(f"{ids['inv-3003']}: 401 → failed, dead letter {denied.id} + alert, message deleted; "
                        f"replayed after the key rotation → {closed.status}")
    report.notes.append(f"{ids['inv-5005']}: in-progress 11 min (crashed worker) → one stuck alert; re-queued → done")
    report.notes.append(f"{sum(d.runs for d in drained)} drain runs, each started by a tick of the queue sensor")
    return report
