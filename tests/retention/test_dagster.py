"""The pruner in Dagster: its job runs the rules through the code location's resources, and old drain and
maintenance runs are deleted through the instance API, failed ones later, other runs never."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import dagster as dg
import sqlalchemy as sa

from orchestration.retention import MAINTENANCE_TAG, RETENTION_RETRY_POLICY, prune_dagster_runs
from redrive.drain_ops import DRAIN_TAG
from redrive.schema import work_items
from redrive.settings import Settings


def add_run(instance: dg.DagsterInstance, status: dg.DagsterRunStatus, tags: dict[str, str]) -> str:
    run_id = str(uuid.uuid4())
    instance.add_run(dg.DagsterRun(job_name="some_job", run_id=run_id, status=status, tags=tags))
    return run_id


def test_old_drain_and_maintenance_runs_go_failed_ones_later_others_never(instance) -> None:
    """At +8 days succeeded and canceled drain/maintenance runs go; failed ones at +31; asset runs and
    runs still going stay."""
    drain, upkeep = {DRAIN_TAG: "true"}, {MAINTENANCE_TAG: "true"}
    S = dg.DagsterRunStatus
    gone_first = {add_run(instance, S.SUCCESS, drain), add_run(instance, S.CANCELED, upkeep)}
    failed = {add_run(instance, S.FAILURE, drain), add_run(instance, S.FAILURE, upkeep)}
    stays = {add_run(instance, S.SUCCESS, {}), add_run(instance, S.FAILURE, {"dagster/partition": "p"}),
             add_run(instance, S.STARTED, drain), add_run(instance, S.NOT_STARTED, upkeep)}
    now = datetime.now(UTC)
    settings = Settings()

    def left() -> set[str]:
        return {r.run_id for r in instance.get_runs()}

    assert prune_dagster_runs(instance, now, settings).total == 0
    assert prune_dagster_runs(instance, now + timedelta(days=8), settings).total == 2
    assert left() == failed | stays
    assert prune_dagster_runs(instance, now + timedelta(days=31), settings).total == 2
    assert left() == stays
    assert not gone_first & left()


def test_the_retention_job_prunes_through_the_code_location(defs, instance, engine) -> None:
    """`retention_job` (hourly `retention_schedule`) removes an old done work row and keeps an open one."""
    old = datetime.now(UTC) - timedelta(days=30)
    with engine.begin() as conn:
        for name, status in (("old-done", "done"), ("old-due", "due")):
            conn.execute(sa.insert(work_items).values(pipeline="rehearsal", entity_ref=name, status=status,
                                                      due_at=old, created_at=old, updated_at=old))
    job = defs.get_job_def("retention_job")
    assert job.tags[MAINTENANCE_TAG] == "true"
    assert job.graph.node_named("prune_expired").definition.retry_policy == RETENTION_RETRY_POLICY
    assert defs.get_schedule_def("retention_schedule").job_name == "retention_job"
    result = job.execute_in_process(instance=instance)
    assert result.success
    assert result.output_for_node("prune_expired")["rows"]["core.work_items"] == 1
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT entity_ref FROM work_items")).scalars().all() == ["old-due"]


def test_the_operators_table_names_every_rule_and_its_setting() -> None:
    """docs/operating.md's Retention table lists every rule the pruner applies and the setting of its window."""
    from pathlib import Path

    from orchestration.registry import retention_rules

    page = (Path(__file__).resolve().parents[2] / "docs" / "operating.md").read_text()
    table = page[page.index("## Retention"):page.index("## Keys and secrets")]
    for rule in retention_rules(Settings()):
        assert f"`{rule.name}`" in table, rule.name
        assert f"`{rule.keep.upper()}`" in table, rule.keep
        assert rule.keep in Settings.model_fields
    for name in Settings.model_fields:
        if name.startswith("retention_") and name.endswith("_days"):
            assert f"`{name.upper()}`" in table, name
