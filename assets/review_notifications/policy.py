"""Review notifications, the decisions (002 "Review Notification Processing Spec" §6, §8, §10).

Pure functions and tables: what a request is, which processing mode it gets, what a delivery row's
next step is, what reconciliation concludes, when a job is finished, how a provider failure is
named and whether it fails a recipient, the job, or is retried. No I/O, no Dagster.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, field_validator

from redrive.backoff import CRITICIZER_BACKOFF, FullJitter
from redrive.failures import Code, Failure
from redrive.vocabularies import Entry, Vocabulary

PIPELINE = "review_notifications"
TOKEN_PREFIX = "rn-"

# ---------------------------------------------------------------------------------------- statuses

# Jobs (§6.2, §6.5). `pending`: created, no run yet; `superseded`: a higher review_version was requested
# before this one finished, so its unsent rows are no longer sent (the newer version notifies instead).
PENDING, IN_PROGRESS, RETRYABLE_FAILED, SUCCEEDED, SUPERSEDED = (
    "pending", "in_progress", "retryable_failed", "succeeded", "superseded")
JOB_STATUSES = (PENDING, IN_PROGRESS, RETRYABLE_FAILED, SUCCEEDED, SUPERSEDED)
UNFINISHED = (PENDING, IN_PROGRESS, RETRYABLE_FAILED)

# Delivery rows (§6.3, §6.4). `sending`: a send was started and may have reached the provider, so the
# next attempt looks the token up before it sends; `failed`: permanent (invalid recipient, policy),
# dead-lettered; `waived`: an operator removed the recipient from the required set.
D_PENDING, D_SENDING, D_SENT, D_FAILED, D_WAIVED, D_SUPERSEDED = (
    "pending", "sending", "sent", "failed", "waived", "superseded")
DELIVERY_STATUSES = (D_PENDING, D_SENDING, D_SENT, D_FAILED, D_WAIVED, D_SUPERSEDED)
NOT_REQUIRED = (D_WAIVED, D_SUPERSEDED)


# ----------------------------------------------------------------------------------------- requests

# Changelist ids become entity refs ("CL-4711:v3:d17") in work rows, dead letters, run logs and
# commands: no ':' (our separator), no '..' or control characters.
_CHANGELIST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
_EMAIL = re.compile(r"[^@\s,;<>]+@[^@\s,;<>]+")


class InvalidRequest(ValueError):
    """A job request that cannot be accepted as given; the message names the field. Nothing was written."""

    code = "INVALID_REQUEST"


class VersionRegression(Exception):
    """§6.2: a review_version below the changelist's latest is refused (REVIEW_VERSION_REGRESSION)."""

    code = "REVIEW_VERSION_REGRESSION"

    def __init__(self, changelist_id: str, requested: int, latest: int) -> None:
        super().__init__(
            f"{self.code}: changelist {changelist_id} is already at review_version {latest}; "
            f"review_version {requested} is older and is not processed (a rerun needs a version above {latest})"
        )
        self.changelist_id, self.requested, self.latest = changelist_id, requested, latest


class ReviewRequest(BaseModel):
    """A caller's request to notify a changelist's reviewers of one review version (§6.1)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    idempotency_key: str = Field(min_length=1, max_length=200)
    changelist_id: str
    review_version: int = Field(ge=1)
    recipients: tuple[str, ...] = Field(min_length=1, max_length=1000)
    summary: str = Field(default="", max_length=20_000)

    @field_validator("idempotency_key")
    @classmethod
    def _key(cls, value: str) -> str:
        if value != value.strip() or any(ord(ch) < 32 for ch in value):
            raise ValueError("must not have surrounding spaces or control characters")
        return value

    @field_validator("changelist_id")
    @classmethod
    def _changelist(cls, value: str) -> str:
        if not _CHANGELIST.fullmatch(value) or ".." in value:
            raise ValueError("must be 1-128 of A-Z a-z 0-9 . _ / - (starting with a letter or digit, no '..')")
        return value

    @field_validator("review_version", mode="before")
    @classmethod
    def _version(cls, value: object) -> object:
        if isinstance(value, str) and re.fullmatch(r"[vV]?[0-9]{1,9}", value.strip()):
            return int(value.strip().lstrip("vV"))  # "v3" and "3" name the same version
        return value

    @field_validator("recipients", mode="before")
    @classmethod
    def _recipients(cls, value: object) -> object:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            return value
        out: list[str] = []
        for item in value:
            if not isinstance(item, str) or not _EMAIL.fullmatch(item.strip()):
                raise ValueError("every recipient must be one email address")
            address = normalize_recipient(item)
            if address not in out:
                out.append(address)
        return tuple(out)

    @property
    def digest(self) -> str:
        """What the request asked for, without its key: a duplicate key with another body is told apart."""
        canonical = json.dumps({"changelist_id": self.changelist_id, "review_version": self.review_version,
                                "recipients": sorted(self.recipients), "summary": self.summary},
                               sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def parse_request(data: Mapping[str, object]) -> ReviewRequest:
    """A `ReviewRequest`, or `InvalidRequest` with one line per bad field (never the submitted values)."""
    from pydantic import ValidationError

    try:
        return ReviewRequest.model_validate(dict(data))
    except ValidationError as exc:
        lines = [f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors()]
        raise InvalidRequest(f"{InvalidRequest.code}: " + "; ".join(lines)) from None


def normalize_recipient(address: str) -> str:
    """One spelling per mailbox, so the outbox key (§10.2) does not split on case or spaces."""
    return address.strip().lower()


# ------------------------------------------------------------------------------------ keys and names


def job_key(changelist_id: str, review_version: int) -> str:
    """The job's entity ref (its work row, its dead letter): natural ids only, never the clock (STYLE §6)."""
    return f"{changelist_id}:v{review_version}"


