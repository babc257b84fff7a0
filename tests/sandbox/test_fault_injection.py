"""Scripted and random faults, served over real sockets."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from devstack.sandbox import SandboxClient
from devstack.sandbox.wire import DEFAULT_LLM_CONTENT

from .payloads import LLM_AUTH, chat_body, mail

CHAT = "/llm/v1/chat/completions"


def test_scripted_sequence_is_served_in_order(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A 429 with Retry-After, then a 503, then success are served in that order and logged as such."""
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "3"}}, {"status": 503}, {"kind": "ok"})

    first, second, third = (http.post(CHAT, json=chat_body(), headers=LLM_AUTH) for _ in range(3))

    assert first.status_code == 429
    assert first.headers["Retry-After"] == "3"
    assert first.json()["error"]["code"] == "rate_limit_exceeded"
    assert second.status_code == 503
    assert third.status_code == 200
    completion = third.json()
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"] == {"role": "assistant", "content": DEFAULT_LLM_CONTENT, "refusal": None}
    assert completion["choices"][0]["finish_reason"] == "stop"
    served = [(r["step"], r["status"]) for r in sandbox.requests("llm")]
    assert served == [("status:429", 429), ("status:503", 503), ("ok", 200)]
    assert sandbox.count("llm.call") == 1


def test_a_matched_script_meets_only_its_own_requests(sandbox: SandboxClient, http: httpx.Client) -> None:
    """Faults scripted for one entity (its text in the body) skip the requests of others sent before it."""
    sandbox.script("llm", {"status": 401}, match="request demo-b")
    assert [s["status"] for s in sandbox.faults()["llm"]["matched"]["request demo-b"]] == [401]

    other = http.post(CHAT, json=chat_body("request demo-a"), headers=LLM_AUTH)
    mine = http.post(CHAT, json=chat_body("request demo-b"), headers=LLM_AUTH)
    again = http.post(CHAT, json=chat_body("request demo-b"), headers=LLM_AUTH)

    assert (other.status_code, mine.status_code, again.status_code) == (200, 401, 200)
    assert mine.json()["error"]["code"] == "invalid_api_key"
    assert sandbox.faults()["llm"]["matched"] == {}


def test_error_code_shorthand_fills_the_openai_error_body(sandbox: SandboxClient, http: httpx.Client) -> None:
    """`error_code` sets the code of the default OpenAI error body, e.g. context_length_exceeded."""
    sandbox.script("llm", {"status": 400, "error_code": "context_length_exceeded"})
    answer = http.post(CHAT, json=chat_body(), headers=LLM_AUTH)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert answer.json()["error"]["type"] == "invalid_request_error"


