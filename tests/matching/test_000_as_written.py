"""Issue 13 item 11, 000 as written: fixed visibility steps, no demotion of a succeeded document, and a
context-window error named by its words — each through moto SQS, the sandbox LLM over HTTP and PostgreSQL."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from assets.matching import repository
from assets.matching.policy import Action
from redrive.schema import dead_letters
from tests.matching.conftest import MATCH_FIRST, TENANT, Sleeps, receive_one, row
from tests.matching.test_flow import two_documents


def recording_visibility(worker) -> list[int]:
    """Every ChangeMessageVisibility the worker sends, in seconds, still sent to moto."""
    calls: list[int] = []
    real = worker.queue.change_visibility
    worker.queue.change_visibility = lambda handle, seconds: (calls.append(seconds), real(handle, seconds))[1]
    return calls


def test_long_retry_after_ends_in_process_retries_and_keeps_the_fixed_steps(engine, queue, sandbox,
                                                                             make_worker) -> None:
    """A 429 asking for 1000 s: no in-process wait or second call; the message is hidden 300 s (not 1000),
    and on the second delivery 1800 s (not 3000)."""
    two_documents(engine, queue)
    sandbox.set_default("llm", content=MATCH_FIRST)
    sleeps = Sleeps()
    worker = make_worker(sleep=sleeps)
    visibility = recording_visibility(worker)

    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "1000"}})
    first = receive_one(queue)
    out1 = worker.handle(first)
    assert (out1.action, out1.code, out1.llm_calls, out1.visibility) == (Action.RETRY_LATER, "RATE_LIMITED", 1, 300)
    assert sleeps == [] and visibility == [300]
    assert (queue.depth().visible, queue.depth().in_flight) == (0, 1)
    assert row(engine, "d-2")["matching_status"] == "pending"
    queue.client.change_message_visibility(QueueUrl=queue.url, ReceiptHandle=first.receipt_handle,
                                           VisibilityTimeout=0)  # five minutes pass

    sandbox.script("llm", {"status": 503, "headers": {"Retry-After": "3000"}})
    out2 = worker.handle(receive_one(queue))
    assert (out2.receive_count, out2.action, out2.llm_calls, out2.visibility) == (2, Action.RETRY_LATER, 1, 1800)
    assert sleeps == [] and visibility == [300, 1800]


def test_short_retry_after_is_still_waited_in_process(engine, queue, sandbox, make_worker) -> None:
    """A Retry-After the in-process backoff honours (15 s ≤ 20 s) stretches the wait and the call is retried."""
    two_documents(engine, queue)
    sandbox.set_default("llm", content=MATCH_FIRST)
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "15"}})
    sleeps = Sleeps()
    outcome = make_worker(sleep=sleeps).handle(receive_one(queue))
    assert (outcome.action, outcome.llm_calls) == (Action.SUCCEEDED, 2)
    assert sleeps == [15.0]


def test_transient_failure_of_a_duplicate_delivery_never_demotes_a_succeeded_document(
        engine, queue, sandbox, make_worker) -> None:
    """SQS delivers d-2 twice; the first succeeds, the second fails transiently: d-2 stays succeeded with its
    edge, the duplicate is deleted, no dead letter, no alert."""
    two_documents(engine, queue)
    queue.publish("d-2")  # at-least-once: a second copy
    sandbox.set_default("llm", content=MATCH_FIRST)
    worker = make_worker()
    first, second = queue.receive(2, 0)
    assert worker.handle(first).action is Action.SUCCEEDED

    sandbox.script("llm", {"status": 503}, {"status": 503}, {"status": 503})
    out = worker.handle(second)
    assert (out.action, out.code, out.deleted) == (Action.DUPLICATE, "UPSTREAM_UNAVAILABLE", True)
    d2 = row(engine, "d-2")
    assert (d2["matching_status"], d2["matching_attempts"]) == ("succeeded", 2)
    with engine.connect() as conn:
        assert repository.edges_of(conn, TENANT) == [("d-1", "d-2")]
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar() == 0
    assert (queue.depth().visible, queue.depth().in_flight) == (0, 0)
    assert sandbox.count("slack.message") == 0


OPENAI_WORDS = {"error": {"message": "This model's maximum context length is 8192 tokens. However, your messages "
                                     "resulted in 9120 tokens. Please reduce the length of the messages.",
                          "type": "invalid_request_error", "param": "messages", "code": None}}
ANTHROPIC_WORDS = {"type": "error", "error": {"type": "invalid_request_error",
                                              "message": "prompt is too long: 210000 tokens > 200000 maximum"}}


@pytest.mark.parametrize("body", [OPENAI_WORDS, ANTHROPIC_WORDS], ids=["openai", "anthropic"])
def test_context_window_error_is_recognised_by_its_message_alone(engine, queue, sandbox, make_worker, body) -> None:
    """A 400 whose body has no error code, only words about the context window: CONTEXT_LENGTH_EXCEEDED,
    non-transient (one call, failed, message deleted), not a generic BAD_REQUEST."""
    two_documents(engine, queue)
    sandbox.script("llm", {"status": 400, "json": body})
    outcome = make_worker().handle(receive_one(queue))
    assert (outcome.action, outcome.code, outcome.llm_calls, outcome.deleted) == (
        Action.FAILED, "CONTEXT_LENGTH_EXCEEDED", 1, True)
    assert row(engine, "d-2")["matching_error"].startswith("CONTEXT_LENGTH_EXCEEDED")


def test_a_plain_bad_request_stays_a_bad_request(engine, queue, sandbox, make_worker) -> None:
    """The words test does not catch every 400: an unrelated message stays BAD_REQUEST."""
    two_documents(engine, queue)
    sandbox.script("llm", {"status": 400, "json": {"error": {"message": "Unknown parameter: 'temprature'.",
                                                             "type": "invalid_request_error", "code": None}}})
    outcome = make_worker().handle(receive_one(queue))
    assert (outcome.action, outcome.code) == (Action.FAILED, "BAD_REQUEST")
