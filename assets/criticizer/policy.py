"""The criticizer's decisions and transforms, as pure functions (no I/O, no Dagster).

Reads like 002 §8: the stages and their budgets (§8.3), how a failure is named and
whether it is retried (§8.1, with the per-stage idempotency rule), the backoff (§8.2),
what a request and a critique must look like, and what a dead letter may say (§8.4).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import MappingProxyType
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from redrive.backoff import CRITICIZER_BACKOFF
from redrive.budgets import CRITICIZER_MAX_ATTEMPTS, CRITICIZER_STAGES, RetryDecision, decide
from redrive.failures import Failure, classify_exception
from redrive.sanitize import digest, sanitize_text
from redrive.vocabularies import criticizer_error_class

PIPELINE = "criticizer"
STAGES: tuple[str, ...] = CRITICIZER_STAGES  # 002 §8.3: fetch, llm, notify
MAX_ATTEMPTS_PER_STAGE = CRITICIZER_MAX_ATTEMPTS  # 002 §8.3: 5, inclusive of the first attempt
BACKOFF = CRITICIZER_BACKOFF  # 002 §8.2: full jitter, 1 s ×2 to 60 s; Retry-After up to 300 s

# 002 §8.1: a conflict is retryable only where the operation is idempotent.
# fetch is a GET and llm has no side effect but its cost: repeating them is harmless.
# notify posts to the requester's webhook and to Slack; a 409 there ("this idempotency key
# was used with another payload", a lost race with another delivery) may mean someone else
# already delivered, and a second post could be a duplicate the receiver cannot tell apart.
STAGE_IDEMPOTENT: Mapping[str, bool] = MappingProxyType({"fetch": True, "llm": True, "notify": False})


# ------------------------------------------------------------------------------ §8.1, §8.2, §8.3

def classify(exc: BaseException, *, idempotent: bool) -> Failure:
    """The core's failure for ``exc``, renamed to 002's ``error_class`` with 002's retryability."""
    failure = classify_exception(exc)
    entry = criticizer_error_class(failure, idempotent=idempotent)
    return failure.as_code(entry.code, retryable=entry.retryable)


def classify_for_stage(exc: BaseException, stage: str) -> Failure:
    return classify(exc, idempotent=STAGE_IDEMPOTENT[stage])


def next_attempt(failure: Failure, attempt: int, rng: random.Random,
                 now: datetime) -> tuple[RetryDecision, datetime | None]:
    """§8.2/§8.3 for one stage: retry or stop after failed ``attempt``, and when the next one is due."""
    decision = decide(failure, attempt, MAX_ATTEMPTS_PER_STAGE, BACKOFF, rng)
    return decision, decision.retry_at(now)


# ------------------------------------------------------------------------------------- requests

_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEADER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
_RESERVED_HEADERS = frozenset({"content-type", "content-length", "host", "idempotency-key", "transfer-encoding"})
MAX_RUBRIC_CHARS = 20_000


class InvalidRequest(ValueError):
    """A critique request that cannot be accepted; the message names the fields, never their values."""


