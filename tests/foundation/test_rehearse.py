"""Issue 27 §4: a stack to rehearse on. `redrive rehearse` arms a fault per runbook section on the deployed topology;
tests/foundation/test_newcomer.py arms every recipe on a fresh clone's `make serve` and runs each section as written."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from orchestration import rehearse
from orchestration.cli import app
from tests.foundation.test_operating import PAGE

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
