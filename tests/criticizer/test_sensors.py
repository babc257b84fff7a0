"""Requests become due rows; the due-work sensor starts one drain run per round, never one per request."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import dagster as dg
import sqlalchemy as sa

from assets.criticizer import api
from redrive import work
from redrive.schema import work_items
from tests.criticizer.conftest import sandbox_url, webhook_url
from tests.dagster_helpers import launch, tick


def _request(name: str) -> dict[str, object]:
    return {"request_id": name, "artifact_url": sandbox_url(f"/store/reviews/{name}.md"), "rubric": "Clear?",
            "webhook_url": webhook_url(name)}


def test_submitted_requests_are_worked_by_one_drain_run(cdefs, instance, engine, sandbox, submit) -> None:
    """Thirty requests: one tick asks for one run (key names the round), which completes all thirty."""
    for i in range(30):
        sandbox.put_store(f"reviews/doc-{i}.md", b"# Title\nBody.", "text/markdown")
        api.submit(engine, _request(f"doc-{i}"))
    [request] = tick(cdefs, instance, "criticizer_due_work")
    assert request.run_key == "criticizer:drain:round-1" and request.partition_key is None
    assert request.tags["redrive/pipeline"] == "criticizer"
    result = launch(cdefs, instance, request)
    assert result.success and result.output_for_node("criticizer_drain")["done"] == 30
    assert {api.status(engine, f"doc-{i}").status for i in range(30)} == {"done"}
    assert tick(cdefs, instance, "criticizer_due_work") == []  # nothing due: no run
    assert len(instance.get_runs()) == 1


def test_a_second_tick_while_a_drain_run_is_queued_requests_nothing(cdefs, instance, engine, sandbox, submit) -> None:
    """While a drain run of the job is queued or running, the sensor waits for it instead of piling up runs."""
    sandbox.put_store("reviews/q.md", b"# T", "text/markdown")
    api.submit(engine, _request("q"))
    [request] = tick(cdefs, instance, "criticizer_due_work")
    job = cdefs.resolve_job_def("criticizer_job")
    instance.create_run_for_job(job, run_config={}, tags={"dagster/run_key": request.run_key},
                                status=dg.DagsterRunStatus.QUEUED)
    assert tick(cdefs, instance, "criticizer_due_work") == []


def test_a_retry_not_yet_due_starts_no_run(cdefs, instance, engine) -> None:
    """A row due in an hour (a long backoff) is not work yet: no run until it falls due."""
    later = datetime.now(UTC) + timedelta(hours=1)
    with engine.begin() as conn:
        work.enqueue(conn, "criticizer", "later", now=later)
    assert tick(cdefs, instance, "criticizer_due_work") == []
    with engine.begin() as conn:
        conn.execute(sa.update(work_items).values(due_at=datetime.now(UTC) - timedelta(seconds=1)))
    assert [r.run_key for r in tick(cdefs, instance, "criticizer_due_work")] == ["criticizer:drain:round-1"]
