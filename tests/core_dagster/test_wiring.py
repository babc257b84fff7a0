"""The code location's wiring: secrets only as EnvVar, Slack as a resource, every op retried and sanitized.

Issue 13 §1 (op bodies), §5 (no secret in the UI), §6 (Slack is a resource), §7 (asset runs name their
pipeline) and issue 12 §3 (a RetryPolicy on every op), through real runs, PostgreSQL and the sandbox.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.remote_representation.external_data import RepositorySnap
from dagster._serdes import serialize_value
from dagster_slack import SlackResource
from sqlalchemy.engine import make_url

from assets.rehearsal import pipeline as rehearsal
from assets.rehearsal import repository
from orchestration.definitions import build_definitions
from redrive.schema import dead_letters
from redrive.settings import Settings
from redrive.stages import sanitized_body
from resources.notify import SlackWebhookResource
from tests.conftest import TIME_SCALE
from tests.core_dagster.test_run_failure_sensor import evaluate_failure_sensor

CANARY = "sk-canary-op-body-4b1f9e2d7c6a5038"


def sandbox_url(path: str) -> str:
    return f"{os.environ['SANDBOX_URL']}{path}"


def config_strings(value: Any, depth: int = 0) -> Iterator[str]:
    """Every string in a resource's configuration, nested resources included (what the UI can show)."""
    assert depth < 10
    if isinstance(value, dg.ConfigurableResource):
        for name in type(value).model_fields:
            yield from config_strings(getattr(value, name), depth + 1)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield str(k)
            yield from config_strings(v, depth + 1)
    elif isinstance(value, list | tuple | set):
        for v in value:
            yield from config_strings(v, depth + 1)
    elif isinstance(value, dg.EnvVar):
        yield value.env_var_name
    elif isinstance(value, str):
        yield value


