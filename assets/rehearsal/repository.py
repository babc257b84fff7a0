"""All SQL of a rehearsal request: the original payload a dead letter refers to, and its result."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, insert

from redrive.schema import NOW, TZ, metadata

rehearsal_requests = sa.Table(
    "rehearsal_requests",
    metadata,
    sa.Column("request_id", sa.Text, primary_key=True),
    sa.Column("artifact_path", sa.Text, nullable=False),
    sa.Column("prompt", sa.Text, nullable=False),
    sa.Column("result", JSONB),
    sa.Column("completed_at", TZ),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Index("ix_rehearsal_requests_completed_at", "completed_at",
             postgresql_where=sa.text("completed_at IS NOT NULL")),  # the pruner's range
)


@dataclass(frozen=True)
class RehearsalRequest:
    request_id: str
    artifact_path: str
    prompt: str
    result: dict[str, Any] | None

    @property
    def payload_ref(self) -> dict[str, str]:
        """What a dead letter keeps of the request: where it is and a hash, never the prompt."""
        return {"table": "rehearsal_requests", "request_id": self.request_id,
                "prompt_sha256": hashlib.sha256(self.prompt.encode()).hexdigest()[:16]}


def create(conn: sa.Connection, request_id: str, artifact_path: str, prompt: str) -> bool:
    row = conn.execute(
        insert(rehearsal_requests)
        .values(request_id=request_id, artifact_path=artifact_path, prompt=prompt)
        .on_conflict_do_nothing()
        .returning(rehearsal_requests.c.request_id)
    ).first()
    return row is not None


def get(conn: sa.Connection, request_id: str) -> RehearsalRequest:
    row = conn.execute(sa.select(rehearsal_requests).where(rehearsal_requests.c.request_id == request_id)).one()
    return RehearsalRequest(row.request_id, row.artifact_path, row.prompt, row.result)


def complete(conn: sa.Connection, request_id: str, result: dict[str, Any]) -> None:
    conn.execute(
        sa.update(rehearsal_requests)
        .where(rehearsal_requests.c.request_id == request_id)
        .values(result=result, completed_at=sa.func.now())
    )


def retention_rules(settings: Any) -> list[Any]:
    """Completed rehearsal requests go with the rest of finished work (redrive.retention)."""
    from redrive.retention import FINISHED_WORK, Entity, Rule

    return [Rule("rehearsal.requests", "rehearsal_requests", ("request_id",), FINISHED_WORK, "t.completed_at",
                 "t.completed_at IS NOT NULL", "completed requests and their prompts",
                 entity=Entity("rehearsal", "t.request_id"))]
