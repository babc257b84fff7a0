"""Issue 27 §4: with nothing scripted, the sandbox's LLM answers what each pipeline that asks accepts."""

from __future__ import annotations

import json

import httpx

from assets.criticizer.policy import Critique, critique_messages
from assets.healthcheck import Pong
from assets.matching import policy as matching
from assets.rehearsal.pipeline import Verdict

from .payloads import LLM_AUTH

CHAT = "/llm/v1/chat/completions"


def answer(http: httpx.Client, messages: list[dict[str, str]]) -> dict:
    reply = http.post(CHAT, json={"model": "gpt-4o-mini", "messages": messages}, headers=LLM_AUTH)
    assert reply.status_code == 200, reply.text
    return json.loads(reply.json()["choices"][0]["message"]["content"])


def test_the_default_answer_is_valid_for_every_pipeline_that_asks(http: httpx.Client) -> None:
    """A critique for the criticizer, a verdict for the rehearsal, `ok` for the healthcheck, and for matching's
    strict reader its own "no match" (a critique there would be SCHEMA_INVALID)."""
    critique = Critique.model_validate(answer(http, critique_messages("Is it sound?", "s3://a", "def f(): pass")))
    assert critique.verdict == "approve"
    assert Verdict.model_validate(answer(http, [{"role": "user", "content": "Answer as JSON {\"verdict\": …}."}]))
    assert Pong.model_validate(answer(http, [{"role": "user", "content": "healthcheck: answer {\"ok\": true}"}])).ok
    decision = matching.MatchDecision.model_validate(answer(http, [
        {"role": "system", "content": matching.SYSTEM_PROMPT}, {"role": "user", "content": "candidates: …"}]))
    assert decision.matches == []
