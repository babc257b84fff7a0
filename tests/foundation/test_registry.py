"""One registry of pipelines: every entry has what docs/adding-a-pipeline.md requires, and the layers hold."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from orchestration import registry
from orchestration.registry import PIPELINES, Pipeline, missing_pieces
from redrive.settings import PROJECT_ROOT, Settings


@pytest.mark.parametrize("pipeline", PIPELINES, ids=[p.name for p in PIPELINES])
def test_every_registered_pipeline_is_complete(pipeline: Pipeline, settings: Settings) -> None:
    """Schema, demo, commands, wiring and a replay path exist for each registered pipeline."""
    assert missing_pieces(pipeline, settings) == []


def test_a_pipeline_missing_a_piece_is_reported(settings: Settings) -> None:
    """An entry whose demo does not exist and that has no replay path is caught, piece by piece."""
    broken = Pipeline(name="rehearsal", wiring="orchestration.pipelines.rehearsal", schema="assets.rehearsal.repository",
                      demo="orchestration.demos.no_such_demo", commands={"x": "orchestration.cli:nope"})
    found = missing_pieces(broken, settings)
    assert any(m.startswith("demo: cannot import orchestration.demos.no_such_demo") for m in found)
    assert "command x: orchestration.cli:nope does not exist" in found


def test_a_pipeline_without_a_replay_path_is_reported(settings: Settings, monkeypatch) -> None:
    """A pipeline neither drained nor with a replay target cannot be replayed: the check says so."""
    from orchestration.pipelines import rehearsal

    original = rehearsal.pipeline_defs
    monkeypatch.setattr(rehearsal, "pipeline_defs", lambda s: original(s).__class__(
        name="rehearsal", jobs=original(s).jobs))
    [missing] = missing_pieces(registry.selected(["rehearsal"])[0], settings)
    assert missing.startswith("replay: neither drained nor given a replay target")


def test_the_code_location_the_schema_and_the_cli_read_the_same_list() -> None:
    """Nothing else keeps a list of pipelines: the demo, Alembic and the CLI take theirs from the registry."""
    names = {p.name for p in PIPELINES}
    assert names == {"rehearsal", "conversion", "criticizer", "matching", "matchmaking", "review_notifications",
                     "evidence"}
    for path in ("orchestration/demo.py", "orchestration/cli.py", "migrations/env.py", "redrive/schema.py"):
        source = (PROJECT_ROOT / path).read_text()
        assert "orchestration.pipelines." not in source and "assets.evidence" not in source, path


RANK = {"redrive": 0, "resources": 1, "assets": 2, "sensors": 3, "orchestration": 4}


def upward_imports() -> list[str]:
    """Imports that run back up the layers (orchestration → sensors → assets → resources → redrive)."""
    found = []
    for top, rank in RANK.items():
        for path in sorted((PROJECT_ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text())
            type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                         and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
            for node in ast.walk(tree):
                if id(node) in type_only:  # `if TYPE_CHECKING:` imports never run
                    continue
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    root = name.split(".")[0]
                    rel = path.relative_to(PROJECT_ROOT)
                    if RANK.get(root, -1) > rank:
                        found.append(f"{rel} imports {name}")
                    if root == "devstack" and top not in ("resources", "orchestration"):
                        found.append(f"{rel} imports {name} (the local stack is started at the edge)")
    return found


def test_imports_never_run_back_up_the_layers() -> None:
    """The core imports no resource, pipeline or devstack; resources no pipeline; assets no sensor or wiring."""
    assert upward_imports() == []


def test_the_layer_check_sees_an_upward_import(tmp_path: Path, monkeypatch) -> None:
    """The check is not vacuous: a core module importing a pipeline is reported."""
    for top in RANK:
        (tmp_path / top).mkdir()
    (tmp_path / "redrive" / "bad.py").write_text("def f():\n    from assets.criticizer import api\n")
    monkeypatch.setitem(globals(), "PROJECT_ROOT", tmp_path)
    assert upward_imports() == ["redrive/bad.py imports assets.criticizer"]
