"""Request bodies and headers the sandbox tests send, in one place."""

from __future__ import annotations

LLM_AUTH = {"Authorization": "Bearer sk-test"}
CASE_AUTH = {"Authorization": "Bearer case-token"}


def chat_body(text: str = "classify this") -> dict[str, object]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": text}]}


def evidence(artifact_id: str = "art-1") -> dict[str, str]:
    return {"artifact_id": artifact_id, "filename": f"{artifact_id}.pdf", "content_sha256": "ab" * 32}


def mail(token: str, to: str = "ops@example.com") -> dict[str, str]:
    return {"to": to, "subject": "Weekly report", "text": "attached", "idempotency_token": token}