def delivery_ref(key: str, delivery_id: int) -> str:
    """Entity ref of one delivery row, for its dead letter and alerts (no email address in it)."""
    return f"{key}:d{delivery_id}"


def job_key_of(entity_ref: str) -> str:
    """The job an entity ref belongs to: a job ref is its own key; a delivery ref ends in `:d<id>`."""
    head, sep, tail = entity_ref.rpartition(":")
    return head if sep and tail.startswith("d") and tail[1:].isdigit() else entity_ref


def delivery_id_of(entity_ref: str) -> int | None:
    head, sep, tail = entity_ref.rpartition(":")
    return int(tail[1:]) if sep and tail.startswith("d") and tail[1:].isdigit() else None


def provider_token(changelist_id: str, recipient: str, review_version: int) -> str:
    """§6.4/§10.3: the provider idempotency token, derived from the outbox identity tuple alone."""
    material = "\x1f".join((changelist_id, normalize_recipient(recipient), str(review_version)))
    return TOKEN_PREFIX + hashlib.sha256(material.encode()).hexdigest()[:40]


def render(changelist_id: str, review_version: int, summary: str) -> tuple[str, str]:
    """Subject and text of the notification: a function of stored fields only, so a resend is identical."""
    subject = f"Review v{review_version} of changelist {changelist_id} is ready"
    body = [f"Review version {review_version} of changelist {changelist_id} is ready for you."]
    if summary.strip():
        body += ["", summary.strip()]
    body += ["", "You receive this because you are a reviewer of the changelist."]
    return subject, "\n".join(body)


# ------------------------------------------------------------------------------------------- modes


class Mode(StrEnum):
    CREATED = "created"  # first job of the changelist
    VERSIONED_RERUN = "versioned_rerun"  # §6.2: strictly higher review_version → new delivery intents
    DUPLICATE = "duplicate"  # §6.1/§10.1: the idempotency key was seen: the original job, nothing created
    NOOP = "noop"  # §6.2/§10.4: same version already succeeded: the prior result, nothing sent
    EXISTING = "existing"  # same version requested again under a new key while it is still running


def mode_for(changelist_id: str, requested: int, *, latest: int | None, existing_status: str | None) -> Mode:
    """§6.2 for a request that passed the idempotency gate.

    ``latest`` is the highest review_version of the changelist's *other* jobs (None: there are none);
    ``existing_status`` is the status of the job that already holds the requested version, or None
    when this request just created it. A version below the latest is refused, also when it has a job.
    """
    if latest is not None and requested < latest:
        raise VersionRegression(changelist_id, requested, latest)
    if existing_status is not None:
        return Mode.NOOP if existing_status == SUCCEEDED else Mode.EXISTING
    return Mode.VERSIONED_RERUN if latest is not None else Mode.CREATED


# ------------------------------------------------------------------------------------ send-and-mark


class Action(StrEnum):
    SKIP = "skip"  # notified_at set (§6.3) or no longer required/failed
    LOOKUP_FIRST = "lookup_first"  # §6.4: a send may have happened: ask the provider before resending
    SEND = "send"  # nothing recorded: safe to send


@dataclass(frozen=True)
class DeliveryState:
    status: str
    notification_id: str | None
    notified_at: object | None
    attempts: int


def next_action(row: DeliveryState) -> Action:
    """§6.4's re-read rules for one outbox row, before any send."""
    if row.notified_at is not None or row.status in (D_SENT, D_FAILED, D_WAIVED, D_SUPERSEDED):
        return Action.SKIP
    if row.notification_id is not None or row.status == D_SENDING or row.attempts > 0:
        return Action.LOOKUP_FIRST
    return Action.SEND


class Evidence(StrEnum):
    VERIFIED = "verified"  # the provider has the message under the row's id
    REPAIR_ID = "repair_id"  # the provider has it under our token, with another id: fix the id, no send
    NONE = "none"  # §8.2 row 2 / §8.3: marked sent, provider has nothing → reconciliation


def judge_sent_row(notification_id: str | None, found_id: str | None) -> Evidence:
    """What a row marked sent is, given what the provider found (by id, then by token)."""
    if found_id is None:
        return Evidence.NONE
    return Evidence.VERIFIED if found_id == notification_id else Evidence.REPAIR_ID


