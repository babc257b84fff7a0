"""The fake providers' own behaviour: Slack, the PDF gateway, the store, missing cases."""

from __future__ import annotations

import hashlib
import xml.etree.ElementTree as ET

import httpx
from slack_sdk import WebClient

from devstack.sandbox import SandboxClient

from .payloads import CASE_AUTH, evidence

PDF = b"%PDF-1.4\n1 0 obj << /Type /Page >> endobj\nBT /F1 12 Tf (Invoice 42) Tj ET\n%%EOF\n"


def test_slack_webhook_is_recorded_and_answers_ok(sandbox: SandboxClient, http: httpx.Client) -> None:
    """An incoming-webhook post answers plain `ok` and is recorded with its path and payload."""
    answer = http.post("/slack/webhook/T000/B000/XXXX", json={"text": "run failed"})
    assert (answer.status_code, answer.text) == (200, "ok")
    (effect,) = sandbox.effects("slack.message")
    assert effect["path"] == "T000/B000/XXXX"
    assert effect["payload"] == {"text": "run failed"}


def test_slack_webhook_without_text_is_refused(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A webhook body with neither text nor blocks answers 400 no_text, as Slack does."""
    answer = http.post("/slack/webhook/x", json={"username": "bot"})
    assert (answer.status_code, answer.text) == (400, "no_text")
    assert sandbox.count("slack.message") == 0


def test_slack_sdk_posts_to_the_sandbox(sandbox: SandboxClient) -> None:
    """slack_sdk's WebClient pointed at the sandbox posts a message that is recorded."""
    client = WebClient(token="xoxb-test", base_url=sandbox.url("slack/api/"))
    first = client.chat_postMessage(channel="#alerts", text="hi")
    second = client.chat_postMessage(channel="#alerts", text="again")

    assert first["ok"] is True
    assert first["channel"] == "#alerts"
    assert float(second["ts"]) > float(first["ts"])
    effects = sandbox.effects("slack.message")
    assert [(e["channel"], e["payload"]["text"]) for e in effects] == [("#alerts", "hi"), ("#alerts", "again")]


def test_slack_api_without_token_is_not_authed(sandbox: SandboxClient, http: httpx.Client) -> None:
    """chat.postMessage without a token answers Slack's ok=false not_authed and records nothing."""
    answer = http.post("/slack/api/chat.postMessage", json={"channel": "#alerts", "text": "hi"})
    assert answer.json() == {"ok": False, "error": "not_authed"}
    assert sandbox.count() == 0


def test_pdf_convert_rejects_non_pdf(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A body that does not start with %PDF- answers 400 INVALID_PDF and converts nothing."""
    answer = http.post("/pdf/v1/convert", content=b"hello", headers={"Content-Type": "application/pdf"})
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "INVALID_PDF")
    assert sandbox.count("pdf.convert") == 0


def test_pdf_convert_is_deterministic(sandbox: SandboxClient, http: httpx.Client) -> None:
    """The same PDF converts to the same XML, naming its digest and size, and is recorded each time."""
    first, second = (
        http.post("/pdf/v1/convert", content=PDF, headers={"Content-Type": "application/pdf"}) for _ in range(2)
    )
    assert first.headers["content-type"].startswith("application/xml")
    assert first.text == second.text
    document = ET.fromstring(first.text)
    assert document.attrib == {"sha256": hashlib.sha256(PDF).hexdigest(), "bytes": str(len(PDF))}
    assert document.find("page").text == "Invoice 42"
    assert [e["sha256"] for e in sandbox.effects("pdf.convert")] == [document.attrib["sha256"]] * 2


def test_store_serves_what_was_put_and_404s_otherwise(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A stored object comes back with its content type; a missing one answers 404 and is not recorded."""
    sandbox.put_store("reviews/doc-1.md", b"# Draft\n", "text/markdown")

    found = http.get("/store/reviews/doc-1.md")
    missing = http.get("/store/reviews/doc-2.md")

    assert (found.status_code, found.content) == (200, b"# Draft\n")
    assert found.headers["content-type"].startswith("text/markdown")
    assert missing.status_code == 404
    assert [e["path"] for e in sandbox.effects("store.fetch")] == ["reviews/doc-1.md"]


def test_missing_case_answers_case_not_found(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A case an admin marked missing answers 404 CASE_NOT_FOUND; other cases still attach."""
    sandbox.mark_cases_missing("case-gone")
    gone = http.post(
        "/case/v1/cases/case-gone/evidence", json=evidence(), headers={**CASE_AUTH, "Idempotency-Key": "k-gone"}
    )
    there = http.post(
        "/case/v1/cases/case-here/evidence", json=evidence(), headers={**CASE_AUTH, "Idempotency-Key": "k-here"}
    )
    assert (gone.status_code, gone.json()["error"]["code"]) == (404, "CASE_NOT_FOUND")
    assert there.status_code == 201
    assert sandbox.count("case.attach") == 1


def test_reset_forgets_everything(sandbox: SandboxClient, http: httpx.Client) -> None:
    """After a reset there are no effects, requests, scripts, stored objects or missing cases."""
    sandbox.put_store("a", b"x", "text/plain")
    sandbox.mark_cases_missing("case-gone")
    sandbox.script("llm", {"status": 500})
    http.get("/store/a")

    sandbox.reset()

    assert sandbox.effects() == [] and sandbox.requests() == []
    assert all(not route["pending"] for route in sandbox.faults().values())
    assert http.get("/store/a").status_code == 404
    gone = http.post(
        "/case/v1/cases/case-gone/evidence", json=evidence(), headers={**CASE_AUTH, "Idempotency-Key": "k"}
    )
    assert gone.status_code == 201