@pytest.fixture
def secrets(db_url: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Fake secrets in the environment, as a deployment sets them; DATABASE_URL is this test's database."""
    values = {
        "DATABASE_URL": make_url(db_url).set(password="canary-db-password-93c1").render_as_string(hide_password=False),
        "SLACK_WEBHOOK_URL": sandbox_url("/slack/webhook/T000/B000/canary-hook-6e0d"),
        "CRITICIZER_RESULTS_SLACK_WEBHOOK_URL": sandbox_url("/slack/webhook/canary-results-hook-2f8a"),
        "LLM_API_KEY": "canary-llm-key-0c5e7a",
        "CASE_API_TOKEN": "canary-case-token-5d1e",
        "MAIL_API_TOKEN": "canary-mail-token-8b2c",
        "REVIEW_NOTIFICATIONS_MAIL_API_TOKEN": "canary-review-token-4a7f",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLACK_BOT_TOKEN", raising=False)
    return values


def needles(secrets: dict[str, str]) -> dict[str, str]:
    """What must not show: each value, and the parts of URLs that are the credential."""
    out = dict(secrets)
    out["DATABASE_URL password"] = "canary-db-password-93c1"
    out["SLACK_WEBHOOK_URL path"] = "canary-hook-6e0d"
    return out


def test_no_secret_in_any_resource_config_and_they_resolve_at_run_time(secrets, engine, sandbox, instance) -> None:
    """DATABASE_URL, Slack webhooks and tokens are EnvVars: the config and the UI's snapshot hold only the
    names, and a real run still reaches the database and the Slack webhook with the values."""
    defs = build_definitions(Settings(redrive_time_scale=TIME_SCALE))
    strings = [s for resource in defs.resources.values() for s in config_strings(resource)]
    assert "DATABASE_URL" in strings and "SLACK_WEBHOOK_URL" in strings  # the walk reaches nested resources
    snapshot = serialize_value(RepositorySnap.from_def(defs.get_repository_def()))  # what the UI is sent
    for what, value in needles(secrets).items():
        assert not [s for s in strings if value in s], f"{what} is in a resource's config"
        assert value not in snapshot, f"{what} is in the repository snapshot"

    sandbox.put_store("docs/a.txt", b"artifact", "text/plain")
    with engine.begin() as conn:
        repository.create(conn, "req-env", "docs/a.txt", "fair?")
    sandbox.script("llm", {"status": 403})  # permanent: dead letter in PostgreSQL, alert to Slack
    result = defs.resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config("req-env", {}), instance=instance, raise_on_error=False)
    assert not result.success
    with engine.connect() as conn:
        assert conn.execute(sa.select(dead_letters.c.entity_ref)).scalars().all() == ["req-env"]
    [message] = sandbox.effects("slack.message")
    assert message["path"] == "T000/B000/canary-hook-6e0d"  # the EnvVar resolved to the real webhook


def test_slack_is_a_top_level_dagster_slack_resource_the_alerts_use(settings, sandbox, instance,
                                                                     monkeypatch) -> None:
    """With a bot token, "slack" is dagster-slack's SlackResource; the notifier nests that very object, and
    the run-failure sensor's alert goes through it to chat.postMessage (token resolved from its EnvVar)."""
    monkeypatch.setenv("SLACK_BOT_TOKEN", "xoxb-canary-bot-token-1a2b3c")
    defs = build_definitions(settings.model_copy(update={"slack_bot_token": "xoxb-canary-bot-token-1a2b3c",
                                                         "slack_channel": "#ops"}))
    slack = defs.resources["slack"]
    assert isinstance(slack, SlackResource)
    assert defs.resources["reliability"].notifier.slack is slack
    assert slack.token == "SLACK_BOT_TOKEN"  # an EnvVar: its name, not the token

    result = defs.resolve_job_def("rehearsal_job").execute_in_process(
        run_config=rehearsal.run_config("no-such-request", {}), instance=instance, raise_on_error=False)
    evaluate_failure_sensor(defs, instance, result.run_id)
    [message] = sandbox.effects("slack.message")
    assert message["channel"] == "#ops" and "rehearsal_job" in message["payload"]["text"]


def test_without_a_bot_token_slack_is_the_webhook_resource(settings) -> None:
    """No bot token: "slack" is the webhook resource of the same shape, still one object shared with alerts."""
    defs = build_definitions(settings.model_copy(update={"slack_bot_token": None,
                                                         "slack_webhook_url": sandbox_url("/slack/webhook/x")}))
    assert isinstance(defs.resources["slack"], SlackWebhookResource)
    assert defs.resources["reliability"].notifier.slack is defs.resources["slack"]


LEAKY = dg.StaticPartitionsDefinition(["acme-7"])


@dg.op(retry_policy=dg.RetryPolicy(max_retries=1))
@sanitized_body
def leaky_op():
    """Fails outside any stage with a secret in the message and in the cause chain."""
    try:
        raise ConnectionResetError(f"Authorization: Bearer {CANARY}")
    except ConnectionResetError as cause:
        raise RuntimeError(f"connect to postgresql://app:{CANARY}@db:5432/app failed ({CANARY})") from cause


@dg.job(partitions_def=LEAKY, tags={"redrive/pipeline": "rehearsal"})
def leaky_job() -> None:
    leaky_op()


def test_op_body_exception_is_sanitized_in_the_event_log_and_dead_lettered_once(defs, instance, engine,
                                                                                 sandbox) -> None:
    """An op's own exception carrying a secret: no record of the run holds it, it is retried by the op's
    policy, and when the run fails for good it becomes one dead letter (and one alert) for its partition."""
    result = leaky_job.execute_in_process(instance=instance, partition_key="acme-7", raise_on_error=False)
    assert not result.success
    entries = instance.all_logs(result.run_id)
    kinds = [e.dagster_event.event_type for e in entries if e.dagster_event is not None]
    assert kinds.count(dg.DagsterEventType.STEP_UP_FOR_RETRY) == 1 and dg.DagsterEventType.STEP_FAILURE in kinds
    assert not [e for e in entries if CANARY in serialize_value(e)]

    evaluate_failure_sensor(defs, instance, result.run_id)
    evaluate_failure_sensor(defs, instance, result.run_id)  # the same failure seen again
    with engine.connect() as conn:
        [letter] = conn.execute(sa.select(dead_letters)).all()
    assert (letter.pipeline, letter.entity_ref, letter.stage, letter.run_id) == (
        "rehearsal", "acme-7", "leaky_op", result.run_id)
    assert letter.occurrences == 1
    assert CANARY not in str(dict(letter._mapping))
    [message] = sandbox.effects("slack.message")
    assert CANARY not in str(message)


def test_every_op_of_every_job_has_a_retry_policy_and_a_sanitized_body(defs) -> None:
    """Issue 12 §3: a RetryPolicy (with backoff and jitter) on every op of every job, shown in the UI; and
    issue 13 §1: every op and asset body runs under `sanitized_body`."""
    seen = 0
    for job in defs.get_repository_def().get_all_jobs():
        for handle in job.graph.iterate_node_handles():
            node = job.graph.get_node(handle)
            if not isinstance(node.definition, dg.OpDefinition):
                continue
            seen += 1
            policy = job.get_retry_policy_for_handle(handle)
            assert policy is not None, f"{job.name}.{handle} has no retry policy"
            assert policy.max_retries >= 1 and policy.delay and policy.backoff and policy.jitter, (job.name, handle)
            body = node.definition.compute_fn.decorated_fn
            assert getattr(body, "sanitized", False), f"{job.name}.{handle}: body not under sanitized_body"
    assert seen >= 12  # the drain jobs have one op each; every job of the code location is walked


def test_asset_run_without_the_job_tag_is_dead_lettered_under_its_pipeline(defs, instance, engine) -> None:
    """A launch from the asset page or a backfill runs `__ASSET_JOB`, without the job's tag: the alert and
    dead letter still name the pipeline, from the `redrive/pipeline` tag on the asset's definition."""
    key = dg.AssetKey("daily_match_offers")
    asset_job = defs.resolve_implicit_global_asset_job_def()
    partition = defs.resolve_assets_def(key).partitions_def.get_partition_keys()[0]
    with engine.begin() as conn:  # the asset reads a table that is gone: its body fails, retries, gives up
        conn.execute(sa.text("ALTER TABLE matchmaking_users RENAME TO matchmaking_users_gone"))
    result = asset_job.execute_in_process(instance=instance, asset_selection=[key], partition_key=partition,
                                          raise_on_error=False)
    assert not result.success
    run = instance.get_run_by_id(result.run_id)
    assert run.job_name.startswith("__ASSET_JOB") and "redrive/pipeline" not in run.tags
    evaluate_failure_sensor(defs, instance, result.run_id)
    with engine.connect() as conn:
        [letter] = conn.execute(sa.select(dead_letters)).all()
    # under the pipeline's own name for the partition (`{date}:{timezone}`, what `redrive dlq replay` targets)
    assert (letter.pipeline, letter.entity_ref) == ("matchmaking", str(partition).replace("|", ":"))


def test_backfill_runs_are_queued_with_their_pipelines_tag(stack) -> None:
    """A real asset backfill of matchmaking's asset, submitted by the backfill daemon's iteration through
    the instance's run coordinator (as configured in dagster.yaml.example): each run is queued carrying
    `redrive/pipeline=matchmaking`, so the queue's tag concurrency limit for matchmaking holds for it."""
    import logging
    import time

    import yaml
    from dagster._core.execution.backfill import PartitionBackfill
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.storage.tags import BACKFILL_ID_TAG
    from dagster._core.test_utils import InProcessTestWorkspaceLoadTarget
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._daemon.backfill import execute_backfill_iteration

    from redrive.settings import PROJECT_ROOT

    coordinator = yaml.safe_load((PROJECT_ROOT / "dagster.yaml.example").read_text())["run_coordinator"]
    key = dg.AssetKey("daily_match_offers")
    with dg.instance_for_test(overrides={"run_coordinator": coordinator}) as instance, WorkspaceProcessContext(
        instance, InProcessTestWorkspaceLoadTarget(InProcessCodeLocationOrigin(LoadableTargetOrigin(
            module_name="orchestration.definitions", working_directory=str(PROJECT_ROOT))))) as process_context:
        workspace = process_context.create_request_context()
        partitions = sorted(workspace.asset_graph.get(key).partitions_def.get_partition_keys())[:2]
        backfill = PartitionBackfill.from_asset_partitions(
            backfill_id="bf-matchmaking", asset_graph=workspace.asset_graph, partition_names=partitions,
            asset_selection=[key], backfill_timestamp=time.time(), tags={}, dynamic_partitions_store=instance,
            all_partitions=False, title=None, description=None, run_config=None)
        instance.add_backfill(backfill)
        list(execute_backfill_iteration(process_context, logging.getLogger("backfill")))
        runs = instance.get_runs(dg.RunsFilter(tags={BACKFILL_ID_TAG: "bf-matchmaking"}))
    assert len(runs) == 2
    assert {(r.job_name.startswith("__ASSET_JOB"), r.status, r.tags.get("redrive/pipeline")) for r in runs} == {
        (True, dg.DagsterRunStatus.QUEUED, "matchmaking")}
