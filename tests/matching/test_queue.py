"""The matching queue in moto SQS: set-up, redrive to the DLQ after maxReceiveCount, ingestion's publish."""

from __future__ import annotations

import json

import pytest

from assets.matching import ingestion
from tests.matching.conftest import TENANT, doc, row


def test_setup_creates_queue_with_60s_visibility_and_redrive_to_dlq(queue) -> None:
    """`ensure` gives the main queue 60 s visibility and a redrive policy of 3 receives to its DLQ; twice is fine."""
    url = queue.ensure()  # second time: idempotent
    attrs = queue.attributes()
    policy = json.loads(attrs["RedrivePolicy"])
    assert attrs["VisibilityTimeout"] == "60"
    assert int(policy["maxReceiveCount"]) == 3
    assert policy["deadLetterTargetArn"].endswith(":" + queue.dlq_name)
    assert url == queue.url


def test_moto_moves_message_to_dlq_after_three_receives(queue) -> None:
    """Received 3 times and never deleted (visibility 0 between): the 4th receive finds it in the DLQ instead."""
    queue.publish("redrive-me")
    counts = []
    for _ in range(3):
        [m] = queue.receive(1, 0)
        counts.append(m.receive_count)
        queue.change_visibility(m.receipt_handle, 0)  # visible again at once, no waiting
    assert counts == [1, 2, 3]
    assert queue.receive(1, 0) == []
    [dead] = queue.receive(1, 0, dlq=True)
    assert json.loads(dead.body) == {"document_id": "redrive-me"}


def test_ensure_updates_a_queue_created_with_other_settings(queue, matching) -> None:
    """A queue left with another visibility timeout is brought to the configured one, not refused."""
    queue.client.set_queue_attributes(QueueUrl=queue.url, Attributes={"VisibilityTimeout": "5"})
    fresh = matching.queue()
    fresh.ensure()
    assert fresh.attributes()["VisibilityTimeout"] == "60"


def test_ingest_sets_pending_then_publishes_matchable_documents(engine, queue) -> None:
    """Matchable types: stored `pending` and published; others stored with NULL status, not published."""
    report = ingestion.ingest(engine, queue, [doc("inv-1"), doc("memo-1", doc_type="memo")])
    assert report.queued == ["inv-1"] and sorted(report.stored) == ["inv-1", "memo-1"]
    assert row(engine, "inv-1")["matching_status"] == "pending"
    assert row(engine, "memo-1")["matching_status"] is None
    [m] = queue.receive(10, 0)
    assert json.loads(m.body) == {"document_id": "inv-1"}


def test_reingesting_a_document_is_a_no_op(engine, queue) -> None:
    """The same id again: nothing overwritten, nothing published a second time."""
    ingestion.ingest(engine, queue, [doc("inv-1")])
    again = ingestion.ingest(engine, queue, [doc("inv-1", counterparty="Changed")])
    assert again.stored == [] and again.already_known == ["inv-1"] and again.queued == []
    assert row(engine, "inv-1")["counterparty"] == "ACME GmbH"
    assert len(queue.receive(10, 0)) == 1


def test_invalid_document_is_refused_with_field_names_and_nothing_stored(engine, queue) -> None:
    """One bad document in a batch: a clear error naming the field, and no document of the batch stored."""
    with pytest.raises(ingestion.InvalidDocument) as caught:
        ingestion.ingest(engine, queue, [doc("ok-1"), doc("bad id!", currency="euro")])
    message = str(caught.value)
    assert message.startswith("document #1 refused:") and "id:" in message and "currency:" in message
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM document").scalar() == 0
    assert queue.receive(10, 0) == []


def test_requeue_resets_to_pending_and_publishes_known_ids_only(engine, queue) -> None:
    """Replay/backfill: existing ids back to pending with a fresh message; unknown ids skipped."""
    ingestion.ingest(engine, queue, [doc("inv-1")])
    queue.purge()
    assert ingestion.requeue(engine, queue, ["inv-1", "nope"]) == ["inv-1"]
    [m] = queue.receive(10, 0)
    assert (json.loads(m.body), m.receive_count) == ({"document_id": "inv-1"}, 1)
    assert row(engine, "inv-1")["tenant"] == TENANT
