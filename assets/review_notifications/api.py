"""The Python API of review notifications: create a job (§6.1, §6.2, §10.1, §10.4), finalize, waive, show.

    from assets.review_notifications import api
    submission = api.create_job(engine, {"idempotency_key": "req-81", "changelist_id": "CL-4711",
                                         "review_version": 3, "recipients": ["ana@example.com"]},
                                instance=dagster_instance)
    submission.job.key, submission.mode   # "CL-4711:v3", Mode.CREATED

Creating is one transaction: the job row and its per-recipient outbox rows. The idempotency gate
is the database's: `INSERT … ON CONFLICT DO NOTHING RETURNING`, then a re-select, so a duplicate
request — also fifty at the same instant from several processes — returns the original job. Each
job is a dynamic partition (`review_notification_jobs`) of `review_notifications_job`; the pending
jobs sensor registers partitions too, so a job created without a Dagster instance still runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from assets.review_notifications import policy, repository
from assets.review_notifications.policy import Mode, ReviewRequest
from assets.review_notifications.repository import Delivery, Job
from redrive import deadletters
from redrive.clock import Clock, SystemClock
from redrive.failures import Code, Failure, raise_failure

PARTITIONS_NAME = "review_notification_jobs"


@dataclass(frozen=True)
class Submission:
    """What a creation request got: the job, how it was treated, and whether it created anything."""

    job: Job
    mode: Mode
    created: bool
    request_matches: bool = True  # False: a duplicate key arrived with another body; the original stands

    def as_json(self) -> dict[str, Any]:
        return {"mode": str(self.mode), "created": self.created, "request_matches": self.request_matches,
                **self.job.as_json()}


def submit(engine: sa.Engine, request: ReviewRequest | Mapping[str, Any], *,
           clock: Clock | None = None) -> Submission:
    """Create the job and its outbox rows, or return the job the request already has.

    Raises `policy.InvalidRequest` (bad input) or `policy.VersionRegression` (§6.2: a version below the
    changelist's latest); in both cases nothing is written.
    """
    req = request if isinstance(request, ReviewRequest) else policy.parse_request(request)
    now = (clock or SystemClock()).now()
    with engine.begin() as conn:
        job = repository.insert_job(conn, req)
        if job is None:
            return _already_there(conn, req)
        # Version decisions of one changelist are serialized: v3 and v4 created at once end as
        # "v4 supersedes v3" or "v3 refused", never as a stale v3 after v4.
        repository.lock_changelist(conn, req.changelist_id)
        latest = repository.latest_version(conn, req.changelist_id, excluding=job.id)
        mode = policy.mode_for(req.changelist_id, req.review_version, latest=latest, existing_status=None)
        repository.insert_deliveries(conn, job, req.recipients)
        if mode is Mode.VERSIONED_RERUN:
            _supersede(conn, req.changelist_id, req.review_version, now)
    return Submission(job, mode, created=True)


def _already_there(conn: sa.Connection, req: ReviewRequest) -> Submission:
    duplicate = repository.job_by_idempotency_key(conn, req.idempotency_key)
    if duplicate is not None:  # §10.1: the original job, whatever the request says now
        return Submission(duplicate, Mode.DUPLICATE, created=False,
                          request_matches=duplicate.request_digest == req.digest)
    same = repository.job_by_version(conn, req.changelist_id, req.review_version)
    if same is None:  # the row we conflicted with is gone again: a retry decides afresh
        raise_failure(Failure.of(Code.CONFLICT, detail="conflicting review job disappeared"))
    latest = repository.latest_version(conn, req.changelist_id)
    mode = policy.mode_for(req.changelist_id, req.review_version, latest=latest, existing_status=same.status)
    return Submission(same, mode, created=False, request_matches=same.request_digest == req.digest)


def _supersede(conn: sa.Connection, changelist_id: str, version: int, now: datetime) -> None:
    """Older unfinished versions stop; their open dead letters are closed, since no replay can apply now."""
    done = repository.supersede_older(conn, changelist_id, version)
    for ref in [*done.job_keys, *done.failed_delivery_refs]:
        letter = deadletters.active_for(conn, policy.PIPELINE, ref)
        if letter is not None:
            deadletters.resolve(conn, letter.id, note=f"superseded by review_version {version}", at=now,
                                operator=policy.PIPELINE)


def register_partition(instance: Any, key: str) -> bool:
    """Add the job's dynamic partition to the Dagster instance; False if it was there."""
    if instance.has_dynamic_partition(PARTITIONS_NAME, key):
        return False
    instance.add_dynamic_partitions(PARTITIONS_NAME, [key])
    return True


def create_job(engine: sa.Engine, request: ReviewRequest | Mapping[str, Any], *, instance: Any = None,
               clock: Clock | None = None) -> Submission:
    """`submit`, then make the job a partition of the Dagster job (when an instance is at hand)."""
    submission = submit(engine, request, clock=clock)
    if instance is not None:
        register_partition(instance, submission.job.key)
    return submission


def finalize(conn: sa.Connection, job_id: int, at: datetime, *, gave_up: bool = False) -> Job:
    """§6.5: succeeded only when every required recipient of the job's version has notified_at."""
    outcome = policy.finalize(repository.status_counts(conn, job_id), gave_up=gave_up)
    return repository.finish_job(conn, job_id, outcome, at)


def waive(engine: sa.Engine, delivery_id: int, *, note: str, clock: Clock | None = None,
          operator: str = "operator") -> Job:
    """An operator drops an undeliverable recipient from the required set, then the job is finalized.

    Its dead letter (if any) is resolved with the note. A notified row cannot be waived.
    """
    if not note or not note.strip():
        raise policy.InvalidRequest(f"{policy.InvalidRequest.code}: say why in --note")
    now = (clock or SystemClock()).now()
    with engine.begin() as conn:
        row = repository.get_delivery(conn, delivery_id)
        job = repository.job_by_id(conn, row.job_id)
        if not repository.waive(conn, delivery_id, note):
            raise policy.InvalidRequest(
                f"{policy.InvalidRequest.code}: delivery {delivery_id} is {row.status} and cannot be waived")
        letter = deadletters.active_for(conn, policy.PIPELINE, policy.delivery_ref(job.key, delivery_id))
        if letter is not None:
            deadletters.resolve(conn, letter.id, note=f"recipient waived: {note}", at=now, operator=operator)
        job = finalize(conn, job.id, now)
        if job.status == policy.SUCCEEDED:
            deadletters.close_after_success(conn, policy.PIPELINE, job.key, now)
    return job


def show(engine: sa.Engine, key: str) -> tuple[Job, list[Delivery]]:
    """A job by its key ("CL-4711:v3") or id, with its outbox rows."""
    with engine.connect() as conn:
        job = repository.job_by_id(conn, int(key)) if key.isdigit() else repository.job_by_key(conn, key)
        return job, repository.deliveries_of(conn, job.id)
