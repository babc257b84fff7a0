"""Issue 14, matching at speed: batch calls to SQS, one mark per received batch, parallel receivers —
each through moto SQS, the sandbox LLM and PostgreSQL, with 000's per-delivery behaviour unchanged."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.exceptions import ClientError

from assets.matching import repository
from assets.matching.policy import Action
from assets.matching.worker import WorkerConfig
from resources.matching import GroupCommit
from tests.matching.conftest import NO_MATCH, doc, drop_messages, ingest, row


def test_deletes_waiting_behind_a_call_leave_together_and_a_stale_handle_fails_alone(queue) -> None:
    """The first delete goes alone; the nine that arrive while it is in flight go out in one
    DeleteMessageBatch, where a stale receipt handle fails for its own caller only."""
    for i in range(9):
        queue.publish(f"g-{i}")
    handles = [m.receipt_handle for m in queue.receive(10, 0)] + [m.receipt_handle for m in queue.receive(10, 0)]
    assert len(handles) == 9
    handles.append("stale-receipt-handle")
    client, url = queue.client, queue.url
    batches: list[int] = []
    others_waiting = threading.Event()
    group: GroupCommit

    def single(fields: dict) -> None:
        others_waiting.wait(timeout=30)  # hold the first call until the other nine queue up behind it
        client.delete_message(QueueUrl=url, **fields)

    def batch(entries: list[dict]) -> dict:
        batches.append(len(entries))
        return client.delete_message_batch(QueueUrl=url, Entries=entries)

    group = GroupCommit(single, batch)

    def delete(handle: str) -> str:
        try:
            group(ReceiptHandle=handle)
            return "deleted"
        except ClientError as exc:
            return exc.response["Error"]["Code"]

    with ThreadPoolExecutor(max_workers=10) as pool:
        first = pool.submit(delete, handles[0])
        rest = [pool.submit(delete, h) for h in handles[1:]]
        while group.pending < 9:  # the nine are queued behind the first call
            threading.Event().wait(0.001)
        others_waiting.set()
        results = [first.result(), *(f.result() for f in rest)]
    assert batches == [9]
    assert results[:9] == ["deleted"] * 9
    assert results[9] == "ReceiptHandleIsInvalid"
    assert queue.depth().visible == queue.depth().in_flight == 0


def test_concurrent_visibility_changes_leave_in_one_batch_each_with_its_own_timeout(queue) -> None:
    """MatchingQueue.change_visibility from ten threads: the first call alone, the nine behind it in one
    ChangeMessageVisibilityBatch; released messages come back at once, hidden ones do not."""
    for i in range(10):
        queue.publish(f"v-{i}")
    messages = queue.receive(10, 0)
    assert len(messages) == 10
    client = queue.client
    single, batch = client.change_message_visibility, client.change_message_visibility_batch
    first_in_flight, others_waiting = threading.Event(), threading.Event()
    batches: list[int] = []

    def held(**kw):
        first_in_flight.set()
        others_waiting.wait(timeout=30)
        return single(**kw)

    client.change_message_visibility = held
    client.change_message_visibility_batch = lambda **kw: (batches.append(len(kw["Entries"])), batch(**kw))[1]
    group = queue._group("visibility", queue.url)
    with ThreadPoolExecutor(max_workers=10) as pool:
        first = pool.submit(queue.change_visibility, messages[0].receipt_handle, 600)
        assert first_in_flight.wait(timeout=30)
        rest = [pool.submit(queue.change_visibility, m.receipt_handle, 0 if i % 2 else 600)
                for i, m in enumerate(messages) if i]
        while group.pending < 9:
            threading.Event().wait(0.001)
        others_waiting.set()
        for f in [first, *rest]:
            f.result()
    assert batches == [9]
    again = queue.receive(10, 0)
    assert sorted(m.message_id for m in again) == sorted(m.message_id for i, m in enumerate(messages) if i % 2)


def test_one_mark_for_a_batch_counts_every_delivery(engine, queue) -> None:
    """A document delivered twice in one batch counts two deliveries (attempts n-1 and n, in order), an
    unknown id is None, and a succeeded document stays succeeded."""
    ingest(engine, queue, doc("m-1"), doc("m-2"))
    drop_messages(queue)
    with engine.begin() as conn:
        repository.mark_in_progress(conn, "m-2", row(engine, "m-2")["created_at"])
        conn.execute(repository.document.update().where(repository.document.c.id == "m-2")
                     .values(matching_status="succeeded"))
        marked = repository.mark_deliveries(conn, ["m-1", "ghost", "m-2", "m-1"], row(engine, "m-1")["created_at"])
    assert [d and (d["id"], d["matching_attempts"], d["matching_status"]) for d in marked] == [
        ("m-1", 1, "in-progress"), None, ("m-2", 2, "succeeded"), ("m-1", 2, "in-progress")]
    assert row(engine, "m-1")["matching_attempts"] == 2


@pytest.mark.parametrize("receivers", [1, 3])
def test_parallel_receivers_match_every_document_once_and_long_poll_only_when_idle(
        engine, queue, sandbox, make_worker, receivers) -> None:
    """25 documents in batches of 4 with 8 in flight: all succeeded once, every message deleted, receives
    short-poll while messages come and the long poll is asked for only after an empty answer."""
    ids = [f"p-{i:02d}" for i in range(25)]
    ingest(engine, queue, *[doc(i) for i in ids])
    sandbox.set_default("llm", content=NO_MATCH)
    worker = make_worker(config=WorkerConfig(visibility_scale=1.0, batch_size=4, in_flight=8, receivers=receivers))
    polls: list[int] = []
    real = worker.queue.receive

    def receive(max_messages: int, wait_seconds: int = 0, **kwargs):
        polls.append(wait_seconds)
        return real(max_messages, 0, **kwargs)  # moto's long poll would only wait on an empty queue

    worker.queue.receive = receive
    report = worker.drain(max_batches=100, wait_seconds=5)
    assert sorted(o.document_id for o in report.outcomes) == ids
    assert {o.action for o in report.outcomes} == {Action.SUCCEEDED} and all(o.deleted for o in report.outcomes)
    assert report.batches == 7  # 25 messages in receives of at most 4
    assert polls.count(5) <= receivers and polls[:7] == [0] * 7
    with engine.connect() as conn:
        assert repository.status_counts(conn, ids) == {"succeeded": 25}
    assert {row(engine, i)["matching_attempts"] for i in ids} == {1}
    assert queue.depth().visible == queue.depth().in_flight == 0


def test_a_batch_budget_stops_every_receiver(engine, queue, sandbox, make_worker) -> None:
    """max_batches counts non-empty receives across receivers: 2 batches of 3, the rest stays queued."""
    ingest(engine, queue, *[doc(f"q-{i}") for i in range(10)])
    sandbox.set_default("llm", content=NO_MATCH)
    worker = make_worker(config=WorkerConfig(visibility_scale=1.0, batch_size=3, in_flight=6, receivers=2))
    report = worker.drain(max_batches=2)
    assert report.batches == 2 and len(report.outcomes) == 6
    assert queue.depth().visible == 4
