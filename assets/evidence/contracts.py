"""004 §2 event contracts, as the outbox stores them (payload JSONB) and a Kafka topic would carry them.

Every contract is versioned (`schema_version`) and strict (`extra="forbid"`): an event that does not
fit is a bug to surface, not a shape to guess. Topics (§2.2) are kept on the outbox row so the same
rows could feed Kafka or SQS instead of Dagster runs.
"""

from __future__ import annotations

from typing import Annotated, Literal
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, TypeAdapter

SCHEMA_VERSION = 1

ATTACH_REQUESTED = "EVIDENCE_ATTACH_REQUESTED"
ATTACH_RETRY = "EVIDENCE_ATTACH_RETRY"
N1_REQUESTED = "EVIDENCE_N1_REQUESTED"
N2_REQUESTED = "EVIDENCE_N2_REQUESTED"
ARTIFACT_RESULT = "EVIDENCE_ARTIFACT_RESULT"
EVENT_TYPES = (ATTACH_REQUESTED, ATTACH_RETRY, N1_REQUESTED, N2_REQUESTED)

TOPICS = {
    ATTACH_REQUESTED: "evidence.attach.requests",  # 004 §2.2 initial
    ATTACH_RETRY: "evidence.failed.requests",  # 004 §2.2 retry (this proposal)
    ARTIFACT_RESULT: "evidence.attach.results",  # 004 §2.2 results
    N1_REQUESTED: "evidence.notifications",  # ours: the notification service's input
    N2_REQUESTED: "evidence.notifications",
}


class Contract(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ArtifactRef(Contract):
    artifact_id: UUID
    s3_key: str = Field(min_length=1)


class _RowEvent(Contract):
    event_id: UUID
    occurred_at: AwareDatetime
    file_job_id: UUID
    file_job_row_id: UUID
    case_id: UUID
    artifacts: list[ArtifactRef] = Field(min_length=1)  # Option A: every artifact of the row
    schema_version: Literal[1] = SCHEMA_VERSION


class EvidenceAttachRequested(_RowEvent):
    """Initial attach of one row's evidence, written by ingest in the transaction that creates the row."""

    event_type: Literal["EVIDENCE_ATTACH_REQUESTED"] = ATTACH_REQUESTED


class EvidenceAttachRetry(_RowEvent):
    """004 §2.1: requeue of a failed row; the worker filters what is already attached."""

    event_type: Literal["EVIDENCE_ATTACH_RETRY"] = ATTACH_RETRY
    retry_reason: Literal["AUTOMATED_RETRY"] = "AUTOMATED_RETRY"
    retry_round: int = Field(ge=1)


class EvidenceArtifactResult(Contract):
    """004 §4 result per artifact (topic evidence.attach.results); here it is the worker's return value."""

    event_type: Literal["EVIDENCE_ARTIFACT_RESULT"] = ARTIFACT_RESULT
    artifact_id: UUID
    file_job_id: UUID
    file_job_row_id: UUID
    case_id: UUID
    status: Literal["ATTACHED", "FAILED"]
    error_code: str | None = None
    attempt: int = Field(ge=1)
    final: bool
    recovered_by_lookup: bool = False
    occurred_at: AwareDatetime
    schema_version: Literal[1] = SCHEMA_VERSION


class CannotRetry(Contract):
    """One artifact N2 reports as "Cannot Retry"."""

    artifact_id: UUID
    case_ref: str
    file_name: str
    error_code: str
    error_category: str


class NotificationSummary(Contract):
    total: int = Field(ge=0)
    attached: int = Field(ge=0)
    failed: int = Field(ge=0)
    in_retry: int = Field(ge=0)
    permanent_failed: int = Field(ge=0)
    recovered_by_retry: int = Field(ge=0)
    invalid_rows: int = Field(ge=0)
    by_error_code: dict[str, int] = Field(default_factory=dict)
    cannot_retry: list[CannotRetry] = Field(default_factory=list)


class EvidenceNotificationRequested(Contract):
    """N1 or N2 (004 §5): rendered once when its gate opens, then sent with a fixed idempotency token."""

    event_id: UUID
    event_type: Literal["EVIDENCE_N1_REQUESTED", "EVIDENCE_N2_REQUESTED"]
    occurred_at: AwareDatetime
    file_job_id: UUID
    kind: Literal["N1", "N2"]
    to: str = Field(min_length=3)
    subject: str
    text: str
    idempotency_token: str = Field(min_length=1)
    forced: bool = False
    closed_rows: list[UUID] = Field(default_factory=list)  # rows whose open artifacts a forced N2 closed
    summary: NotificationSummary
    schema_version: Literal[1] = SCHEMA_VERSION


AttachEvent = EvidenceAttachRequested | EvidenceAttachRetry
OutboxEvent = Annotated[
    EvidenceAttachRequested | EvidenceAttachRetry | EvidenceNotificationRequested, Field(discriminator="event_type")
]
_EVENTS: TypeAdapter[EvidenceAttachRequested | EvidenceAttachRetry | EvidenceNotificationRequested] = TypeAdapter(
    OutboxEvent
)


def parse_event(payload: object) -> EvidenceAttachRequested | EvidenceAttachRetry | EvidenceNotificationRequested:
    """An outbox payload as its contract; raises `pydantic.ValidationError` for anything else."""
    return _EVENTS.validate_python(payload)


def dump(event: Contract) -> dict[str, object]:
    """JSON-ready payload (UUIDs and datetimes as strings) for the JSONB column."""
    return event.model_dump(mode="json")