def test_content_step_and_default_content_shape_the_llm_answer(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A content step answers once with its content; afterwards the admin-set default applies."""
    sandbox.set_default("llm", content='{"label": "fraud"}')
    sandbox.script("llm", {"kind": "content", "content": '{"label": "benign"}'})

    contents = [
        http.post(CHAT, json=chat_body(), headers=LLM_AUTH).json()["choices"][0]["message"]["content"]
        for _ in range(2)
    ]
    assert contents == ['{"label": "benign"}', '{"label": "fraud"}']


def test_an_llm_answer_set_for_a_prompt_text_answers_only_those_prompts(sandbox: SandboxClient,
                                                                       http: httpx.Client) -> None:
    """One sandbox serves two pipelines' tasks: a prompt containing the text gets its answer, others the default."""
    sandbox.set_default("llm", content='{"label": "fraud"}')
    sandbox.set_default("llm", content='{"matches": []}', when="You match business documents")

    def ask(text: str) -> str:
        return http.post(CHAT, json=chat_body(text), headers=LLM_AUTH).json()["choices"][0]["message"]["content"]

    assert ask("You match business documents. Candidate 1: ...") == '{"matches": []}'
    assert ask("classify this") == '{"label": "fraud"}'


def test_client_timeout_happens_on_the_wire(sandbox: SandboxClient) -> None:
    """A client with a 0.3 s timeout gives up on a held-open request instead of getting an answer."""
    sandbox.script("llm", {"kind": "timeout", "seconds": 3})
    started = time.monotonic()
    with httpx.Client(base_url=sandbox.base_url, timeout=0.3) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(CHAT, json=chat_body(), headers=LLM_AUTH)
    assert time.monotonic() - started < 2
    assert [r["step"] for r in sandbox.requests("llm")] == ["timeout"]


def test_malformed_body_is_json_typed_but_unparseable(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A malformed step answers 200 with a JSON content type and a body json cannot parse."""
    sandbox.script("llm", {"kind": "malformed"})
    answer = http.post(CHAT, json=chat_body(), headers=LLM_AUTH)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("application/json")
    with pytest.raises(json.JSONDecodeError):
        json.loads(answer.text)
    assert sandbox.count() == 0


def test_schema_invalid_keeps_the_envelope_but_breaks_the_content(sandbox: SandboxClient, http: httpx.Client) -> None:
    """For the llm the completion is valid but its content has the wrong shape; elsewhere the body does."""
    sandbox.script("llm", {"kind": "schema_invalid"})
    sandbox.script("mail.send", {"kind": "schema_invalid"})

    completion = http.post(CHAT, json=chat_body(), headers=LLM_AUTH).json()
    sent = http.post("/mail/v1/messages", json=mail("tok-schema"))

    assert json.loads(completion["choices"][0]["message"]["content"]) == {"unexpected": "shape"}
    assert sent.status_code == 200
    assert sent.json() == {"unexpected": "shape"}
    assert sandbox.count() == 0


def test_reset_step_drops_the_connection_mid_answer(sandbox: SandboxClient, http: httpx.Client) -> None:
    """A reset step leaves the client with a broken connection rather than any HTTP answer."""
    sandbox.script("pdf.health", {"kind": "reset"})
    with pytest.raises(httpx.RemoteProtocolError):
        http.get("/pdf/v1/health")
    assert http.get("/pdf/v1/health").json() == {"status": "ok"}
    assert [(r["step"], r["outcome"]) for r in sandbox.requests("pdf.health")] == [
        ("reset", "dropped"),
        ("ok", "answered"),
    ]


def test_scripted_health_probe_can_fail(sandbox: SandboxClient, http: httpx.Client) -> None:
    """The pdf health route is scriptable so a circuit breaker's probe can be made to fail."""
    sandbox.script("pdf.health", {"status": 503}, {"status": 503})
    assert [http.get("/pdf/v1/health").status_code for _ in range(3)] == [503, 503, 200]


def _statuses(sandbox: SandboxClient, http: httpx.Client, seed: int) -> list[int]:
    sandbox.reset()
    sandbox.random_faults("pdf.health", seed=seed, rates={"429": 0.3, "503": 0.1}, retry_after="1")
    return [http.get("/pdf/v1/health").status_code for _ in range(50)]


def test_seeded_random_faults_are_reproducible(sandbox: SandboxClient, http: httpx.Client) -> None:
    """The same seed yields the same 50 statuses after a reset, at a plausible 429 rate."""
    first = _statuses(sandbox, http, seed=42)
    second = _statuses(sandbox, http, seed=42)
    other = _statuses(sandbox, http, seed=43)

    assert first == second
    assert first != other
    assert 5 <= first.count(429) <= 25  # 30% of 50 is 15; the bounds sit ~3 sd away
    assert set(first) <= {200, 429, 503}


def test_random_faults_stop_when_deleted(sandbox: SandboxClient, http: httpx.Client) -> None:
    """Deleting a route's random faults restores normal answers."""
    sandbox.random_faults("pdf.health", seed=1, rates={"503": 1.0})
    assert http.get("/pdf/v1/health").status_code == 503
    sandbox.stop_random_faults("pdf.health")
    assert http.get("/pdf/v1/health").status_code == 200


def test_unknown_step_kind_is_refused_with_a_clear_message(http: httpx.Client) -> None:
    """An unknown step kind answers 422 naming the bad kind and the allowed ones."""
    answer = http.post("/_admin/faults/llm", json={"steps": [{"kind": "explode"}]})
    assert answer.status_code == 422
    message = answer.json()["error"]["message"]
    assert "'explode'" in message
    assert "timeout" in message and "effect_then_error" in message


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/_admin/faults/llm", {"steps": [{"status": 429, "retry": 3}]}, 422),
        ("/_admin/faults/llm", {"steps": []}, 422),
        ("/_admin/faults/mail.send", {"steps": [{"kind": "content", "content": "x"}]}, 422),
        ("/_admin/faults/lml", {"steps": [{"kind": "ok"}]}, 404),
        ("/_admin/faults/llm/random", {"seed": 1, "rates": {"429": 0.7, "503": 0.7}}, 422),
        ("/_admin/routes/mail.send/default", {"content": "x"}, 422),
    ],
)
def test_bad_admin_input_is_refused(http: httpx.Client, path: str, body: object, status: int) -> None:
    """Extra fields, empty scripts, misplaced steps, unknown routes and impossible rates never apply."""
    answer = http.post(path, json=body)
    assert answer.status_code == status
    assert answer.json()["error"]["message"]
    assert all(not route["pending"] for route in http.get("/_admin/faults").json()["routes"].values())
