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
    assert http.results_slack_webhook_url == "CRITICIZER_RESULTS_SLACK_WEBHOOK_URL"  # an EnvVar: the UI shows the name


def test_migration_branch_is_at_its_head(engine) -> None:
    """The criticizer branch (0401 off 0002, then 0421: the pruner's indexes) is at its head with both tables."""
    with engine.connect() as conn:
        heads = set(conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars())
        tables = set(sa.inspect(conn).get_table_names())
    assert "0421" in heads
    assert {"criticizer_requests", "criticizer_deliveries"} <= tables
