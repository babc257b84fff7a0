"""The effect log counts what providers really did: idempotency, lost responses, no secrets."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from devstack.sandbox import SandboxClient

from .payloads import CASE_AUTH, chat_body, evidence, mail


def _attach(http: httpx.Client, key: str, case_id: str = "case-1", artifact_id: str = "art-1") -> httpx.Response:
    return http.post(
        f"/case/v1/cases/{case_id}/evidence",
        json=evidence(artifact_id),
        headers={**CASE_AUTH, "Idempotency-Key": key},
    )


def test_case_attach_is_recorded_once_per_idempotency_key(sandbox: SandboxClient, http: httpx.Client) -> None:
    """Repeating a key replays the first answer without a new effect; a new key is a new effect."""
    first = _attach(http, "case-1/art-1")
    again = _attach(http, "case-1/art-1")

    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert first.json()["attachment_id"].startswith("att_")
    assert sandbox.count("case.attach") == 1

    assert _attach(http, "case-1/art-2", artifact_id="art-2").status_code == 201
    assert sandbox.count("case.attach") == 2
    assert [e["idempotency_key"] for e in sandbox.effects("case.attach")] == ["case-1/art-1", "case-1/art-2"]


def test_reusing_a_key_for_other_evidence_is_a_conflict(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A key reused with a different body answers 409 instead of silently replaying."""
    _attach(http, "k-1", artifact_id="art-1")
    answer = _attach(http, "k-1", artifact_id="art-9")
    assert answer.status_code == 409
    assert answer.json()["error"]["code"] == "IDEMPOTENCY_KEY_REUSED"
    assert sandbox.count("case.attach") == 1


def test_case_attach_requires_auth_and_a_key(http: httpx.Client) -> None:
    """Without a bearer token the case API answers 401; without an Idempotency-Key, 400."""
    no_auth = http.post("/case/v1/cases/c/evidence", json=evidence(), headers={"Idempotency-Key": "k"})
    no_key = http.post("/case/v1/cases/c/evidence", json=evidence(), headers=CASE_AUTH)
    assert (no_auth.status_code, no_auth.json()["error"]["code"]) == (401, "UNAUTHORIZED")
    assert (no_key.status_code, no_key.json()["error"]["code"]) == (400, "MISSING_IDEMPOTENCY_KEY")


def test_mail_is_recorded_once_per_token(sandbox: SandboxClient, http: httpx.Client) -> None:
    """Repeating a token answers 200 with the same message id and sends nothing new."""
    first = http.post("/mail/v1/messages", json=mail("report-2024-05"))
    again = http.post("/mail/v1/messages", json=mail("report-2024-05"))
    other = http.post("/mail/v1/messages", json=mail("report-2024-06"))

    assert first.status_code == 202
    assert again.status_code == 200
    assert again.json() == first.json() == {"message_id": first.json()["message_id"], "status": "accepted"}
    assert other.status_code == 202
    assert sandbox.count("mail.send") == 2

    by_id = http.get(f"/mail/v1/messages/{first.json()['message_id']}")
    assert by_id.json()["status"] == "delivered"
    assert by_id.json()["idempotency_token"] == "report-2024-05"


def test_undeliverable_recipients_are_refused_without_sending(sandbox: SandboxClient, http: httpx.Client) -> None:
    """Recipients without '@' or at invalid.example answer 422 INVALID_RECIPIENT and send nothing."""
    for to in ("nobody", "ops@invalid.example"):
        answer = http.post("/mail/v1/messages", json=mail(f"tok-{to}", to=to))
        assert (answer.status_code, answer.json()["error"]["code"]) == (422, "INVALID_RECIPIENT")
    assert sandbox.count("mail.send") == 0


def test_effect_then_error_records_the_effect_and_a_lookup_finds_it(sandbox: SandboxClient, http: httpx.Client) -> None:
    """The provider acts but answers 500; looking the key up afterwards reveals the attachment."""
    sandbox.script("case.attach", {"kind": "effect_then_error", "status": 500})

    lost = _attach(http, "case-7/art-1", case_id="case-7")
    found = http.get("/case/v1/attachments", params={"idempotency_key": "case-7/art-1"}, headers=CASE_AUTH)

    assert lost.status_code == 500
    assert sandbox.count("case.attach") == 1
    assert found.status_code == 200
    assert found.json()["attachment_id"] == sandbox.effects("case.attach")[0]["attachment_id"]
    assert found.json()["status"] == "ATTACHED"
    assert _attach(http, "case-7/art-1", case_id="case-7").headers["Idempotent-Replayed"] == "true"


