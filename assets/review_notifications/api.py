"""The Python API of review notifications: create a job (§6.1, §6.2, §10.1, §10.4), finalize, waive, show.

    from assets.review_notifications import api
    submission = api.submit(engine, {"idempotency_key": "req-81", "changelist_id": "CL-4711",
                                     "review_version": 3, "recipients": ["ana@example.com"]})
    submission.job.key, submission.mode   # "CL-4711:v3", Mode.CREATED

Creating is one transaction: the job row, its per-recipient outbox rows and its work row in the
core's queue (due now), so a job exists exactly when it will be worked, whoever created it. The
idempotency gate is the database's: `INSERT … ON CONFLICT DO NOTHING RETURNING`, then a
re-select, so a duplicate request — also fifty at the same instant from several processes —
returns the original job and enqueues nothing. The due-work sensor starts a drain run.
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
from redrive import deadletters, work
from redrive.clock import Clock, SystemClock
from redrive.failures import Code, Failure, raise_failure

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
    """Create the job, its outbox rows and its work row, or return the job the request already has.

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
        # A versioned rerun is a new job key, so a new row; `reopen` makes a re-created key workable again.
        work.enqueue(conn, policy.PIPELINE, job.key, now=now, reopen=True)
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


def work_state(engine: sa.Engine, key: str) -> work.State | None:
    """The job's row in the work queue: done, or due when, after how many attempts, with which error."""
    with engine.connect() as conn:
        return work.state(conn, policy.PIPELINE, key)


def status(engine: sa.Engine, *, now: datetime | None = None) -> dict[str, Any]:
    """What an operator asks first: jobs per status, the work queue, open dead letters (jobs, recipients)."""
    now = now or SystemClock().now()
    with engine.connect() as conn:
        jobs = repository.job_status_counts(conn)
        backlog = work.backlog(conn, policy.PIPELINE, now)
        rows = work.counts(conn, policy.PIPELINE)
        letters = deadletters.list_(conn, deadletters.Filter(pipeline=policy.PIPELINE, limit=10_000))
    recipients = sum(1 for letter in letters if policy.delivery_id_of(letter.entity_ref) is not None)
    return {
        "jobs": jobs,
        "work": {"due": backlog.due, "leased": backlog.leased, "next_due_at": backlog.next_due_at, "rows": rows},
        "dead_letters": {"jobs": len(letters) - recipients, "recipients": recipients},
    }
