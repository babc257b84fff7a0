"""Issue 14, matching at speed: batch calls to SQS, one mark per received batch, the core engine's receives —
each through moto SQS, the sandbox LLM and PostgreSQL, with 000's per-delivery behaviour unchanged."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

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


def test_the_drain_matches_every_document_once_and_long_polls_only_when_idle(
        engine, queue, sandbox, make_worker) -> None:
    """25 documents in batches of 4 with 6 in flight: all succeeded once, every message deleted, receives ask for
    whole batches, short-poll while messages come and long-poll after an empty answer, until the queue is empty
    with nothing in flight."""
    ids = [f"p-{i:02d}" for i in range(25)]
    ingest(engine, queue, *[doc(i) for i in ids])
    sandbox.set_default("llm", content=NO_MATCH)
    worker = make_worker(config=WorkerConfig(visibility_scale=1.0, batch_size=4, in_flight=6))
    polls: list[int] = []
    asked: set[int] = set()
    real = worker.queue.receive

    def receive(max_messages: int, wait_seconds: int = 0, **kwargs):
        polls.append(wait_seconds)
        asked.add(max_messages)
        return real(max_messages, 0, **kwargs)  # moto's long poll would only wait on an empty queue

    worker.queue.receive = receive
    report = worker.drain(max_batches=100, wait_seconds=5)
    assert sorted(o.document_id for o in report.outcomes) == ids
    assert {o.action for o in report.outcomes} == {Action.SUCCEEDED} and all(o.deleted for o in report.outcomes)
    assert report.batches == 7  # 25 messages in receives of at most 4
    assert polls[:8] == [0] * 8 and set(polls[8:]) == {5}
    assert asked == {4}  # a receive waits for a whole batch's slots: the run's batch budget counts whole batches
    with engine.connect() as conn:
        assert repository.status_counts(conn, ids) == {"succeeded": 25}
    assert {row(engine, i)["matching_attempts"] for i in ids} == {1}
    assert queue.depth().visible == queue.depth().in_flight == 0


def test_a_batch_budget_stops_every_receiver(engine, queue, sandbox, make_worker) -> None:
    """max_batches counts non-empty receives: 2 batches of 3, the rest stays queued."""
    ingest(engine, queue, *[doc(f"q-{i}") for i in range(10)])
    sandbox.set_default("llm", content=NO_MATCH)
    worker = make_worker(config=WorkerConfig(visibility_scale=1.0, batch_size=3, in_flight=6))
    report = worker.drain(max_batches=2)
    assert report.batches == 2 and len(report.outcomes) == 6
    assert queue.depth().visible == 4


def test_one_drain_keeps_sixty_documents_waiting_on_the_llm_at_once_on_a_few_threads(
        engine, queue, sandbox, make_worker) -> None:
    """Issue 26 §2: 60 documents against an LLM that takes 3 s: the sandbox sees them all waiting at once, while
    the drain's process gains no thread per document (the threaded drain added one per document in flight)."""
    from redrive.engine import Engine
    from tests.threads import thread_growth

    n = 60
    ingest(engine, queue, *[doc(f"w-{i:02d}") for i in range(n)])
    sandbox.set_default("llm", content=NO_MATCH)
    sandbox.set_profile("llm", latency=3.0)  # long enough for all 60 to get there, on a loaded machine too
    with thread_growth() as grew:
        report = make_worker(config=WorkerConfig(visibility_scale=1.0, batch_size=10, in_flight=n)).drain(
            max_batches=100)
    assert {o.action for o in report.outcomes} == {Action.SUCCEEDED} and len(report.outcomes) == n
    assert sum(o.llm_calls for o in report.outcomes) >= n - 1  # the first of the tenant has no candidate
    assert sandbox.meters("llm")["peak_concurrency"] >= (n - 1) * 0.9  # they waited on the LLM together
    # bounded by the engine's I/O threads (and boto's, httpx's own), not by the documents
    bound = Engine.io_threads + 6
    assert bound < n and grew[0] <= bound, grew


def test_an_empty_queue_ends_no_drain_while_documents_are_in_flight(engine, queue, sandbox, make_worker) -> None:
    """A document published while another is still being matched, after the queue answered empty, is matched by
    the same drain run, not left for the next run the sensor starts; once nothing is in flight, an empty queue
    ends the run."""
    ingest(engine, queue, doc("first"))
    sandbox.set_default("llm", content=NO_MATCH)
    answered_empty, published = threading.Event(), []
    worker = make_worker()
    real = worker.queue.receive

    def receive(max_messages: int, wait_seconds: int = 0, **kwargs):
        got = real(max_messages, wait_seconds, **kwargs)
        if not got:
            answered_empty.set()
        return got

    def before_write(document_id: str) -> None:  # "first" stays in flight until the queue has answered empty
        if document_id == "first":
            assert answered_empty.wait(30)
            ingest(engine, queue, doc("second"))
            published.append("second")

    worker.queue.receive, worker.before_write = receive, before_write
    report = worker.drain(max_batches=10, wait_seconds=0)
    assert published == ["second"]
    assert sorted(o.document_id for o in report.outcomes) == ["first", "second"] and report.batches == 2
    assert {o.action for o in report.outcomes} == {Action.SUCCEEDED}
    assert queue.depth().visible == queue.depth().in_flight == 0
