"""Requests become partitions and runs through the sensor; long waits leave the run and come back by timer."""

from __future__ import annotations

import sqlalchemy as sa

from assets.criticizer import api, pipeline
from orchestration.definitions import build_definitions
from redrive.schema import dead_letters, deferred_attempts
from tests.criticizer.conftest import sandbox_url, webhook_posts, webhook_url
from tests.dagster_helpers import launch, tick


def _request(name: str) -> dict[str, object]:
    return {"request_id": name, "artifact_url": sandbox_url(f"/store/reviews/{name}.md"), "rubric": "Clear?",
            "webhook_url": webhook_url(name)}


def test_submitted_requests_become_partitions_and_runs_once(cdefs, instance, engine, sandbox, submit) -> None:
    """Each submitted request gets a dynamic partition and one run keyed by request and attempt 1; then nothing."""
    # (the `submit` fixture is used only for the LLM's default critique: these requests go through the API)
    for name in ("doc-a", "doc-b"):
        sandbox.put_store(f"reviews/{name}.md", b"# Title\nBody.", "text/markdown")
        api.submit(engine, _request(name))
    requests = tick(cdefs, instance, "criticizer_new_requests")
    assert [(r.run_key, r.partition_key) for r in requests] == [
        ("criticizer:run:doc-a:attempt-1", "doc-a"), ("criticizer:run:doc-b:attempt-1", "doc-b")]
    assert set(instance.get_dynamic_partitions(pipeline.requests_partitions.name)) == {"doc-a", "doc-b"}
    assert tick(cdefs, instance, "criticizer_new_requests") == requests  # a repeated tick: same keys, deduped

    for request in requests:
        result = launch(cdefs, instance, request)
        assert result.success
        assert instance.get_run_by_id(result.run_id).tags["dagster/partition"] == request.partition_key
    assert [api.status(engine, n).status for n in ("doc-a", "doc-b")] == ["done", "done"]
    assert tick(cdefs, instance, "criticizer_new_requests") == []


def test_retry_after_over_the_durable_threshold_resumes_from_a_timer(crit_settings, instance, engine, sandbox,
                                                                     submit, run) -> None:
    """Retry-After 120 over a 60 s threshold: the run ends, a timer brings attempt 2 of llm; fetch is not redone."""
    defs = build_definitions(crit_settings.model_copy(update={"redrive_durable_wait_threshold_seconds": 60.0,
                                                              "redrive_time_scale": 0.0}))  # due at once
    request_id = submit("durable")
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "120"}})
    first = run(request_id, defs=defs)
    assert first.success and instance.get_run_by_id(first.run_id).tags["redrive/deferred"] == "true"
    assert webhook_posts(sandbox, "durable") == []
    with engine.connect() as conn:
        timer = conn.execute(sa.select(deferred_attempts)).one()
    assert (timer.entity_ref, timer.attempt) == ("durable", 2)
    assert timer.payload["stage"] == "llm" and timer.payload["prior_attempts"]["llm"] == 1

    [request] = tick(defs, instance, "criticizer_deferred_retries")
    assert request.run_key == "criticizer:run:durable:attempt-2" and request.partition_key == "durable"
    assert launch(defs, instance, request).success
    assert sandbox.count("store.fetch") == 1 and len(webhook_posts(sandbox, "durable")) == 1
    assert api.status(engine, request_id).stage_attempts == {"fetch": 1, "llm": 2, "notify": 1}
    assert tick(defs, instance, "criticizer_deferred_retries") == []


def test_attempts_carry_across_the_durable_run(crit_settings, instance, engine, sandbox, submit, run) -> None:
    """The budget counts the earlier run's attempt: a 401 in the resumed run is llm's attempt 2 of 5."""
    defs = build_definitions(crit_settings.model_copy(update={"redrive_durable_wait_threshold_seconds": 60.0,
                                                              "redrive_time_scale": 0.0}))
    request_id = submit("carry")
    sandbox.script("llm", {"status": 429, "headers": {"Retry-After": "120"}}, {"status": 401})
    run(request_id, defs=defs)
    [request] = tick(defs, instance, "criticizer_deferred_retries")
    assert not launch(defs, instance, request).success
    with engine.connect() as conn:
        letter = conn.execute(sa.select(dead_letters)).one()
    assert (letter.stage, letter.attempts, letter.error_class) == ("llm", 2, "AUTH_DENIED")
    assert letter.stage_attempts == {"fetch": 1, "llm": 2}