def is_http_url(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def allowed_by(url: str, prefixes: Sequence[str]) -> bool:
    """Whether an artifact URL is inside one of the allowed stores (no prefixes: anywhere)."""
    return not prefixes or any(url.startswith(p) for p in prefixes)


class CritiqueRequest(BaseModel):
    """What a requester submits. Header values may be credentials: they are stored for delivery only."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True, hide_input_in_errors=True)

    artifact_url: str = Field(min_length=1, max_length=2048)
    rubric: str = Field(min_length=1, max_length=MAX_RUBRIC_CHARS)
    webhook_url: str = Field(min_length=1, max_length=2048)
    webhook_headers: dict[str, str] = Field(default_factory=dict)
    request_id: str | None = None
    tenant: str | None = Field(default=None, max_length=128)

    @field_validator("artifact_url", "webhook_url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not is_http_url(value):
            raise ValueError("must be an absolute http(s) URL")
        return value

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, value: str | None) -> str | None:
        if value is not None and not _REQUEST_ID.fullmatch(value):
            raise ValueError("must be 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return value

    @field_validator("webhook_headers")
    @classmethod
    def _headers(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not _HEADER_NAME.fullmatch(name):
                raise ValueError("header names are letters, digits and '-'")
            if name.lower() in _RESERVED_HEADERS:
                raise ValueError(f"header {name} is set by the criticizer")
            if len(text) > 4096 or any(ch in text for ch in "\r\n\x00"):
                raise ValueError(f"header {name}: value too long or contains a line break")
        return value

    @property
    def fingerprint(self) -> str:
        """What makes two submissions the same request (the id aside): a hash, never the text."""
        canonical = json.dumps(
            {"artifact_url": self.artifact_url, "rubric": self.rubric, "webhook_url": self.webhook_url,
             "webhook_headers": self.webhook_headers, "tenant": self.tenant},
            sort_keys=True,
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def effective_id(self) -> str:
        """The given id, or one derived from the content: submitting the same request twice is one request."""
        return self.request_id or f"crit-{self.fingerprint[:16]}"


def parse_request(raw: Mapping[str, Any] | CritiqueRequest) -> CritiqueRequest:
    """Validate a submission; a bad one raises :class:`InvalidRequest` naming each field and problem."""
    if isinstance(raw, CritiqueRequest):
        return raw
    try:
        return CritiqueRequest.model_validate(dict(raw))
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_input=False, include_url=False):
            where = ".".join(str(p) for p in error["loc"]) or "request"
            # the location of a header problem is its name, which is not secret; its value never appears
            problems.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
        raise InvalidRequest("invalid critique request: " + "; ".join(problems)) from None


# ------------------------------------------------------------------------------------ critiques

Severity = Literal["info", "minor", "major", "critical"]


class Finding(BaseModel):
    model_config = ConfigDict(extra="ignore", hide_input_in_errors=True)

    criterion: str = Field(min_length=1, max_length=500)
    severity: Severity
    comment: str = Field(min_length=1, max_length=4000)


class Critique(BaseModel):
    """The structured critique the LLM must return; anything else is SCHEMA_INVALID (§8.1: not retried).

    Unknown extra keys are ignored (a tolerant reader); missing or mistyped fields are not.
    ``hide_input_in_errors``: a validation error must not carry the model's text into a stack.
    """

    model_config = ConfigDict(extra="ignore", hide_input_in_errors=True)

    verdict: Literal["approve", "revise", "reject"]
    score: int = Field(ge=0, le=10)
    summary: str = Field(min_length=1, max_length=4000)
    findings: list[Finding] = Field(default_factory=list, max_length=50)


CRITIQUE_INSTRUCTIONS = (
    "You review an artifact against a rubric. Answer with one JSON object and nothing else: "
    '{"verdict": "approve"|"revise"|"reject", "score": 0-10, "summary": "...", '
    '"findings": [{"criterion": "...", "severity": "info"|"minor"|"major"|"critical", "comment": "..."}]}.'
)


def critique_messages(rubric: str, artifact_url: str, artifact_text: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": CRITIQUE_INSTRUCTIONS},
        {"role": "user", "content": f"Rubric:\n{rubric}\n\nArtifact ({artifact_url}):\n{artifact_text}"},
    ]


def fetched(body: bytes) -> dict[str, Any]:
    """The fetch stage's checkpoint: the artifact's text and identity."""
    return {"text": body.decode("utf-8", errors="replace"), "sha256": hashlib.sha256(body).hexdigest(),
            "bytes": len(body)}


def critiqued(critique: Critique, messages: list[dict[str, str]]) -> dict[str, Any]:
    """The llm stage's checkpoint: the critique, its hash, and the prompt's hash (never the prompt)."""
    body = critique.model_dump(mode="json")
    return {"critique": body, "critique_sha256": _sha(body), "prompt_sha256": _sha(messages)}


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------- delivery

def idempotency_key(request_id: str, critique_sha256: str) -> str:
    """One key per request and critique: a retried delivery repeats it, a new critique gets a new one."""
    return f"criticizer:{request_id}:{critique_sha256[:16]}"


def webhook_payload(request_id: str, artifact_url: str, critique: Mapping[str, Any],
                    critique_sha256: str) -> dict[str, Any]:
    """What the requester's webhook receives; `text` makes it a valid Slack-style webhook message too."""
    return {
        "text": headline(request_id, critique),
        "criticizer": {"request_id": request_id, "artifact_url": artifact_url, "critique": dict(critique),
                       "critique_sha256": critique_sha256},
    }


def headline(request_id: str, critique: Mapping[str, Any]) -> str:
    counts: dict[str, int] = {}
    for finding in critique.get("findings", []):
        counts[finding["severity"]] = counts.get(finding["severity"], 0) + 1
    worst = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: _SEVERITY_ORDER.index(kv[0])))
    return f"Critique of {request_id}: {critique['verdict']} ({critique['score']}/10)" + (f"; {worst}" if worst else "")


_SEVERITY_ORDER = ("critical", "major", "minor", "info")


def slack_message(request_id: str, critique: Mapping[str, Any]) -> tuple[str, str]:
    """Subject and text of the Slack post: the headline and a short, sanitized summary."""
    subject = f"[redrive/criticizer] {headline(request_id, critique)}"
    summary = sanitize_text(str(critique.get("summary", "")))
    if len(summary) > 300:
        summary = summary[:299] + "…"
    return subject, f"{subject}\n{summary}"


# ---------------------------------------------------------------------------------- dead letters

def payload_ref(request_id: str, fingerprint: str) -> dict[str, str]:
    """Where a dead letter's original payload is (§8.5 "original payload reference"): a row and a hash."""
    return {"table": "criticizer_requests", "request_id": request_id, "fingerprint": fingerprint[:16]}


def triage_context(
    *,
    request_id: str,
    artifact_url: str,
    rubric: str,
    webhook_url: str,
    header_names: Sequence[str],
    completed: Mapping[str, Mapping[str, Any]],
    failing_since: datetime | None,
) -> dict[str, Any]:
    """§8.4 sanitized_context: ids, hosts and hashes; no header value, rubric, prompt or webhook path.

    The artifact URL is kept (it is where the input lives, and the core's sanitizer strips tokens
    from it); the webhook URL is reduced to its host, since a webhook path is often a credential.
    """
    out: dict[str, Any] = {
        "request_id": request_id,
        "artifact_url": artifact_url,
        "rubric_sha256": digest(rubric),
        "webhook_host": urlsplit(webhook_url).hostname,
        "webhook_url_sha256": digest(webhook_url),
        "webhook_header_names": sorted(h.lower() for h in header_names),
        "failing_since": failing_since.isoformat() if failing_since else None,
    }
    if "fetch" in completed:
        out["artifact_sha256"] = str(completed["fetch"].get("sha256", ""))[:16]
        out["artifact_bytes"] = completed["fetch"].get("bytes")
    if "llm" in completed:
        out["prompt_sha256"] = str(completed["llm"].get("prompt_sha256", ""))[:16]
        out["critique_sha256"] = str(completed["llm"].get("critique_sha256", ""))[:16]
    return out
