"""Stack healthcheck: one write and read through every dependency the pipelines use.

Operators run it first when something looks wrong: PostgreSQL, S3, SQS and the
external HTTP services (the sandbox locally) each answer or the asset says which did
not. Safe to rerun: its rows and objects are keyed by the run, nothing accumulates
but one small row per run.
"""

# No `from __future__ import annotations`: Dagster reads config and resource types from live annotations.

import json
from datetime import UTC, datetime

import dagster as dg
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from dagster_aws.s3 import S3Resource
from pydantic import BaseModel, ConfigDict

from assets import OWNERS
from redrive.schema import healthchecks
from redrive.stages import OP_RETRY_POLICY, sanitized_body
from resources.aws import SqsResource, ensure_bucket
from resources.database import PostgresResource
from resources.llm import LlmResource

HEALTHCHECK_QUEUE = "redrive-healthcheck"


class Pong(BaseModel):
    model_config = ConfigDict(extra="allow")
    ok: bool


class HealthcheckConfig(dg.Config):
    bucket: str = "redrive-artifacts"


@dg.asset(retry_policy=OP_RETRY_POLICY, group_name="operations", kinds={"postgres", "s3", "sqs"}, owners=OWNERS)
@sanitized_body
def stack_healthcheck(
    context: dg.AssetExecutionContext,
    config: HealthcheckConfig,
    database: PostgresResource,
    s3: S3Resource,
    sqs: SqsResource,
    llm: LlmResource,
) -> dg.MaterializeResult:
    """Round trip through PostgreSQL, S3, SQS and the LLM endpoint; one row per run in `healthchecks`."""
    results: dict[str, str] = {}
    client = s3.get_client()
    ensure_bucket(client, config.bucket)
    key = f"healthchecks/{context.run_id}.json"
    client.put_object(Bucket=config.bucket, Key=key, Body=b'{"ok": true}')
    results["s3"] = "ok" if client.get_object(Bucket=config.bucket, Key=key)["Body"].read() else "empty"

    queue_url = sqs.ensure_queue(HEALTHCHECK_QUEUE)
    sqs_client = sqs.get_client()
    sqs_client.send_message(QueueUrl=queue_url, MessageBody=json.dumps({"run_id": context.run_id}))
    received = sqs_client.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=1)
    for message in received.get("Messages", []):
        sqs_client.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
    results["sqs"] = "ok" if received.get("Messages") else "no message"

    pong = llm.chat_json([{"role": "user", "content": "healthcheck: answer {\"ok\": true}"}], Pong)
    results["llm"] = "ok" if pong.ok else "not ok"

    with database.engine().begin() as conn:
        results["postgres"] = "ok" if conn.execute(sa.text("SELECT 1")).scalar() == 1 else "no answer"
        conn.execute(
            insert(healthchecks)
            .values(run_key=context.run_id, checked_at=datetime.now(UTC), results=results)
            .on_conflict_do_nothing()
        )
    context.log.info(f"healthcheck: {results}")
    return dg.MaterializeResult(metadata={name: dg.MetadataValue.text(v) for name, v in results.items()})
