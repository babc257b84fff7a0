"""Wire formats of the fake providers: request contracts, answer bodies, deterministic ids.

Pure functions, no Starlette: what the sandbox says, separate from how it is served.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from pydantic import BaseModel, ConfigDict, Field

from devstack.sandbox.faults import Route

# A fixed `created` keeps completions byte-identical across runs.
COMPLETION_CREATED = 1_700_000_000
# The answer when nothing is scripted or set, valid for every pipeline that asks (issue 27: a fresh stack's work
# completes): the healthcheck's `{"ok": true}`, the criticizer's critique, the rehearsal's verdict (all tolerant
# readers: unknown keys are ignored) …
DEFAULT_LLM_CONTENT = ('{"ok": true, "verdict": "approve", "score": 8, "summary": "Sound; nothing to add.", '
                       '"findings": []}')
# … and for prompts whose reader is strict, their own valid answer (the start of the pipeline's system prompt)
DEFAULT_LLM_ANSWERS: dict[str, str] = {
    "You match business documents": '{"matches": []}',  # matching: a legitimate "no match" (extra keys refused)
}
UNDELIVERABLE_DOMAIN = "invalid.example"


class EvidenceRequest(BaseModel):
    """Body of the case API's evidence attach."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    artifact_id: str = Field(min_length=1)
    filename: str = Field(min_length=1)
    content_sha256: str = Field(min_length=1)
    s3_key: str | None = None


class MailRequest(BaseModel):
    """Body of the mail provider's send."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    to: str
    subject: str
    text: str
    idempotency_token: str = Field(min_length=1)


def attachment_id_for(idempotency_key: str) -> str:
    """Derived from the key, so a replay and a lookup name the same attachment."""
    return "att_" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:16]


def message_id_for(idempotency_token: str) -> str:
    return "msg_" + hashlib.sha256(idempotency_token.encode()).hexdigest()[:16]


def is_deliverable(recipient: str) -> bool:
    local, at, domain = recipient.rpartition("@")
    return bool(at and local and domain) and domain.lower() != UNDELIVERABLE_DOMAIN


def messages_digest(messages: Any) -> str:
    """Digest of the prompt: enough to tell calls apart without keeping what may be personal data."""
    canonical = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def service_error(code: str, message: str | None = None) -> dict[str, Any]:
    """The error envelope of the case, mail, pdf, slack and store fakes."""
    error: dict[str, Any] = {"code": code}
    if message:
        error["message"] = message
    return {"error": error}


def openai_error(message: str, *, type_: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# status -> (type, code) as OpenAI answers them.
_OPENAI_FAULTS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "unsupported_country_region_territory"),
    404: ("invalid_request_error", "model_not_found"),
    408: ("server_error", "timeout"),
    429: ("requests", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    502: ("server_error", "bad_gateway"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}


def fault_error_body(route: Route, status: int, error_code: str | None = None) -> dict[str, Any]:
    """Default body of a scripted error: OpenAI-shaped for the llm, `HTTP_<status>` elsewhere."""
    if route is Route.LLM:
        type_, code = _OPENAI_FAULTS.get(
            status, ("invalid_request_error" if status < 500 else "server_error", f"http_{status}")
        )
        code = error_code or code
        return openai_error(f"Sandbox fault: HTTP {status} ({code}).", type_=type_, code=code)
    return service_error(error_code or f"HTTP_{status}", f"sandbox fault on route {route.value}: HTTP {status}")


def completion(*, completion_id: str, model: str, content: str, prompt_chars: int) -> dict[str, Any]:
    """A chat.completion object as the OpenAI SDK parses it; token counts are rough (chars / 4)."""
    prompt_tokens = max(1, prompt_chars // 4)
    completion_tokens = max(1, len(content) // 4)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": COMPLETION_CREATED,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


SCHEMA_INVALID_JSON: dict[str, Any] = {"unexpected": "shape"}
SCHEMA_INVALID_LLM_CONTENT = '{"unexpected": "shape"}'
SCHEMA_INVALID_XML = '<unexpected shape="true"/>'

_MALFORMED_JSON = b'{"choices": ['
_MALFORMED_SERVICE_JSON = b'{"status": "acc'
_MALFORMED_XML = b'<document sha256="'


def malformed_body(route: Route) -> tuple[bytes, str]:
    """A truncated body in the route's own content type: (body, media type)."""
    if route is Route.LLM:
        return _MALFORMED_JSON, "application/json"
    if route is Route.PDF_CONVERT:
        return _MALFORMED_XML, "application/xml"
    return _MALFORMED_SERVICE_JSON, "application/json"


PDF_MAGIC = b"%PDF-"
# Text-showing operator with a literal string: `(Hello) Tj`.
_PDF_TEXT = re.compile(rb"\(((?:\\.|[^\\)])*)\)\s*Tj")
_PDF_ESCAPE = re.compile(rb"\\(.)", re.DOTALL)


def pdf_to_xml(pdf: bytes) -> str:
    """Deterministic stand-in for the gateway: one page holding the `(…) Tj` strings of the file."""
    digest = hashlib.sha256(pdf).hexdigest()
    strings = [_PDF_ESCAPE.sub(rb"\1", m).decode("latin-1") for m in _PDF_TEXT.findall(pdf)]
    text = " ".join(s for s in strings if s.strip())
    return (
        f"<document sha256={quoteattr(digest)} bytes={quoteattr(str(len(pdf)))}>"
        f'<page n="1">{escape(text)}</page>'
        "</document>"
    )
