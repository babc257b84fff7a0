"""Criticizer demo: four critique requests through fetch → llm → notify with faults injected in the sandbox.

- clean: done at once;
- flaky: a 503 from the store, a 429 with Retry-After 120 and an LLM internal_error, a 502 from the
  webhook, each retried within its own stage's budget, then done;
- exhausted: five 503s spend llm's budget → dead letter + alert; a replay without remediation
  evidence is refused; with evidence it runs llm and notify only (the artifact is fetched once);
- denied: the webhook answers 401 → dead letter + alert; a replay without a real fix fails with the
  same class → escalated + escalation alert; after the fix a second replay closes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from assets.criticizer import api
from assets.criticizer.policy import PIPELINE, STAGES
from assets.criticizer.settings import CriticizerSettings
from redrive import deadletters
from redrive.clock import SystemClock
from redrive.deadletters import ReplayRefused

CRITIQUE = {
    "verdict": "revise",
    "score": 5,
    "summary": "The retry loop retries everything, including 401s, forever.",
    "findings": [{"criterion": "failure handling", "severity": "major",
                  "comment": "Classify errors; stop on non-retryable ones."}],
}
ARTIFACT = b"while True:\n    try:\n        return call()\n    except Exception:\n        continue\n"
SENSOR = "criticizer_due_work"
THROUGH_DAEMON = True  # under `make demo` the daemon's ticks of SENSOR start the drain runs


def ordered(attempts: Any) -> str:
    return json.dumps({s: attempts[s] for s in STAGES if s in attempts})


@dataclass(frozen=True)
class Drained:
    success: bool  # the request ended done
    retries: int  # retries its drain runs scheduled


def retries_of(stage_attempts: Any) -> int:
    """Each attempt of a stage after its first was a retry the drain scheduled."""
    return sum(max(0, n - 1) for n in stage_attempts.values())


def run_demo(ctx):  # -> orchestration.demo.DemoReport
    from orchestration.demo import DemoReport

    report = DemoReport(PIPELINE)
    sandbox, base = ctx.sandbox, ctx.sandbox.base_url
    # this session's artifact paths are in its prompts: other pipelines' LLM calls get their own answers
    sandbox.set_default("llm", content=json.dumps(CRITIQUE), when=f"demo/{ctx.session}/criticizer/")
    ctx.tick(SENSOR)  # requests a crashed earlier demo left behind must not eat our faults

    def request_id(name: str) -> str:
        return f"demo-{ctx.session}-{name}"

    def path(name: str) -> str:
        return f"demo/{ctx.session}/criticizer/{name}.py"

    def script(name: str, route: str, *steps: dict[str, Any]) -> None:
        """Faults for this request's calls only (its artifact path is in the fetch and the LLM prompt, its id in
        the webhook's path): a drain run the daemon starts at any moment, or an alert, meets none of them."""
        sandbox.script(route, *steps, match=request_id(name) if route == "slack" else path(name))

    def submit(name: str) -> str:
        sandbox.put_store(path(name), ARTIFACT, "text/x-python")
        api.submit(ctx.engine, {
            "request_id": request_id(name), "artifact_url": f"{base}/store/{path(name)}",
            "rubric": "Does the code handle failures the way 002 §8 says?",
            "webhook_url": f"{base}/slack/webhook/demo-criticizer/{request_id(name)}",
            "webhook_headers": {"Authorization": f"Bearer demo-webhook-token-{ctx.session}"},
        }, allowed_artifact_prefixes=CriticizerSettings().allowed_prefixes(ctx.settings))
        return request_id(name)

    def start(request: str) -> Drained:
        """The due-work sensor's drain runs work the request until it is done or dead-lettered."""
        before = api.status(ctx.engine, request).stage_attempts
        ctx.settle(SENSOR, PIPELINE, [request])
        found = api.status(ctx.engine, request)
        return Drained(found.status == "done", retries_of(found.stage_attempts) - retries_of(before))

    def fetches(request: str) -> int:
        name = request.rsplit("-", 1)[-1]
        return sum(1 for e in sandbox.effects("store.fetch") if e.get("path") == path(name))

    def letter_of(request: str) -> deadletters.DeadLetter:
        with ctx.engine.connect() as conn:
            letter = deadletters.active_for(conn, PIPELINE, request)
        assert letter is not None, f"{request}: no dead letter"
        return letter

    def replay(letter_id: int, request: str, evidence: str | None) -> Drained:
        with ctx.engine.begin() as conn:
            deadletters.request_replay(conn, letter_id, evidence=evidence, confirm_safe=True,
                                       at=SystemClock().now(), operator="demo")
        return start(request)  # the replayed request's row is due again: the next drain run works it

    # clean
    clean = submit("clean")
    assert start(clean).success, "clean request not done"
    report.done += 1

    # flaky: every stage meets a retryable fault and rides it out on its own budget
    script("flaky", "store", {"status": 503})
    script("flaky", "llm", {"status": 429, "headers": {"Retry-After": "120"}}, {"status": 500})
    script("flaky", "slack", {"status": 502})  # notify's first call is the webhook post
    flaky = submit("flaky")
    result = start(flaky)
    assert result.success, "flaky request did not ride out its faults"
    found = api.status(ctx.engine, flaky)
    assert found.stage_attempts == {"fetch": 2, "llm": 3, "notify": 2}, found.stage_attempts
    report.done += 1
    report.retried += result.retries
    report.notes.append(f"{flaky}: store 503, LLM 429 (Retry-After 120 → waited 120 s × time scale) and 500, "
                        f"webhook 502 — retried per stage {ordered(found.stage_attempts)}, then done")

    # exhausted: llm spends its 5 attempts; the replay needs evidence, then starts at llm
    script("exhausted", "llm", *[{"status": 503}] * 5)
    exhausted = submit("exhausted")
    result = start(exhausted)
    assert not result.success
    report.retried += result.retries
    report.dead_lettered += 1
    letter = letter_of(exhausted)
    assert (letter.stage, letter.error_class, letter.attempts) == ("llm", "NETWORK_TRANSIENT", 5)
    try:
        replay(letter.id, exhausted, None)
        raise AssertionError("a replay without remediation evidence was accepted")
    except ReplayRefused as refused:
        report.notes.append(f"{exhausted}: replay without evidence refused: {refused}")
    replayed = replay(letter.id, exhausted, "DEMO-7: LLM provider recovered (status page green)")
    assert replayed.success and fetches(exhausted) == 1, "replay re-fetched or failed"
    with ctx.engine.connect() as conn:
        status = conn.execute(sa.text("SELECT status FROM dead_letters WHERE id = :i"), {"i": letter.id}).scalar()
    assert status == "resolved"
    report.done += 1
    report.notes.append(f"{exhausted}: 5 × 503 spent llm's budget → dead letter {letter.id} (stage_attempts "
                        f"{ordered(letter.stage_attempts)}) + alert; replayed from llm with evidence, "
                        f"artifact fetched {fetches(exhausted)}× in all → {status}")

    # denied: the webhook refuses our credentials; a replay without the real fix escalates
    script("denied", "slack", {"status": 401})
    denied = submit("denied")
    assert not start(denied).success
    report.dead_lettered += 1
    letter = letter_of(denied)
    assert (letter.stage, letter.error_class) == ("notify", "AUTH_DENIED")
    script("denied", "slack", {"status": 401})
    again = replay(letter.id, denied, "DEMO-8: rotated the webhook token")
    assert not again.success and letter_of(denied).status == "escalated", "same class after replay did not escalate"
    fixed = replay(letter.id, denied, "DEMO-9: the requester re-enabled the webhook")
    assert fixed.success and api.status(ctx.engine, denied).status == "done"
    report.done += 1
    report.notes.append(f"{denied}: webhook 401 → dead letter {letter.id} + alert; replay without a fix → "
                        "AUTH_DENIED again → escalated + escalation alert; replay after the fix → resolved")
    webhook_posts = [e for e in sandbox.effects("slack.message")
                     if str(e.get("path", "")).startswith("demo-criticizer/demo-" + ctx.session)]
    report.notes.append(f"critiques delivered to requester webhooks: {len(webhook_posts)} (Slack receiver route); "
                        "each also posted to the Slack channel")
    return report
