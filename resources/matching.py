"""The matching queue and its DLQ in SQS (moto locally), and the worker's configuration, as one resource.

SQS is 000's durable timer: a transient failure hides the message with
ChangeMessageVisibility for the receive count's step, and the redrive policy
(maxReceiveCount 3) moves it to the DLQ on the receive after the third delivery.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError
from dagster import ConfigurableResource
from pydantic import Field

from redrive import group_commit as core
from resources.aws import SqsResource

_EXISTS = {"QueueAlreadyExists", "QueueNameExists", "AWS.SimpleQueueService.QueueNameExists"}
_MISSING = {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"}


@dataclass(frozen=True)
class QueueDepth:
    visible: int  # ApproximateNumberOfMessages: what a receive would get now
    in_flight: int  # ApproximateNumberOfMessagesNotVisible: being processed, or waiting out a visibility step
    delayed: int


@dataclass(frozen=True)
class ReceivedMessage:
    message_id: str
    receipt_handle: str
    body: str
    receive_count: int  # ApproximateReceiveCount: 1 on the first delivery


SQS_BATCH_LIMIT = 10  # entries per DeleteMessageBatch / ChangeMessageVisibilityBatch


class GroupCommit:
    """Concurrent callers' SQS entries leave in one batch call (`redrive.group_commit`, no added delay).

    A lone caller's entry goes through `single` (the plain call, its error raised as it is); a batch's
    per-entry failures are raised to their own callers. Each caller returns only when its entry is settled.
    """

    def __init__(self, single: Callable[[dict[str, Any]], None],
                 batch: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> None:
        self.single, self.batch = single, batch
        self._group: core.GroupCommit[dict[str, Any], None] = core.GroupCommit(self._send, SQS_BATCH_LIMIT)

    @property
    def pending(self) -> int:
        """Entries waiting for the next call."""
        return self._group.pending

    def __call__(self, **fields: Any) -> None:
        self._group(fields)

    def _send(self, group: list[dict[str, Any]]) -> list[Exception | None]:
        if len(group) == 1:
            self.single(group[0])
            return [None]
        reply = self.batch([{"Id": str(i), **fields} for i, fields in enumerate(group)])
        out: list[Exception | None] = [None] * len(group)
        for failed in reply.get("Failed", []):
            error = {"Code": failed.get("Code", ""), "Message": failed.get("Message", "")}
            out[int(failed["Id"])] = ClientError({"Error": error}, "batch entry")
        return out


class MatchingQueue:
    """The few SQS calls the worker, its sensor, ingestion and set-up make.

    Thread-safe (boto3 clients are): the drain's threads share one queue, and their deletes and
    visibility changes are grouped into batch calls (`GroupCommit`).
    """

    def __init__(self, client: Any, sqs: SqsResource, queue_name: str, dlq_name: str, visibility_timeout: int,
                 max_receive_count: int) -> None:
        self.client, self._sqs = client, sqs
        self.queue_name, self.dlq_name = queue_name, dlq_name
        self.visibility_timeout, self.max_receive_count = visibility_timeout, max_receive_count
        self._url: str | None = None
        self._dlq_url: str | None = None
        self._groups: dict[tuple[str, str], GroupCommit] = {}
        self._groups_lock = threading.Lock()

    # -- set-up ------------------------------------------------------------------------------

    def ensure(self) -> str:
        """Create the DLQ and the queue with its redrive policy, idempotently; bring attributes up to date."""
        try:
            self._url = self._sqs.ensure_queue(self.queue_name, visibility_timeout=self.visibility_timeout,
                                               dlq_name=self.dlq_name, max_receive_count=self.max_receive_count)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in _EXISTS:
                raise
            # created earlier with other settings: update them (SetQueueAttributes is idempotent too)
            self._url = self.client.get_queue_url(QueueName=self.queue_name)["QueueUrl"]
            self.client.set_queue_attributes(QueueUrl=self._url, Attributes={
                "VisibilityTimeout": str(self.visibility_timeout),
                "RedrivePolicy": json.dumps({"deadLetterTargetArn": self._arn(self.dlq_url),
                                             "maxReceiveCount": str(self.max_receive_count)})})
        return self._url

    @property
    def url(self) -> str:
        """The queue's URL; the queue is created on first use if the set-up has not run yet."""
        if self._url is None:
            try:
                self._url = self.client.get_queue_url(QueueName=self.queue_name)["QueueUrl"]
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in _MISSING:
                    raise
                self.ensure()
        assert self._url is not None
        return self._url

    @property
    def dlq_url(self) -> str:
        if self._dlq_url is None:
            try:
                self._dlq_url = self.client.get_queue_url(QueueName=self.dlq_name)["QueueUrl"]
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in _MISSING:
                    raise
                self.ensure()
                self._dlq_url = self.client.get_queue_url(QueueName=self.dlq_name)["QueueUrl"]
        return self._dlq_url

    def _arn(self, url: str) -> str:
        return self.client.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]

    def attributes(self) -> dict[str, str]:
        return self.client.get_queue_attributes(QueueUrl=self.url, AttributeNames=["All"])["Attributes"]

    # -- depth -------------------------------------------------------------------------------

    def depth(self, *, dlq: bool = False) -> QueueDepth:
        attrs = self.client.get_queue_attributes(
            QueueUrl=self.dlq_url if dlq else self.url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                            "ApproximateNumberOfMessagesDelayed"],
        )["Attributes"]
        return QueueDepth(int(attrs.get("ApproximateNumberOfMessages", 0)),
                          int(attrs.get("ApproximateNumberOfMessagesNotVisible", 0)),
                          int(attrs.get("ApproximateNumberOfMessagesDelayed", 0)))

    # -- messages ----------------------------------------------------------------------------

    def publish(self, document_id: str) -> str:
        body = json.dumps({"document_id": document_id}, separators=(",", ":"))
        return str(self.client.send_message(QueueUrl=self.url, MessageBody=body)["MessageId"])

    def receive(self, max_messages: int, wait_seconds: int = 0, *, dlq: bool = False,
                visibility_timeout: int | None = None) -> list[ReceivedMessage]:
        kwargs: dict[str, Any] = {
            "QueueUrl": self.dlq_url if dlq else self.url,
            "MaxNumberOfMessages": max(1, min(10, max_messages)),
            "WaitTimeSeconds": wait_seconds,
            "AttributeNames": ["ApproximateReceiveCount"],
        }
        if visibility_timeout is not None:
            kwargs["VisibilityTimeout"] = visibility_timeout
        reply = self.client.receive_message(**kwargs)
        return [
            ReceivedMessage(m["MessageId"], m["ReceiptHandle"], m.get("Body", ""),
                            int(m.get("Attributes", {}).get("ApproximateReceiveCount", "1")))
            for m in reply.get("Messages", [])
        ]

    def delete(self, receipt_handle: str, *, dlq: bool = False) -> None:
        """DeleteMessage, or one entry of a DeleteMessageBatch when other threads delete at the same time."""
        self._group("delete", self.dlq_url if dlq else self.url)(ReceiptHandle=receipt_handle)

    def change_visibility(self, receipt_handle: str, seconds: int) -> None:
        """ChangeMessageVisibility, batched like `delete`."""
        self._group("visibility", self.url)(ReceiptHandle=receipt_handle, VisibilityTimeout=int(seconds))

    def _group(self, call: str, url: str) -> GroupCommit:
        with self._groups_lock:
            group = self._groups.get((call, url))
            if group is None:
                c = self.client
                if call == "delete":
                    group = GroupCommit(lambda f: c.delete_message(QueueUrl=url, **f),
                                        lambda entries: c.delete_message_batch(QueueUrl=url, Entries=entries))
                else:
                    group = GroupCommit(lambda f: c.change_message_visibility(QueueUrl=url, **f),
                                        lambda entries: c.change_message_visibility_batch(QueueUrl=url,
                                                                                          Entries=entries))
                self._groups[(call, url)] = group
            return group

    def move_to_dlq(self, message: ReceivedMessage, reason: str) -> None:
        """A message no delivery can process (not a matching message at all): keep it in the DLQ, now."""
        self.client.send_message(
            QueueUrl=self.dlq_url, MessageBody=message.body or "(empty)",
            MessageAttributes={"redrive-reason": {"DataType": "String", "StringValue": reason[:256]},
                               "redrive-source-message-id": {"DataType": "String",
                                                             "StringValue": message.message_id}},
        )
        self.delete(message.receipt_handle)

    def purge(self) -> None:
        """Tests and the benchmark only."""
        for url in (self.url, self.dlq_url):
            self.client.purge_queue(QueueUrl=url)