def test_mail_effect_then_error_is_found_by_token(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A mail accepted with a lost response is visible through the token lookup."""
    sandbox.script("mail.send", {"kind": "effect_then_error", "status": 502})
    assert http.post("/mail/v1/messages", json=mail("tok-lost")).status_code == 502
    found = http.get("/mail/v1/messages", params={"idempotency_token": "tok-lost"})
    assert found.status_code == 200
    assert sandbox.count("mail.send") == 1


def _hook(http: httpx.Client, key: str | None, text: str = "critique ready", path: str = "requester/pr-1") -> httpx.Response:
    return http.post(f"/webhook/{path}", json={"text": text}, headers={"Idempotency-Key": key} if key else {})


def test_a_webhook_retry_after_effect_then_error_is_one_effect(sandbox: SandboxClient, http: httpx.Client) -> None:
    """The receiver acted but the answer was lost; the retry with the same key gets the first answer, no second post."""
    sandbox.script("webhook", {"kind": "effect_then_error", "status": 500})
    lost = _hook(http, "criticizer:pr-1:abc")
    again = _hook(http, "criticizer:pr-1:abc")

    assert lost.status_code == 500
    assert again.status_code == 200 and again.headers["Idempotent-Replayed"] == "true"
    [effect] = sandbox.effects("webhook.delivery")
    assert (effect["path"], effect["idempotency_key"]) == ("requester/pr-1", "criticizer:pr-1:abc")
    assert again.json() == {"ok": True, "delivery_id": effect["delivery_id"]}
    assert [r["status"] for r in sandbox.requests("webhook")] == [500, 200]


def test_a_webhook_without_a_key_or_with_another_key_is_another_effect(sandbox: SandboxClient,
                                                                       http: httpx.Client) -> None:
    """A receiver can only deduplicate what the sender lets it tell apart: no key, or a new key, is a new post;
    the same key on another path is another receiver's."""
    assert _hook(http, None).status_code == 200 and _hook(http, None).status_code == 200
    assert _hook(http, "k-1").status_code == 200 and _hook(http, "k-2").status_code == 200
    assert _hook(http, "k-1", path="requester/pr-2").status_code == 200
    assert sandbox.count("webhook.delivery") == 5


def test_a_webhook_key_reused_for_another_payload_is_422(sandbox: SandboxClient, http: httpx.Client) -> None:
    """draft-ietf-httpapi-idempotency-key-header: the same key with a different body is refused, never replayed."""
    assert _hook(http, "k-1", "first").status_code == 200
    refused = _hook(http, "k-1", "second")
    assert refused.status_code == 422 and refused.json()["error"]["code"] == "IDEMPOTENCY_KEY_REUSED"
    assert sandbox.count("webhook.delivery") == 1


def test_unknown_attachment_lookup_is_not_found(http: httpx.Client) -> None:
    """Looking up a key that never attached answers 404 NOT_FOUND."""
    answer = http.get("/case/v1/attachments", params={"idempotency_key": "nope"}, headers=CASE_AUTH)
    assert (answer.status_code, answer.json()) == (404, {"error": {"code": "NOT_FOUND"}})


def test_no_secret_is_kept(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A bearer token sent to any route appears in neither the request log nor the effect log."""
    canary = "sk-canary-123"
    auth = {"Authorization": f"Bearer {canary}"}
    http.post("/llm/v1/chat/completions", json=chat_body(), headers=auth)
    http.post("/case/v1/cases/c-1/evidence", json=evidence(), headers={**auth, "Idempotency-Key": "k"})
    http.post("/slack/api/chat.postMessage", json={"channel": "#alerts", "text": "hi"}, headers=auth)
    http.post("/slack/api/chat.postMessage", data={"channel": "#alerts", "text": "hi", "token": canary})

    assert sandbox.count() == 4
    for path in ("/_admin/requests", "/_admin/effects"):
        assert canary not in http.get(path).text
    assert all("authorization" in r["header_names"] for r in sandbox.requests()[:3])


def test_llm_effect_keeps_a_digest_not_the_prompt(sandbox: SandboxClient, http: httpx.Client) -> None:
    """The llm.call effect names the model and a digest of the messages, never their text."""
    http.post("/llm/v1/chat/completions", json=chat_body("patient John Doe"), headers={"Authorization": "Bearer x"})
    (effect,) = sandbox.effects("llm.call")
    assert effect["model"] == "gpt-4o-mini"
    assert len(effect["messages_sha256"]) == 64
    assert "John Doe" not in str(sandbox.effects())


def test_llm_without_key_is_refused_openai_style(http: httpx.Client) -> None:
    """No bearer token answers 401 with OpenAI's invalid_api_key error body."""
    answer = http.post("/llm/v1/chat/completions", json=chat_body())
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_api_key"
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_concurrent_retries_with_one_key_attach_once(sandbox: SandboxClient) -> None:
    """Twenty simultaneous attaches with the same Idempotency-Key create exactly one attachment."""

    def attach(_: int) -> int:
        with httpx.Client(base_url=sandbox.base_url, timeout=5) as client:
            return _attach(client, "case-9/art-1", case_id="case-9").status_code

    with ThreadPoolExecutor(max_workers=20) as pool:
        statuses = list(pool.map(attach, range(20)))

    assert sorted(statuses) == [200] * 19 + [201]
    assert sandbox.count("case.attach") == 1


def test_the_effect_log_is_kept_out_of_the_collectors_walk_until_it_is_cleared() -> None:
    """A full collection walked every entry: 40,000 into a run it paused the sandbox for 181 ms, and requests
    that waited were counted in one rate window and refused. Thousands of entries later, the collector tracks
    only a few of them; cleared, the log gives back what it froze."""
    import gc

    from devstack.sandbox.effects import EffectLog

    log = EffectLog()
    gc.collect()
    before = len(gc.get_objects())
    try:
        for i in range(2 * EffectLog.FREEZE_EVERY):
            log.record("llm.call", model="m", messages_sha256=f"{i:064x}", usage={"tokens": [i, i + 1]})
        tracked = len(gc.get_objects()) - before
        assert log.count("llm.call") == 2 * EffectLog.FREEZE_EVERY
        assert gc.get_freeze_count() > 0 and tracked < EffectLog.FREEZE_EVERY, tracked  # each entry tracks ≥ 2
    finally:
        log.clear()
    assert gc.get_freeze_count() == 0 and log.count() == 0
