"""boto3 clients are made once a process for a configuration (resources.aws), as boto3 advises: making one reads
its service model from botocore's JSON files, and dagster-aws's S3Resource made one for every step of every run."""

from __future__ import annotations

import multiprocessing as mp
import os

from resources import aws


def test_an_s3_resource_hands_every_step_the_same_client_and_a_forked_process_its_own(stack) -> None:
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    one = aws.s3_resource(endpoint, "us-east-1")
    client = one.get_client()
    assert one.get_client() is client
    assert one.get_object_to_set_on_execution_context() is client  # what a step's `context.resources.s3` is
    assert aws.s3_resource(endpoint, "us-east-1").get_client() is client  # another instance, the same config
    assert aws.s3_resource(endpoint, "eu-west-1").get_client() is not client
    assert "Buckets" in client.list_buckets()  # a real client, on moto

    sqs = aws.SqsResource(endpoint_url=endpoint)
    assert sqs.get_client() is sqs.get_client()

    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)

    def child() -> None:
        inherited = len(aws._clients)
        fresh = aws.s3_resource(endpoint, "us-east-1").get_client()
        writer.send((inherited, "Buckets" in fresh.list_buckets()))

    proc = ctx.Process(target=child)
    proc.start()
    proc.join(timeout=60)
    assert reader.recv() == (0, True)  # nothing inherited: the child's client and connections are its own
