"""The criticizer's part of the code location: its partitioned job, its sensors, its resource, its migration."""

from __future__ import annotations

import sqlalchemy as sa

from redrive.db import VERSION_TABLE


def test_job_sensors_and_resource_are_in_the_code_location(cdefs, crit_settings) -> None:
    """One drain op on the in-process executor with a retry policy, no per-request partition; the due-work
    sensor, and no per-entity durable-retry sensor; the allowed store."""
    job = cdefs.resolve_job_def("criticizer_job")
    assert [n.name for n in job.nodes] == ["criticizer_drain"]
    assert job.partitions_def is None and job.executor_def.name == "in_process"
    assert job.graph.node_named("criticizer_drain").definition.retry_policy is not None
    assert job.tags["redrive/pipeline"] == "criticizer"
    sensors = {s.name for s in cdefs.sensors}
    assert "criticizer_due_work" in sensors and "criticizer_deferred_retries" not in sensors
    http = cdefs.resources["criticizer_http"]
    assert http.artifact_url_prefixes == [crit_settings.store_url.rstrip("/") + "/"]
    assert http.results_slack_webhook_url.endswith("/slack/webhook/criticizer-results")


def test_migration_branch_is_at_its_head(engine) -> None:
    """Revision 0401 (branch `criticizer`, off 0002) is applied and created both tables."""
    with engine.connect() as conn:
        heads = set(conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars())
        tables = set(sa.inspect(conn).get_table_names())
    assert "0401" in heads
    assert {"criticizer_requests", "criticizer_deliveries"} <= tables
