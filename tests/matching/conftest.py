"""Fixtures for the matching pipeline: a queue pair of its own per test, the worker on real services."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from assets.matching import ingestion, repository
from assets.matching.worker import Worker, WorkerConfig
from redrive.reliability import Reliability
from redrive.settings import Settings
from resources.factory import build_resources
from resources.llm import LlmResource
from resources.matching import MatchingQueue, MatchingResource

TENANT = "acme-tenant"
MATCH_FIRST = json.dumps({"matches": [{"candidate": 1, "confidence": 0.93, "reason": "same order"}]})
NO_MATCH = json.dumps({"matches": []})


@pytest.fixture
def queue_names(stack) -> Iterator[tuple[str, str]]:
    """A queue and DLQ no other test uses (moto is shared by the session)."""
    suffix = uuid.uuid4().hex[:10]
    yield f"matching-t-{suffix}", f"matching-t-{suffix}-dlq"


@pytest.fixture
def matching(queue_names: tuple[str, str]) -> MatchingResource:
    name, dlq = queue_names
    return MatchingResource(endpoint_url=os.environ["AWS_ENDPOINT_URL"], queue_name=name, dlq_name=dlq,
                            receive_wait_seconds=0, admin_document_url="https://admin.test/documents/{document_id}")


@pytest.fixture
def queue(matching: MatchingResource) -> MatchingQueue:
    q = matching.queue()
    q.ensure()
    return q


@pytest.fixture
def runtime(scaled_settings: Settings) -> Reliability:
    """The core runtime as the code location builds it: Slack webhook and email go to the sandbox."""
    return build_resources(scaled_settings)["reliability"].runtime()


@pytest.fixture
def llm(scaled_settings: Settings) -> LlmResource:
    return LlmResource(base_url=scaled_settings.llm_url or "", api_key="sandbox-key", timeout_seconds=5)


class Sleeps(list):
    """Records the in-process backoff instead of waiting it."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def make_worker(runtime: Reliability, queue: MatchingQueue, llm: LlmResource,
                matching: MatchingResource) -> Callable[..., Worker]:
    def make(**overrides: Any) -> Worker:
        config = overrides.pop("config", WorkerConfig(visibility_scale=1.0))
        return Worker(runtime=runtime, queue=queue, llm=overrides.pop("llm", llm), config=config,
                      admin_link=matching.admin_link, sleep=overrides.pop("sleep", Sleeps()), **overrides)

    return make


def doc(doc_id: str, **fields: Any) -> dict[str, Any]:
    base = {"id": doc_id, "tenant": TENANT, "doc_type": "invoice", "counterparty": "ACME GmbH",
            "references": [f"INV-{doc_id}"], "amount": "1200.00", "currency": "EUR",
            "document_date": "2026-01-05", "text": f"consulting services for {doc_id}"}
    return {**base, **fields}


def ingest(engine: sa.Engine, queue: MatchingQueue, *docs: dict[str, Any]) -> ingestion.IngestReport:
    return ingestion.ingest(engine, queue, docs)


def row(engine: sa.Engine, doc_id: str) -> dict[str, Any]:
    with engine.connect() as conn:
        found = repository.get(conn, doc_id)
    assert found is not None
    return found


def receive_one(queue: MatchingQueue, **kwargs: Any):
    [message] = queue.receive(1, 0, **kwargs)
    return message


def prepare(engine: sa.Engine, *doc_ids: str) -> None:
    """Pre-process documents as a delivery would, so they are candidates for later ones."""
    from assets.matching import policy

    for doc_id in doc_ids:
        found = row(engine, doc_id)
        with engine.begin() as conn:
            repository.save_prepared(conn, doc_id, policy.prepare(found))


def drop_messages(queue: MatchingQueue) -> None:
    """Remove the messages ingestion published, for tests that publish their own."""
    while batch := queue.receive(10, 0):
        for m in batch:
            queue.delete(m.receipt_handle)
