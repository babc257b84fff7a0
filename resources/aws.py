"""S3 and SQS through boto3; `endpoint_url` points at moto locally and is unset for AWS."""

from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config
from dagster import ConfigurableResource
from dagster_aws.s3 import S3Resource


def _client_config() -> Config:
    # Bounded timeouts and botocore's own standard retries; our classifier sees what is left.
    return Config(connect_timeout=5, read_timeout=30, retries={"mode": "standard", "max_attempts": 3})


def s3_resource(endpoint_url: str | None, region: str) -> S3Resource:
    """dagster-aws's S3Resource, aimed at moto or AWS by configuration alone."""
    return S3Resource(endpoint_url=endpoint_url, region_name=region)


class SqsResource(ConfigurableResource):
    """SQS client (dagster-aws has no SQS resource); queues are created by `ensure_queue`."""

    endpoint_url: str | None = None
    region_name: str = "us-east-1"

    def get_client(self) -> Any:
        return boto3.client("sqs", endpoint_url=self.endpoint_url, region_name=self.region_name,
                            config=_client_config())

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
