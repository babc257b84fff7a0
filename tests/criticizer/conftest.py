"""Criticizer fixtures: a code location whose results go to their own Slack path, and requests in the sandbox."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from assets.criticizer import api
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
def submit(engine: sa.Engine, sandbox) -> Callable[..., str]:
    """Put an artifact in the sandbox store and submit a request for it (its work row is due at once)."""
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
        return submitted.request_id

    return _submit


@dataclass(frozen=True)
class Drained:
    """One drain run of the criticizer, seen from one request: did it end done, and what was retried."""

    run_id: str
    run_success: bool
    success: bool  # the request is done
    report: dict[str, Any]

    def waits(self, stage: str) -> list[float]:
        """Seconds until each retry of `stage` fell due (policy delay × the configured time scale)."""
        return [r["wait"] for r in self.report["retries"] if r["stage"] == stage]


# Waits are × 0.001 in these tests, so every retry falls due within the linger window of the same run.
DRAIN_CONFIG = {"ops": {"criticizer_drain": {"config": {"linger_seconds": 2.0, "max_seconds": 120.0}}}}


@pytest.fixture
def run(cdefs: dg.Definitions, instance: dg.DagsterInstance, engine: sa.Engine) -> Callable[..., Drained]:
    """Execute one drain run of the criticizer job (what the due-work sensor starts) and report on one request."""

    def _run(request_id: str, *, defs: dg.Definitions | None = None, config: Mapping[str, Any] | None = None,
             tags: Mapping[str, str] | None = None) -> Drained:
        job = (defs or cdefs).resolve_job_def("criticizer_job")
        result = job.execute_in_process(run_config=dict(config or DRAIN_CONFIG), instance=instance,
                                        tags=dict(tags or {}), raise_on_error=False)
        report = result.output_for_node("criticizer_drain") if result.success else {"retries": []}
        return Drained(result.run_id, result.success, api.status(engine, request_id).status == "done", report)

    return _run