class MatchingResource(ConfigurableResource):
    """The matching pipeline's queue and knobs (MATCHING_* settings); `queue()` opens the SQS client."""

    endpoint_url: str | None = None
    region_name: str = "us-east-1"
    queue_name: str = "redrive-matching"
    dlq_name: str = "redrive-matching-dlq"
    visibility_timeout_seconds: int = 60
    max_receive_count: int = 3
    batch_size: int = 5
    in_flight: int | None = None  # documents a drain run processes at once; None: two batches
    max_batches_per_run: int = 100
    receive_wait_seconds: int = 1
    max_concurrent_drains: int = 1
    visibility_scale: float | None = Field(default=None, description="Unset: the reliability time scale.")
    llm_max_attempts: int = 3
    candidate_limit: int = 10
    stuck_after_seconds: float = 600.0
    admin_document_url: str = "http://localhost:3000/admin/documents/{document_id}"

    def sqs(self) -> SqsResource:
        return SqsResource(endpoint_url=self.endpoint_url, region_name=self.region_name)

    def queue(self) -> MatchingQueue:
        sqs = self.sqs()
        return MatchingQueue(sqs.get_client(), sqs, self.queue_name, self.dlq_name,
                             self.visibility_timeout_seconds, self.max_receive_count)

    def admin_link(self, document_id: str, tenant: str | None = None) -> str:
        return self.admin_document_url.replace("{document_id}", document_id).replace("{tenant}", tenant or "")
