"""000's per-message flow, each branch driven through moto SQS, the sandbox LLM and PostgreSQL."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from assets.matching import repository
from assets.matching.policy import Action
from redrive.schema import alerts, dead_letters
from resources.llm import LlmResource
from resources.matching import ReceivedMessage
from tests.matching.conftest import (
    MATCH_FIRST,
    NO_MATCH,
    TENANT,
    Sleeps,
    doc,
    drop_messages,
    ingest,
    prepare,
    receive_one,
    row,
)

TRANSIENT_x3 = ({"status": 429, "headers": {"Retry-After": "1"}}, {"status": 503}, {"kind": "malformed"})


def two_documents(engine, queue) -> None:
    """d-1 already pre-processed (a candidate), d-2 on the queue to be matched against it."""
    ingest(engine, queue, doc("d-1"), doc("d-2", references=["INV-d-1", "PO-42"]))
    prepare(engine, "d-1")
    drop_messages(queue)
    queue.publish("d-2")


def dead_letter_rows(engine) -> list:
    with engine.connect() as conn:
        return conn.execute(sa.select(dead_letters).order_by(dead_letters.c.id)).all()


def test_success_marks_succeeded_writes_edge_and_deletes_message(engine, queue, sandbox, make_worker) -> None:
    """Success: one LLM call, the edge and cluster written, status succeeded, the message deleted."""
    two_documents(engine, queue)
    sandbox.set_default("llm", content=MATCH_FIRST)
    outcome = make_worker().handle(receive_one(queue))

    assert (outcome.action, outcome.deleted, outcome.llm_calls, outcome.edges) == (Action.SUCCEEDED, True, 1, 1)
    d2 = row(engine, "d-2")
    assert (d2["matching_status"], d2["matching_attempts"], d2["matching_error"]) == ("succeeded", 1, None)
    assert d2["normalized_counterparty"] == "acme" and d2["normalized_references"] == ["INVD1", "PO42"]
    with engine.connect() as conn:
        assert repository.edges_of(conn, TENANT) == [("d-1", "d-2")]
        assert repository.clusters_of(conn, TENANT) == {"d-1": "d-1", "d-2": "d-1"}
    depth = queue.depth()
    assert (depth.visible, depth.in_flight) == (0, 0)
    assert dead_letter_rows(engine) == [] and sandbox.count("slack.message") == 0


def test_empty_decision_is_a_success_not_a_failure(engine, queue, sandbox, make_worker) -> None:
    """`{"matches": []}` is a valid answer: succeeded with no edges, distinct from any failure."""
    two_documents(engine, queue)
    sandbox.set_default("llm", content=NO_MATCH)
    outcome = make_worker().handle(receive_one(queue))
    assert (outcome.action, outcome.llm_calls, outcome.edges) == (Action.SUCCEEDED, 1, 0)
    assert row(engine, "d-2")["matching_status"] == "succeeded"
    assert row(engine, "d-2")["cluster_id"] == "d-2"


def test_document_without_candidates_succeeds_without_asking_the_llm(engine, queue, sandbox, make_worker) -> None:
    """Nothing to compare with: no LLM call, succeeded, its own cluster."""
    ingest(engine, queue, doc("solo"))
    outcome = make_worker().handle(receive_one(queue))
    assert (outcome.action, outcome.llm_calls) == (Action.SUCCEEDED, 0)
    assert sandbox.count("llm.call") == 0
    assert row(engine, "solo")["cluster_id"] == "solo"


def test_in_process_retries_ride_out_429_and_503_within_one_delivery(engine, queue, sandbox, make_worker) -> None:
    """429 (Retry-After 1) and 503, then ok: 3 LLM calls, waits 2 s and 4 s with a visibility heartbeat
    before each, one delivery counted."""
    two_documents(engine, queue)
    sandbox.set_default("llm", content=MATCH_FIRST)
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "1"}}, {"status": 503})
    sleeps, heartbeats = Sleeps(), []
    worker = make_worker(sleep=sleeps)
    extend = queue.change_visibility
    worker.queue.change_visibility = lambda handle, seconds: (heartbeats.append(seconds), extend(handle, seconds))
    outcome = worker.handle(receive_one(queue))
    assert (outcome.action, outcome.llm_calls) == (Action.SUCCEEDED, 3)
    assert sleeps == [2.0, 4.0]
    assert heartbeats == [60, 60]  # before each wait the message is hidden for another visibility timeout
    assert row(engine, "d-2")["matching_attempts"] == 1  # deliveries, not LLM retries
    assert [r["step"] for r in sandbox.requests("llm")] == ["status:429", "status:503", "ok"]


def test_non_transient_401_fails_notifies_and_deletes(engine, queue, sandbox, make_worker) -> None:
    """401: no retry at all; failed with error and failed_at; one dead letter, Slack + email; message deleted."""
    two_documents(engine, queue)
    sandbox.script("llm", {"status": 401})
    sleeps = Sleeps()
    outcome = make_worker(sleep=sleeps).handle(receive_one(queue))

    assert (outcome.action, outcome.deleted, outcome.llm_calls, outcome.code) == (Action.FAILED, True, 1, "AUTH_DENIED")
    assert sleeps == []
    d2 = row(engine, "d-2")
    assert d2["matching_status"] == "failed" and d2["matching_failed_at"] is not None
    assert d2["matching_error"].startswith("AUTH_DENIED: upstream answered 401")
    assert queue.depth().visible == queue.depth().in_flight == 0
    [letter] = dead_letter_rows(engine)
    assert (letter.pipeline, letter.entity_ref, letter.tenant, letter.attempts) == ("matching", "d-2", TENANT, 1)
    [slack] = sandbox.effects("slack.message")
    text = slack["payload"]["text"]
    for expected in ("d-2", TENANT, "AUTH_DENIED", "attempts: 1", "https://admin.test/documents/d-2"):
        assert expected in text
    assert "sandbox-key" not in text and "Traceback" not in text
    assert sandbox.count("mail.send") == 1


def test_context_window_exceeded_is_non_transient(engine, queue, sandbox, make_worker) -> None:
    """A 400 context_length_exceeded fails at once (first delivery, one LLM call) and deletes the message."""
    two_documents(engine, queue)
    sandbox.script("llm", {"status": 400, "error_code": "context_length_exceeded"})
    outcome = make_worker().handle(receive_one(queue))
    assert (outcome.action, outcome.code, outcome.llm_calls) == (Action.FAILED, "CONTEXT_LENGTH_EXCEEDED", 1)
    assert row(engine, "d-2")["matching_status"] == "failed"


def test_403_is_non_transient(engine, queue, sandbox, make_worker) -> None:
    """403 is treated like 401: failed on the first call."""
    two_documents(engine, queue)
    sandbox.script("llm", {"status": 403})
    outcome = make_worker().handle(receive_one(queue))
    assert (outcome.action, outcome.code, outcome.llm_calls) == (Action.FAILED, "AUTH_DENIED", 1)


def test_schema_invalid_replies_are_transient(engine, queue, sandbox, make_worker) -> None:
    """Three schema-invalid replies: retried in process, then the message is hidden 5 min, not failed."""
    two_documents(engine, queue)
    sandbox.script("llm", *[{"kind": "schema_invalid"}] * 3)
    outcome = make_worker().handle(receive_one(queue))
    assert (outcome.action, outcome.code, outcome.llm_calls) == (Action.RETRY_LATER, "SCHEMA_INVALID", 3)
    assert outcome.visibility == 300
    assert row(engine, "d-2")["matching_status"] == "pending"


def test_connection_refused_is_transient(engine, queue, sandbox, make_worker) -> None:
    """An LLM endpoint that refuses connections: NETWORK_ERROR, retried, then a visibility step."""
    two_documents(engine, queue)
    dead = LlmResource(base_url="http://127.0.0.1:9/llm/v1", api_key="k", timeout_seconds=2)
    outcome = make_worker(llm=dead).handle(receive_one(queue))
    assert (outcome.action, outcome.code, outcome.llm_calls) == (Action.RETRY_LATER, "NETWORK_ERROR", 3)


def test_network_timeout_is_transient(engine, queue, sandbox, make_worker, scaled_settings) -> None:
    """The LLM holds the request past our timeout: NETWORK_TIMEOUT, retried, then a visibility step."""
    two_documents(engine, queue)
    sandbox.set_default("llm", content=MATCH_FIRST)
    sandbox.script("llm", {"kind": "timeout", "seconds": 2})
    impatient = LlmResource(base_url=scaled_settings.llm_url or "", api_key="k", timeout_seconds=0.3)
    sleeps = Sleeps()
    outcome = make_worker(llm=impatient, sleep=sleeps).handle(receive_one(queue))
    assert outcome.action is Action.SUCCEEDED and outcome.llm_calls == 2 and sleeps == [2.0]


def test_transient_three_deliveries_5min_30min_then_failed_and_dlq(engine, queue, sandbox, make_worker) -> None:
    """Transient on every delivery: visibility 300 s, then 1800 s, then failed + alert, message kept → DLQ."""
    two_documents(engine, queue)
    worker = make_worker()

    sandbox.script("llm", *TRANSIENT_x3)
    first = receive_one(queue)
    out1 = worker.handle(first)
    assert (out1.receive_count, out1.action, out1.visibility, out1.deleted) == (1, Action.RETRY_LATER, 300, False)
    d2 = row(engine, "d-2")
    assert (d2["matching_status"], d2["matching_attempts"]) == ("pending", 1)
    assert d2["matching_error"].startswith("PARSE_ERROR")  # the last error: the third call's malformed body
    assert (queue.depth().visible, queue.depth().in_flight) == (0, 1)  # hidden by ChangeMessageVisibility
    assert queue.receive(1, 0) == []
    queue.change_visibility(first.receipt_handle, 0)  # five minutes pass

    sandbox.script("llm", *TRANSIENT_x3)
    second = receive_one(queue)
    out2 = worker.handle(second)
    assert (out2.receive_count, out2.action, out2.visibility) == (2, Action.RETRY_LATER, 1800)
    assert row(engine, "d-2")["matching_attempts"] == 2
    assert queue.receive(1, 0) == []
    queue.change_visibility(second.receipt_handle, 0)  # thirty minutes pass

    sandbox.script("llm", *TRANSIENT_x3)
    third = receive_one(queue)
    out3 = worker.handle(third)
    assert (out3.receive_count, out3.action, out3.deleted) == (3, Action.LEFT_FOR_DLQ, False)
    d2 = row(engine, "d-2")
    assert (d2["matching_status"], d2["matching_attempts"]) == ("failed", 3)
    assert d2["matching_failed_at"] is not None and d2["matching_error"].startswith("PARSE_ERROR")

    assert queue.receive(1, 0) == []  # this receive is where SQS applies the redrive policy
    [in_dlq] = queue.receive(1, 0, dlq=True)
    assert json.loads(in_dlq.body) == {"document_id": "d-2"} and in_dlq.message_id == first.message_id
    assert queue.depth().visible == queue.depth().in_flight == 0
    [letter] = dead_letter_rows(engine)
    assert (letter.entity_ref, letter.attempts, letter.error_class) == ("d-2", 3, "PARSE_ERROR")
    assert sandbox.count("slack.message") == 1 and sandbox.count("mail.send") == 1
    assert sandbox.count("llm.call") == 0  # every call failed before the sandbox produced a completion


def test_transient_then_success_on_redelivery(engine, queue, sandbox, make_worker) -> None:
    """Delivery 1 fails transiently, delivery 2 succeeds: succeeded, attempts 2, message deleted, no alert."""
    two_documents(engine, queue)
    sandbox.set_default("llm", content=MATCH_FIRST)
    worker = make_worker()
    sandbox.script("llm", {"status": 500}, {"status": 502}, {"status": 504})
    first = receive_one(queue)
    assert worker.handle(first).action is Action.RETRY_LATER
    queue.change_visibility(first.receipt_handle, 0)
    out = worker.handle(receive_one(queue))
    assert (out.action, out.receive_count, out.deleted) == (Action.SUCCEEDED, 2, True)
    d2 = row(engine, "d-2")
    assert (d2["matching_status"], d2["matching_attempts"]) == ("succeeded", 2)
    assert dead_letter_rows(engine) == [] and sandbox.count("slack.message") == 0
    assert queue.depth().visible == queue.depth().in_flight == 0


def test_malformed_message_is_moved_to_dlq_and_dead_lettered(engine, queue, sandbox, make_worker) -> None:
    """A body that is not {"document_id": …}: kept in the DLQ (body intact), one dead letter, one alert."""
    queue.client.send_message(QueueUrl=queue.url, MessageBody='{"doc": 17}')
    outcome = make_worker().handle(receive_one(queue))
    assert (outcome.action, outcome.code, outcome.deleted) == (Action.QUARANTINED, "DATA_ERROR", True)
    [kept] = queue.receive(1, 0, dlq=True)
    assert kept.body == '{"doc": 17}'
    [letter] = dead_letter_rows(engine)
    assert letter.entity_ref == f"sqs-message:{outcome.message_id}" and letter.stage == "receive"
    assert sandbox.count("slack.message") == 1


def test_unknown_document_fails_as_not_found(engine, queue, sandbox, make_worker) -> None:
    """A message for a document that does not exist: NOT_FOUND, dead letter + alert, message deleted."""
    queue.publish("ghost-1")
    outcome = make_worker().handle(receive_one(queue))
    assert (outcome.action, outcome.code, outcome.deleted) == (Action.FAILED, "NOT_FOUND", True)
    [letter] = dead_letter_rows(engine)
    assert letter.entity_ref == "ghost-1"
    assert queue.depth().visible == queue.depth().in_flight == 0


def test_drain_processes_a_batch_and_stops_when_empty(engine, queue, sandbox, make_worker) -> None:
    """`drain` receives batches until the queue is empty; a 401 and successes in the same batch."""
    ingest(engine, queue, *[doc(f"b-{i}") for i in range(4)])
    sandbox.set_default("llm", content=NO_MATCH)
    report = make_worker().drain(max_batches=10)
    assert report.counts == {"succeeded": 4}
    with engine.connect() as conn:
        assert repository.status_counts(conn, [f"b-{i}" for i in range(4)]) == {"succeeded": 4}
    assert queue.depth().visible == queue.depth().in_flight == 0


def test_sqs_refusing_the_delete_after_success_leaves_the_message_for_an_idempotent_redelivery(
        engine, queue, sandbox, make_worker) -> None:
    """A stale receipt handle: the document stays succeeded, the message comes back, the redelivery is harmless."""
    two_documents(engine, queue)
    sandbox.set_default("llm", content=MATCH_FIRST)
    real = receive_one(queue)
    stale = ReceivedMessage(real.message_id, "stale-receipt-handle", real.body, real.receive_count)
    worker = make_worker()
    first = worker.handle(stale)
    assert (first.action, first.deleted) == (Action.SUCCEEDED, False)
    queue.change_visibility(real.receipt_handle, 0)  # SQS hands it out again
    again = worker.handle(receive_one(queue))
    assert (again.action, again.deleted) == (Action.SUCCEEDED, True)
    with engine.connect() as conn:
        assert repository.edges_of(conn, TENANT) == [("d-1", "d-2")]
    assert row(engine, "d-2")["matching_attempts"] == 2


def test_alert_only_once_per_failed_document(engine, queue, sandbox, make_worker) -> None:
    """A duplicate delivery that fails the same way adds an occurrence, not a second alert."""
    two_documents(engine, queue)
    queue.publish("d-2")  # SQS at-least-once: the same document twice
    sandbox.script("llm", {"status": 401}, {"status": 401})
    worker = make_worker()
    report = worker.drain(max_batches=5)
    assert report.counts == {"failed": 2}
    [letter] = dead_letter_rows(engine)
    assert letter.occurrences == 2
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(alerts)).scalar() == 1



def budgeted_llm(engine, queue, sandbox, **limits):  # type: ignore[no-untyped-def]
    """d-2 on the queue, its first LLM call answered 503, and the LLM's limiter (its retry budget `limits`) on a
    frozen clock that the returned sleep advances, as the worker's waits would."""
    from datetime import UTC, datetime

    from redrive import upstreams as up
    from redrive.clock import FrozenClock

    two_documents(engine, queue)
    sandbox.set_default("llm", content=MATCH_FIRST)
    sandbox.script("llm", {"status": 503})
    clock = FrozenClock(datetime(2026, 11, 28, 12, 0, tzinfo=UTC))
    sleeps = Sleeps()

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.advance(seconds)

    return up.Upstreams(engine, {"llm": up.UpstreamLimits(**limits)}, clock=clock, sleep=sleep), sleep, sleeps, clock


