"""The plain-process entry points: `redrive worker conversion` (mounted from the worker module) and API tokens."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from assets.conversion import repository as repo
from assets.conversion.api import cli as api_cli
from assets.conversion.worker import worker_app
from tests.conversion.conftest import job


def test_worker_command_mounts_as_redrive_worker_conversion_and_drains_the_queue(engine, submit, conv_settings,
                                                                                  db_url, stack) -> None:
    """Mounted under `worker`, `conversion --until-idle` converts the due jobs and exits 0."""
    root = typer.Typer()
    root.add_typer(worker_app, name="worker")

    @root.command()
    def version() -> None:  # a second command, as in the operator's `redrive`
        pass

    job_id = submit()
    env = {"DATABASE_URL": db_url, "UPLOADS_DIR": str(conv_settings.uploads_dir),
           "RESULTS_DIR": str(conv_settings.results_dir), "WORKER_IDLE_SLEEP_SEC": "0.05"}
    out = CliRunner().invoke(root, ["worker", "conversion", "--until-idle", "0.2"], env=env, catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert job(engine, job_id).status == "succeeded"


def test_token_command_prints_a_token_that_authenticates_its_owner(engine, db_url) -> None:
    """`python -m assets.conversion.api token alice` prints a new token; only its hash is stored."""
    out = CliRunner().invoke(api_cli, ["token", "alice"], env={"DATABASE_URL": db_url}, catch_exceptions=False)
    token = out.output.strip()
    assert out.exit_code == 0 and token.startswith("rdc_")
    with engine.connect() as conn:
        assert repo.owner_for(conn, token) == "alice"
        stored = conn.execute(repo.conversion_api_tokens.select()).one()
    assert stored.token_sha256 == repo.token_hash(token) and token not in stored
