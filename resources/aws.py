"""S3 and SQS through boto3; `endpoint_url` points at moto locally and is unset for AWS."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

import boto3
from botocore.config import Config
from dagster import ConfigurableResource
from dagster_aws.s3 import S3Resource

_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def _client(key: str, make: Callable[[], Any]) -> Any:
    """One boto3 client a process for `key`, as boto3 advises (a client is thread-safe). Making one reads its
    service model from botocore's JSON files: for dagster-aws's S3Resource, a client per step cost 13.6 % of an
    evidence file-job run's CPU (issue 26). A forked process makes its own (its parent's connections stay its
    parent's)."""
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            client = _clients[key] = make()
    return client


os.register_at_fork(after_in_child=_clients.clear)


def _client_config() -> Config:
    # Bounded timeouts and botocore's own standard retries; our classifier sees what is left.
    return Config(connect_timeout=5, read_timeout=30, retries={"mode": "standard", "max_attempts": 3})


class SharedS3Resource(S3Resource):
    """dagster-aws's S3Resource whose client is made once a process for its configuration, not once a step."""

    def get_client(self) -> Any:
        key = json.dumps({"s3": self.model_dump()}, sort_keys=True, default=str)
        return _client(key, super().get_client)


def s3_resource(endpoint_url: str | None, region: str) -> S3Resource:
    """dagster-aws's S3Resource, aimed at moto or AWS by configuration alone."""
    return SharedS3Resource(endpoint_url=endpoint_url, region_name=region)


class SqsResource(ConfigurableResource):
    """SQS client (dagster-aws has no SQS resource); queues are created by `ensure_queue`."""

    endpoint_url: str | None = None
    region_name: str = "us-east-1"

    def get_client(self) -> Any:
        return _client(json.dumps({"sqs": [self.endpoint_url, self.region_name]}),
                       lambda: boto3.client("sqs", endpoint_url=self.endpoint_url, region_name=self.region_name,
                                            config=_client_config()))

    def ensure_queue(self, name: str, *, visibility_timeout: int = 60, dlq_name: str | None = None,
                     max_receive_count: int = 3) -> str:
        """Create (idempotently) a queue and, if named, its DLQ with a redrive policy; return the URL."""
        import json

        client = self.get_client()
        attributes = {"VisibilityTimeout": str(visibility_timeout)}
        if dlq_name:
            dlq_url = client.create_queue(QueueName=dlq_name)["QueueUrl"]
            dlq_arn = client.get_queue_attributes(QueueUrl=dlq_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
            attributes["RedrivePolicy"] = json.dumps({"deadLetterTargetArn": dlq_arn,
                                                      "maxReceiveCount": str(max_receive_count)})
        return client.create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]


def ensure_bucket(s3_client: Any, bucket: str) -> None:
    existing = {b["Name"] for b in s3_client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        s3_client.create_bucket(Bucket=bucket)
