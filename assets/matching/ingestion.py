"""Ingestion's side of 000: store the document, set `pending`, publish its id to the matching queue.

Order matters: the `pending` row commits *before* the message is sent. Sent first, a fast
worker could mark the document in-progress (or succeeded) and our late `pending` would
overwrite it. A send that fails after the commit leaves a `pending` document without a
message; `matching_requeue_job` with statuses=["pending"] re-publishes it (runbook).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from pydantic import ValidationError

from assets.matching import repository
from assets.matching.policy import DocumentIn
from resources.matching import MatchingQueue


class InvalidDocument(ValueError):
    """A document ingestion refused; nothing of the batch was stored. The message names each field."""

    def __init__(self, index: int, error: ValidationError) -> None:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}"
                             for e in error.errors(include_url=False))
        super().__init__(f"document #{index} refused: {problems}")
        self.index = index


@dataclass(frozen=True)
class IngestReport:
    stored: list[str]
    queued: list[str]
    already_known: list[str]


def validate(docs: Iterable[DocumentIn | Mapping[str, Any]]) -> list[DocumentIn]:
    out = []
    for i, doc in enumerate(docs):
        try:
            out.append(doc if isinstance(doc, DocumentIn) else DocumentIn.model_validate(doc))
        except ValidationError as exc:
            raise InvalidDocument(i, exc) from None
    return out


def ingest(engine: sa.Engine, queue: MatchingQueue, docs: Iterable[DocumentIn | Mapping[str, Any]]) -> IngestReport:
    """Validate all, store new ones (a re-sent id is a no-op), then publish the matchable ones."""
    valid = validate(docs)
    stored, known = [], []
    with engine.begin() as conn:
        for doc in valid:
            (stored if repository.insert_document(conn, doc) else known).append(doc.id)
    new = set(stored)
    queued = [d.id for d in valid if d.id in new and d.matchable]
    for document_id in queued:
        queue.publish(document_id)
    return IngestReport(stored, queued, known)


def requeue(engine: sa.Engine, queue: MatchingQueue, document_ids: Sequence[str]) -> list[str]:
    """Replay or backfill: back to `pending` (committed), then a fresh message each (receive count 1)."""
    with engine.begin() as conn:
        found = repository.mark_pending(conn, document_ids)
    for document_id in found:
        queue.publish(document_id)
    return found