# ------------------------------------------------------------------------------------- finalization


@dataclass(frozen=True)
class Outcome:
    status: str
    required: int
    delivered: int
    failed: int
    waiting: int

    @property
    def result(self) -> dict[str, int]:
        return {"required": self.required, "delivered": self.delivered, "failed": self.failed,
                "waiting": self.waiting}


def finalize(counts: Mapping[str, int], *, gave_up: bool = False) -> Outcome:
    """§6.5: succeeded only when every required recipient has notified_at; otherwise why not.

    A permanently failed row waits for an operator (replay or waive), so the job is retryable_failed;
    rows still to send keep it in_progress, or retryable_failed once the run gave up on them.
    """
    total = sum(counts.values())
    required = total - sum(counts.get(s, 0) for s in NOT_REQUIRED)
    delivered = counts.get(D_SENT, 0)
    failed = counts.get(D_FAILED, 0)
    waiting = required - delivered - failed
    if delivered == required:
        status = SUCCEEDED
    elif failed or gave_up:
        status = RETRYABLE_FAILED
    else:
        status = IN_PROGRESS
    return Outcome(status, required, delivered, failed, waiting)


# ---------------------------------------------------------------------------------------- failures

RECIPIENT, JOB, TRANSIENT = "recipient", "job", "transient"

# §8.1: transient provider/network failures retry with backoff; an invalid recipient or a policy
# rejection fails that recipient's row for an operator. What fails neither a retry nor one recipient
# (bad credentials, our own bugs) fails the job: retrying the other recipients cannot help.
NOTIFICATION = Vocabulary(
    PIPELINE,
    {
        Code.NETWORK_TIMEOUT: Entry("PROVIDER_TIMEOUT", True, TRANSIENT),
        Code.NETWORK_ERROR: Entry("PROVIDER_UNREACHABLE", True, TRANSIENT),
        Code.UPSTREAM_UNAVAILABLE: Entry("PROVIDER_UNAVAILABLE", True, TRANSIENT),
        # A 500 may hide an accepted send (the lost response): retrying is safe because the next
        # attempt looks the token up before sending (§8.2 row 1).
        Code.UPSTREAM_INTERNAL: Entry("PROVIDER_ERROR", True, TRANSIENT),
        Code.RATE_LIMITED: Entry("PROVIDER_RATE_LIMITED", True, TRANSIENT),
        # A garbled 2xx may also hide an accepted send: same reasoning, retried with lookup first.
        Code.PARSE_ERROR: Entry("PROVIDER_BAD_RESPONSE", True, TRANSIENT),
        Code.SCHEMA_INVALID: Entry("PROVIDER_BAD_RESPONSE", True, TRANSIENT),
        # §8.2 row 1: the provider accepted, then our write of notified_at failed.
        Code.DB_TRANSIENT: Entry("DB_TRANSIENT", True, TRANSIENT),
        Code.BAD_REQUEST: Entry("INVALID_RECIPIENT", False, RECIPIENT),  # 422 INVALID_RECIPIENT
        Code.POLICY_REJECTED: Entry("POLICY_REJECTED", False, RECIPIENT),
        # 409 IDEMPOTENCY_TOKEN_REUSED: the same token with another body: our payload is not
        # deterministic. A bug, never retried, never "fixed" by resending under a new token.
        Code.CONFLICT: Entry("IDEMPOTENCY_TOKEN_REUSED", False, JOB),
        Code.AUTH_DENIED: Entry("PROVIDER_AUTH_DENIED", False, JOB),
        Code.NOT_FOUND: Entry("PROVIDER_NOT_FOUND", False, JOB),  # a send answered 404: wrong base URL
        Code.CONTEXT_LENGTH_EXCEEDED: Entry("INVALID_RECIPIENT", False, RECIPIENT),
        Code.DATA_ERROR: Entry("INTERNAL_ERROR", False, JOB),
        Code.INVARIANT_VIOLATION: Entry("INTERNAL_ERROR", False, JOB),
        Code.UNKNOWN: Entry("INTERNAL_ERROR", False, JOB),
    },
    default=Entry("INTERNAL_ERROR", False, JOB),
)

ORDERING_VIOLATION = "ORDERING_CONTRACT_VIOLATED"


def scope(failure: Failure) -> str:
    """Whom a classified failure stops: this recipient, the whole job, or nobody (retry)."""
    return NOTIFICATION.entry(failure).category


# In-process retries per row, for a caller that wants them (`Deliverer(row_attempts=…)`): short waits
# only (a Retry-After is honoured up to 10 s here). The drain runs 1 attempt per row and pass: past it
# the job's work row falls due later under the send stage's policy (002 §8.2's full jitter, Retry-After).
ROW_BACKOFF = FullJitter(initial=0.5, multiplier=2.0, max_delay=4.0, retry_after_ceiling=10.0)
ROW_MAX_ATTEMPTS = 3
JOB_BACKOFF = CRITICIZER_BACKOFF
JOB_MAX_ATTEMPTS = 5  # 002 §8.3's per-stage budget
