"""All state of one sandbox: fault scripts, logs, and what the fake providers hold.

One `SandboxState` per app, so two apps (or two test servers) never share
anything. Provider operations that both check and write (idempotent creates)
run under one lock, so two concurrent retries cannot both create.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any

from devstack.sandbox.effects import Clock, EffectLog, utc_now
from devstack.sandbox.faults import FaultBook, Route
from devstack.sandbox.profiles import RouteMeters
from devstack.sandbox.traffic import RequestLog
from devstack.sandbox.wire import (
    DEFAULT_LLM_ANSWERS,
    DEFAULT_LLM_CONTENT,
    EvidenceRequest,
    MailRequest,
    attachment_id_for,
    message_id_for,
)


# Slack `ts` values are "<seconds>.<micro>"; a fixed base keeps them reproducible.
SLACK_TS_BASE = 1_700_000_000


class CaseNotFound(LookupError):
    """The case API does not know this case (an admin marked it missing)."""


class IdempotencyConflict(ValueError):
    """A key was reused for a different request: a caller bug, never silently replayed."""


@dataclass(frozen=True)
class Attachment:
    attachment_id: str
    case_id: str
    idempotency_key: str
    evidence: EvidenceRequest

    def to_wire(self) -> dict[str, Any]:
        return {
            "attachment_id": self.attachment_id,
            "case_id": self.case_id,
            "artifact_id": self.evidence.artifact_id,
            "status": "ATTACHED",
        }


@dataclass(frozen=True)
class MailMessage:
    message_id: str
    request: MailRequest

    def accepted(self) -> dict[str, Any]:
        return {"message_id": self.message_id, "status": "accepted"}

    def delivered(self) -> dict[str, Any]:
        return {
            "message_id": self.message_id,
            "status": "delivered",
            "to": self.request.to,
            "idempotency_token": self.request.idempotency_token,
        }


@dataclass(frozen=True)
class WebhookDelivery:
    """The first answer a cooperative receiver gave for one (path, Idempotency-Key)."""

    delivery_id: str
    body_sha256: str


@dataclass(frozen=True)
class StoredObject:
    body: bytes
    content_type: str


@dataclass(frozen=True)
class RouteDefault:
    """What a route answers on success when an admin overrides it."""

    content: str | None = None
    json: Any = None


class SandboxState:
    """Everything one sandbox remembers; `reset()` makes it as good as new."""

    def __init__(self, clock: Clock = utc_now) -> None:
        self._clock = clock
        self._lock = threading.RLock()
        self.watching = False  # the app's loop watcher is running (it feeds `meters.note_stall`)
        self._start_fresh()

    def _start_fresh(self) -> None:
        self.faults = FaultBook()
        self.effects = EffectLog(self._clock)
        self.traffic = RequestLog(self._clock)
        self.meters = RouteMeters()
        self._defaults: dict[Route, RouteDefault] = {}
        self._llm_answers: dict[str, str] = {}  # prompt text → content, first match wins
        self._store: dict[str, StoredObject] = {}
        self._missing_cases: set[str] = set()
        self._attachments: dict[str, Attachment] = {}
        self._messages: dict[str, MailMessage] = {}
        self._slack_messages = 0
        self._webhooks: dict[tuple[str, str], WebhookDelivery] = {}
        self._webhook_posts = 0
        self._llm_calls = 0

    def reset(self) -> None:
        with self._lock:
            self._start_fresh()

    # -- admin knobs ---------------------------------------------------------

    def set_default(self, route: Route, default: RouteDefault) -> None:
        with self._lock:
            self._defaults[route] = default

    def default_json(self, route: Route) -> Any:
        with self._lock:
            default = self._defaults.get(route)
            return None if default is None else default.json

    def mark_cases_missing(self, case_ids: list[str]) -> None:
        with self._lock:
            self._missing_cases.update(case_ids)

    def put_object(self, path: str, body: bytes, content_type: str) -> None:
        with self._lock:
            self._store[path] = StoredObject(body, content_type)

    # -- llm -----------------------------------------------------------------

    def set_llm_answer(self, when: str, content: str) -> None:
        with self._lock:
            self._llm_answers[when] = content

    def llm_content(self, prompt: str = "") -> str:
        """The content set for prompts containing some text, else admin-set content, else admin-set JSON
        serialised, else the built-in answer valid for the pipeline asking (wire.DEFAULT_LLM_ANSWERS, then
        wire.DEFAULT_LLM_CONTENT)."""
        with self._lock:
            for when, content in self._llm_answers.items():
                if when in prompt:
                    return content
            default = self._defaults.get(Route.LLM)
        if default is not None and default.content is not None:
            return default.content
        if default is not None and default.json is not None:
            return json.dumps(default.json)
        return next((answer for when, answer in DEFAULT_LLM_ANSWERS.items() if when in prompt), DEFAULT_LLM_CONTENT)

    def record_llm_call(self, model: str, messages_sha256: str) -> str:
        """Log the call and return the completion id (a counter, so replays of a test match)."""
        with self._lock:
            self._llm_calls += 1
            self.effects.record("llm.call", model=model, messages_sha256=messages_sha256)
            return f"chatcmpl-sandbox-{self._llm_calls}"

    # -- case API ------------------------------------------------------------

    def attach_evidence(self, case_id: str, evidence: EvidenceRequest, key: str) -> tuple[Attachment, bool]:
        """Create once per key; returns (attachment, replayed)."""
        with self._lock:
            if case_id in self._missing_cases:
                raise CaseNotFound(f"case {case_id!r} does not exist")
            existing = self._attachments.get(key)
            if existing is not None:
                if (existing.case_id, existing.evidence) != (case_id, evidence):
                    raise IdempotencyConflict(
                        f"Idempotency-Key {key!r} was first used for a different case or evidence"
                    )
                return existing, True
            attachment = Attachment(attachment_id_for(key), case_id, key, evidence)
            self._attachments[key] = attachment
            self.effects.record(
                "case.attach",
                case_id=case_id,
                artifact_id=evidence.artifact_id,
                idempotency_key=key,
                attachment_id=attachment.attachment_id,
            )
            return attachment, False

    def find_attachment(self, key: str) -> Attachment | None:
        with self._lock:
            return self._attachments.get(key)

    # -- mail ----------------------------------------------------------------

    def send_mail(self, request: MailRequest) -> tuple[MailMessage, bool]:
        """Accept once per token; returns (message, replayed)."""
        token = request.idempotency_token
        with self._lock:
            existing = self._messages.get(token)
            if existing is not None:
                if existing.request != request:
                    raise IdempotencyConflict(f"idempotency_token {token!r} was first used for a different message")
                return existing, True
            message = MailMessage(message_id_for(token), request)
            self._messages[token] = message
            self.effects.record(
                "mail.send",
                to=request.to,
                subject=request.subject,
                idempotency_token=token,
                message_id=message.message_id,
            )
            return message, False

    def find_message(self, *, token: str | None = None, message_id: str | None = None) -> MailMessage | None:
        with self._lock:
            if token is not None:
                return self._messages.get(token)
            return next((m for m in self._messages.values() if m.message_id == message_id), None)

    # -- slack ---------------------------------------------------------------

    def post_slack(self, where: dict[str, str], payload: dict[str, Any]) -> str:
        """Record a message and return its `ts`, increasing like Slack's."""
        with self._lock:
            self._slack_messages += 1
            self.effects.record("slack.message", **where, payload=payload)
            return f"{SLACK_TS_BASE}.{self._slack_messages:06d}"

    # -- a requester's webhook -------------------------------------------------

    def deliver_webhook(self, path: str, key: str | None, payload: dict[str, Any]) -> tuple[WebhookDelivery, bool]:
        """One effect per (path, key), as a receiver that honours `Idempotency-Key` keeps it; returns
        (delivery, replayed). Without a key every post is an effect: nothing tells two posts apart."""
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
        with self._lock:
            existing = self._webhooks.get((path, key)) if key else None
            if existing is not None:
                if existing.body_sha256 != digest:
                    raise IdempotencyConflict(f"Idempotency-Key {key!r} was first used with a different payload")
                return existing, True
            self._webhook_posts += 1
            delivery = WebhookDelivery(f"whd_{self._webhook_posts:06d}", digest)
            if key:
                self._webhooks[(path, key)] = delivery
            self.effects.record("webhook.delivery", path=path, idempotency_key=key, delivery_id=delivery.delivery_id,
                                payload=payload)
            return delivery, False

    # -- store ---------------------------------------------------------------

    def fetch_object(self, path: str) -> StoredObject | None:
        with self._lock:
            found = self._store.get(path)
            if found is not None:
                self.effects.record("store.fetch", path=path)
            return found

