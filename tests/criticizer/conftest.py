"""Criticizer fixtures: a code location whose results go to their own Slack path, and requests in the sandbox."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from assets.criticizer import api, pipeline
from orchestration.definitions import build_definitions
from redrive.settings import Settings

ALERTS_PATH = "redrive-alerts"  # the stack's SLACK_WEBHOOK_URL: the core's alert channel
RESULTS_PATH = "criticizer-results"  # CRITICIZER_RESULTS_SLACK_WEBHOOK_URL in these tests
CRITIQUE = {
    "verdict": "revise",
    "score": 6,
    "summary": "Clear intent, but the retry loop swallows errors.",
    "findings": [
        {"criterion": "error handling", "severity": "major", "comment": "Exceptions are caught and ignored."},
        {"criterion": "naming", "severity": "minor", "comment": "`x` says nothing."},
    ],
}


def sandbox_url(path: str = "") -> str:
    return os.environ["SANDBOX_URL"].rstrip("/") + path


def webhook_url(name: str) -> str:
    return sandbox_url(f"/slack/webhook/requester/{name}")


def slack_posts(sandbox, path: str) -> list[dict[str, Any]]:
    """Messages the sandbox's Slack receiver got on one webhook path."""
    return [e for e in sandbox.effects("slack.message") if e.get("path") == path]


def webhook_posts(sandbox, name: str) -> list[dict[str, Any]]:
    return slack_posts(sandbox, f"requester/{name}")


@pytest.fixture
def crit_settings(scaled_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("CRITICIZER_RESULTS_SLACK_WEBHOOK_URL", sandbox_url(f"/slack/webhook/{RESULTS_PATH}"))
    return scaled_settings


@pytest.fixture
def cdefs(crit_settings: Settings) -> dg.Definitions:
    """The whole code location on this test's database, waits × 0.001, results to their own Slack path."""
    return build_definitions(crit_settings)


@pytest.fixture
def submit(engine: sa.Engine, sandbox, instance: dg.DagsterInstance) -> Callable[..., str]:
    """Put an artifact in the sandbox store, submit a request for it, and add its partition."""
    sandbox.set_default("llm", content=json.dumps(CRITIQUE))

    def _submit(name: str = "req-1", *, artifact: bytes = b"def retry():\n    try: x()\n    except: pass\n",
                rubric: str = "Is the error handling sound?", headers: Mapping[str, str] | None = None,
                **extra: Any) -> str:
        path = f"reviews/{name}.py"
        sandbox.put_store(path, artifact, "text/x-python")
        submitted = api.submit(engine, {
            "request_id": name, "artifact_url": sandbox_url(f"/store/{path}"), "rubric": rubric,
            "webhook_url": webhook_url(name),
            "webhook_headers": dict(headers or {"Authorization": "Bearer wh-token-1"}),
            **extra,
        }, allowed_artifact_prefixes=())  # any URL: the API's own check is tested in test_api
        instance.add_dynamic_partitions(pipeline.requests_partitions.name, [submitted.request_id])
        return submitted.request_id

    return _submit


@pytest.fixture
def run(cdefs: dg.Definitions, instance: dg.DagsterInstance) -> Callable[..., dg.ExecuteInProcessResult]:
    """Execute the criticizer job for one request's partition, as a first run or with replay/retry config."""

    def _run(request_id: str, extra: Mapping[str, Any] | None = None, *, defs: dg.Definitions | None = None,
             tags: Mapping[str, str] | None = None) -> dg.ExecuteInProcessResult:
        job = (defs or cdefs).resolve_job_def("criticizer_job")
        return job.execute_in_process(run_config=pipeline.run_config(request_id, extra or {}), instance=instance,
                                      partition_key=request_id, tags=dict(tags or {}), raise_on_error=False)

    return _run


def retry_waits(instance: dg.DagsterInstance, run_id: str, stage: str) -> list[float]:
    """seconds_to_wait of each STEP_UP_FOR_RETRY of one stage's op, from Dagster's event log."""
    events = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY).records
    return [r.event_log_entry.dagster_event.step_retry_data.seconds_to_wait for r in events
            if r.event_log_entry.step_key == pipeline.OPS[stage]]
