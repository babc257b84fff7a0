"""The criticizer's part of the code location: its partitioned job, its sensors, its resource, its migration."""

from __future__ import annotations

import dagster as dg
import sqlalchemy as sa

from assets.criticizer import pipeline
from redrive.db import VERSION_TABLE


def test_job_sensors_and_resource_are_in_the_code_location(cdefs, crit_settings) -> None:
    """One op per stage on a dynamic partition per request; new-request and durable-retry sensors; allowed store."""
    job = cdefs.resolve_job_def("criticizer_job")
    assert {k.name: {i: d.node for i, d in v.items()} for k, v in job.dependencies.items()} == {
        "criticizer_fetch": {}, "criticizer_llm": {"fetched": "criticizer_fetch"},
        "criticizer_notify": {"critiqued": "criticizer_llm"}}
    assert isinstance(job.partitions_def, dg.DynamicPartitionsDefinition)
    assert job.partitions_def.name == "criticizer_requests"
    sensors = {s.name for s in cdefs.sensors}
    assert {"criticizer_new_requests", "criticizer_deferred_retries", "redrive_dead_letter_replays"} <= sensors
    http = cdefs.resources["criticizer_http"]
    assert http.artifact_url_prefixes == [crit_settings.store_url.rstrip("/") + "/"]
    assert http.results_slack_webhook_url == "CRITICIZER_RESULTS_SLACK_WEBHOOK_URL"  # an EnvVar: the UI shows the name
    assert pipeline.run_config("r1", {"replay_of": 3, "unknown": 1})["ops"]["criticizer_llm"]["config"] == {
        "request_id": "r1", "replay_of": 3}


def test_migration_branch_is_at_its_head(engine) -> None:
    """Revision 0401 (branch `criticizer`, off 0002) is applied and created both tables."""
    with engine.connect() as conn:
        heads = set(conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars())
        tables = set(sa.inspect(conn).get_table_names())
    assert "0401" in heads
    assert {"criticizer_requests", "criticizer_deliveries"} <= tables
