"""The criticizer's Python API: submit a critique request and read where it stands. No HTTP, no Dagster.

    from assets.criticizer import api
    submitted = api.submit(engine, {"artifact_url": ..., "rubric": ..., "webhook_url": ...,
                                    "webhook_headers": {"Authorization": "Bearer …"}})

A submitted request is a row and a due item of the core's work queue; the `criticizer_due_work`
sensor starts a drain run that takes it (with every other due request). Submitting the same request again is a no-op that
returns the same id; reusing an id for other content is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from assets.criticizer import policy, repository
from assets.criticizer.policy import PIPELINE, CritiqueRequest, InvalidRequest
from assets.criticizer.repository import RequestIdConflict, UnknownRequest
from assets.criticizer.settings import CriticizerSettings
from redrive import checkpoints, deadletters, work
from redrive.clock import Clock, SystemClock
from redrive.settings import Settings

__all__ = ["InvalidRequest", "RequestIdConflict", "Status", "Submitted", "UnknownRequest", "status", "submit"]


@dataclass(frozen=True)
class Submitted:
    request_id: str
    created: bool  # False: the same request had been submitted before


@dataclass(frozen=True)
class Status:
    """Where a request stands; never its rubric or header values."""

    request_id: str
    status: str  # submitted | processing | done | dead_lettered
    completed_stages: tuple[str, ...]
    stage_attempts: Mapping[str, int]
    critique: Mapping[str, Any] | None
    dead_letter_id: int | None
    error_class: str | None
    failed_stage: str | None

    def as_json(self) -> dict[str, Any]:
        return {**self.__dict__, "completed_stages": list(self.completed_stages),
                "stage_attempts": dict(self.stage_attempts)}


def submit(engine: sa.Engine, request: Mapping[str, Any] | CritiqueRequest, *,
           allowed_artifact_prefixes: Sequence[str] | None = None, clock: Clock | None = None) -> Submitted:
    """Validate and store a request. Raises InvalidRequest (nothing stored) or RequestIdConflict.

    ``allowed_artifact_prefixes``: where artifacts may come from; None reads the configuration
    (CRITICIZER_ARTIFACT_URL_PREFIXES, else the artifact store), ``()`` allows any http(s) URL.
    """
    if allowed_artifact_prefixes is None:
        allowed_artifact_prefixes = CriticizerSettings().allowed_prefixes(Settings())
    parsed = policy.parse_request(request)
    if not policy.allowed_by(parsed.artifact_url, allowed_artifact_prefixes):
        raise InvalidRequest(
            "invalid critique request: artifact_url: not in an allowed store ("
            + ", ".join(allowed_artifact_prefixes) + ")"
        )
    with engine.begin() as conn:
        created = repository.create(
            conn, request_id=parsed.effective_id, tenant=parsed.tenant, artifact_url=parsed.artifact_url,
            rubric=parsed.rubric, webhook_url=parsed.webhook_url, webhook_headers=parsed.webhook_headers,
            fingerprint=parsed.fingerprint,
        )
        if created:  # the request's row in the core's work queue, in the same transaction: none is lost
            work.enqueue(conn, PIPELINE, parsed.effective_id, now=(clock or SystemClock()).now())
    return Submitted(parsed.effective_id, created)


def status(engine: sa.Engine, request_id: str) -> Status:
    """The request's progress, its critique once done, and its active dead letter if any."""
    with engine.connect() as conn:
        row = repository.get(conn, request_id)
        letter = deadletters.active_for(conn, PIPELINE, request_id)
        done = tuple(s for s in policy.STAGES if checkpoints.load(conn, PIPELINE, request_id, s) is not None)
    state = "dead_lettered" if letter is not None and row.status != repository.DONE else row.status
    return Status(
        request_id=row.request_id, status=state, completed_stages=done,
        stage_attempts={s: row.stage_attempts[s] for s in policy.STAGES if s in row.stage_attempts},
        critique=row.critique, dead_letter_id=letter.id if letter else None,
        error_class=letter.error_class if letter else None, failed_stage=letter.stage if letter else None,
    )