def test_an_llm_retry_over_the_budget_waits_in_process_and_spends_no_attempt(engine, queue, sandbox,
                                                                            make_worker) -> None:
    """The LLM's retry budget (issue 26 §4) has room for one failing retry in 10 s and another entity spent it:
    d-2's first call fails (503), its in-process retry is held back before anything is sent, the message kept
    hidden, and goes once the window has room. One delivery, two LLM requests, no attempt spent on the hold."""
    import httpx

    from redrive import upstreams as up

    budget, sleep, sleeps, clock = budgeted_llm(engine, queue, sandbox, retry_share=0.0, retry_floor_per_second=0.1,
                                                retry_window_seconds=10)

    def down() -> None:
        raise httpx.ConnectError("the upstream is down")

    worker = make_worker(sleep=sleep)
    heartbeats: list[int] = []
    extend = queue.change_visibility
    worker.queue.change_visibility = lambda handle, seconds: (heartbeats.append(seconds), extend(handle, seconds))
    up.install(budget)
    try:
        with up.retrying(), pytest.raises(httpx.ConnectError):
            budget.call("llm", down)  # another entity's failing retry spends the window's one
        outcome = worker.handle(receive_one(queue))
    finally:
        up.install(None)
    assert (outcome.action, outcome.llm_calls) == (Action.SUCCEEDED, 2)
    assert [r["step"] for r in sandbox.requests("llm")] == ["status:503", "ok"]
    assert sleeps[0] == 2.0 and len(sleeps) >= 2 and sum(sleeps) >= 10 - 2  # the backoff, then the hold(s)
    assert len(heartbeats) == len(sleeps)  # the message kept hidden before every wait
    assert row(engine, "d-2")["matching_attempts"] == 1 and dead_letter_rows(engine) == []
    with engine.connect() as conn:
        assert up.states(conn, clock.now())[0].retries_denied == len(sleeps) - 1


def test_a_retry_budget_that_stays_spent_hands_the_document_to_the_visibility_step(engine, queue, sandbox,
                                                                                  make_worker) -> None:
    """No room for any retry (share 0, floor 0): the retry after the 503 is held MAX_HOLDS times, never sent,
    then the delivery ends as a transient failure and 000's first visibility step (5 min) takes over."""
    from assets.matching.worker import MAX_HOLDS
    from redrive import upstreams as up

    budget, sleep, sleeps, _ = budgeted_llm(engine, queue, sandbox, retry_share=0.0, retry_floor_per_second=0.0)
    worker = make_worker(sleep=sleep)
    up.install(budget)
    try:
        outcome = worker.handle(receive_one(queue))
    finally:
        up.install(None)
    assert (outcome.action, outcome.visibility, outcome.llm_calls) == (Action.RETRY_LATER, 300, 1)
    assert [r["step"] for r in sandbox.requests("llm")] == ["status:503"]
    assert len(sleeps) == 1 + MAX_HOLDS  # the backoff, then each hold
    assert row(engine, "d-2")["matching_status"] == "pending" and dead_letter_rows(engine) == []
