"""Issue 27 §4: a stack to rehearse on. `redrive rehearse` arms a fault per runbook section on the deployed topology,
and each section of docs/operating.md then runs as written (the newcomer's check)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from devstack.topology import Topology
from orchestration import rehearse
from orchestration.cli import app
from tests.foundation.test_operating import BIN, PAGE, run_steps, section
from tests.foundation.test_topology import dagster_pg_url  # noqa: F401 - the fixture

PAGE_TEXT = PAGE.read_text()


def test_the_page_starts_with_rehearse_locally_and_lists_every_recipe() -> None:
    """The first section of docs/operating.md is "Rehearse locally"; its table names each recipe, and each section a
    recipe prepares exists on the page."""
    assert re.findall(r"^## (.+)$", PAGE_TEXT, re.M)[0] == "Rehearse locally"
    table = section_text("Rehearse locally")
    assert {m for m in re.findall(r"^\| `([a-z0-9-]+)` \|", table, re.M)} == {r.name for r in rehearse.RECIPES}
    for recipe in rehearse.RECIPES:
        for prefix in recipe.sections:
            assert re.search(rf"^##+ {re.escape(prefix)}", PAGE_TEXT, re.M), (recipe.name, prefix)


def section_text(title: str) -> str:
    return PAGE_TEXT.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_exports_are_shell_safe() -> None:
    """Pure: values with `|` or spaces come out quoted, so `eval` sets them as printed."""
    assert rehearse.exports({"PARTITION": "2026-11-26|Asia/Tokyo", "A": "b"}) == \
        "export PARTITION='2026-11-26|Asia/Tokyo'\nexport A=b"


def test_no_stack_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Without a running serve or DATABASE_URL/SANDBOX_URL, the command says what to start; an unknown recipe
    names the known ones; neither seeds anything."""
    env = {"REDRIVE_DATA_DIR": str(tmp_path), "DATABASE_URL": "", "SANDBOX_URL": ""}
    out = CliRunner().invoke(app, ["rehearse", "llm-401"], env=env)
    assert out.exit_code == 2 and "start `make serve`" in out.output
    out = CliRunner().invoke(app, ["rehearse", "nope"], env=env)
    assert out.exit_code == 2 and "known: bad-profile, llm-401" in out.output


@pytest.mark.timeout(1500)
def test_each_runbook_runs_as_written_on_a_rehearsed_topology(db_url: str, dagster_pg_url: str,  # noqa: F811
                                                               project_tmp: Path, sandbox, engine) -> None:
    """The deployed topology (as `make serve`), every recipe armed through `redrive rehearse`'s code on it, then
    sections 1, 3, 4, 5, 6, 7, 8 and 9 of docs/operating.md run line by line with the variables the recipes printed."""
    from orchestration.demos import conversion

    # waits at their real length, as on `make serve` (the breaker's cooldown too); no recipe waits for a retry
    env = {"DATABASE_URL": db_url, "DAGSTER_PG_URL": dagster_pg_url, "REDRIVE_TIME_SCALE": "1",
           "UPLOADS_DIR": str(project_tmp / "uploads"), "RESULTS_DIR": str(project_tmp / "results"),
           "MATCHMAKING_START_DATE": "2026-01-01", **conversion.DEPLOYMENT_ENV}
    with Topology(home=project_tmp / "dagster_home", env=env, workers=1) as topology:
        stack = rehearse.stack_env({**os.environ, **topology.endpoints()})
        got = {name: rehearse.arm([name], stack, timeout=240) for name in
               ("llm-401", "undeliverable-recipient", "gateway-reject", "bad-profile")}
        page = {**stack, "PATH": f"{BIN}:{os.environ['PATH']}"}
        run_steps(section("3. Replay a dead letter"), {**page, **got["llm-401"]})
        run_steps(section("4. Bulk redrive"), page)
        run_steps(section("8. Waive a recipient"), {**page, **got["undeliverable-recipient"]})
        run_steps(section("5. Press Retry"), {**page, **got["gateway-reject"]})
        run_steps(section("6. Read the breaker"), {**page, **rehearse.arm(["gateway-outage"], stack, timeout=240)})
        with engine.begin() as conn:  # the operator's fix of the profile the letter names
            conn.execute(sa.text("UPDATE matchmaking_users SET age_min = 18, age_max = 99 WHERE age_min > age_max"))
        run_steps(section("1. Rerun a failed partition"), {**page, **got["bad-profile"]})
        run_steps(section("9. Force N2"), {**page, **rehearse.arm(["evidence-zip"], stack, timeout=240)})
        # last: its run worker is SIGKILLed, and the operator's threshold (60 s) is printed with $DOCUMENT
        run_steps(section("7. Triage a stuck document"), {**page, **rehearse.arm(["stuck-document"], stack,
                                                                                  timeout=240)})
