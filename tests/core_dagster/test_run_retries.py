"""Issue 13 §8: the instance's `run_retries` re-run infrastructure failures only, never a run the core settled.

Real runs on a Dagster instance with PostgreSQL storage and the `run_retries` section of
`dagster.yaml.example`; the run-retry daemon's own filter (`filter_runs_to_should_retry`) decides.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import dagster as dg
import httpx
import pytest
import yaml
from dagster._daemon.auto_run_reexecution.auto_run_reexecution import filter_runs_to_should_retry

from assets.rehearsal import pipeline as rehearsal
from devstack.postgres import create_database, drop_database, with_database
from devstack.stack import DAGSTER_YAML
from redrive.db import engine_for, normalize_url
from redrive.reliability import Reliability
from redrive.settings import PROJECT_ROOT
from redrive.stages import DEFERRED_TAG, OP_RETRY_POLICY, Unit, run_stage, sanitized_body


def example_run_retries() -> dict:
    return yaml.safe_load((PROJECT_ROOT / "dagster.yaml.example").read_text())["run_retries"]


@pytest.fixture
def pg_instance(admin_url: str) -> Iterator[dg.DagsterInstance]:
    """A Dagster instance on its own PostgreSQL database, with the example's run retries."""
    name = f"dagster_rr_{os.getpid()}"
    drop_database(admin_url, name)
    create_database(admin_url, name)
    url = normalize_url(with_database(admin_url, name))
    overrides = {"storage": {"postgres": {"postgres_url": url}}, "run_retries": example_run_retries(),
                 "compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager",
                                  "class": "NoOpComputeLogManager"}}
    with dg.instance_for_test(overrides=overrides) as instance:
        yield instance
    drop_database(admin_url, name)


@dg.resource
def unreachable_database(_) -> None:
    """The run cannot start: its database is down (an infrastructure failure, not the op's)."""
    raise ConnectionRefusedError("database unreachable")


@dg.op(required_resource_keys={"database"})
def needs_database() -> None:
    pass


@dg.job(resource_defs={"database": unreachable_database}, tags={"redrive/pipeline": "rehearsal"})
def infrastructure_job() -> None:
    needs_database()


def deferring_job(db_url: str) -> dg.JobDefinition:
    """A stage whose retryable failure waits longer than the durable threshold: a timer, then the op fails."""

    @dg.op(retry_policy=OP_RETRY_POLICY)
    @sanitized_body
    def defer_op(context) -> None:
        runtime = Reliability(engine=engine_for(db_url), durable_threshold=0.0)

        def call() -> None:
            raise httpx.ConnectError("connection refused")

        run_stage(context, runtime, Unit(pipeline="rehearsal", entity_ref="req-deferred"), "ask",
                  rehearsal.POLICIES["ask"], call)

    @dg.job(tags={"redrive/pipeline": "rehearsal"})
    def deferring() -> None:
        defer_op()

    return deferring


def test_example_and_devstack_instances_retry_only_infrastructure_failures() -> None:
    """Both instance configs say so: Dagster's default would re-run a run for any failure."""
    assert example_run_retries().get("retry_on_asset_or_op_failure") is False
    assert yaml.safe_load(DAGSTER_YAML)["run_retries"] == example_run_retries()


def test_only_infrastructure_failures_are_retried(pg_instance, defs, db_url, sandbox, rehearsal_request) -> None:
    """Dead-lettered and deferred runs are not re-run; a run that could not start is (once)."""
    sandbox.script("llm", {"status": 403})
    dead_lettered = defs.resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config(rehearsal_request, {}), instance=pg_instance, raise_on_error=False)
    deferred = deferring_job(db_url).execute_in_process(instance=pg_instance, raise_on_error=False)
    infrastructure = infrastructure_job.execute_in_process(instance=pg_instance, raise_on_error=False)

    runs = {name: pg_instance.get_run_by_id(r.run_id) for name, r in
            {"dead_lettered": dead_lettered, "deferred": deferred, "infrastructure": infrastructure}.items()}
    assert all(run.status == dg.DagsterRunStatus.FAILURE for run in runs.values())
    assert runs["dead_lettered"].tags["redrive/dead_lettered"] == "true"
    assert runs["deferred"].tags[DEFERRED_TAG] == "true"
    assert {name: run.tags.get("dagster/will_retry") for name, run in runs.items()} == {
        "dead_lettered": "false", "deferred": "false", "infrastructure": "true"}
    retried = [run.run_id for run in filter_runs_to_should_retry(list(runs.values()), pg_instance)]
    assert retried == [infrastructure.run_id]
