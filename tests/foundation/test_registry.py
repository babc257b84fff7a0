"""One registry of pipelines: every entry has what docs/adding-a-pipeline.md requires, and the layers hold."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from orchestration.registry import PIPELINES, Pipeline, missing_pieces
from redrive.settings import PROJECT_ROOT, Settings


@pytest.mark.parametrize("pipeline", PIPELINES, ids=[p.name for p in PIPELINES])
def test_every_registered_pipeline_is_complete(pipeline: Pipeline, settings: Settings) -> None:
    """Schema, demo, commands, wiring and a replay path exist for each registered pipeline."""
    assert missing_pieces(pipeline, settings) == []


def test_a_pipeline_missing_a_piece_is_reported(settings: Settings) -> None:
    """An entry whose demo does not exist and that has no replay path is caught, piece by piece."""
    first = PIPELINES[0]
    broken = Pipeline(name=first.name, wiring=first.wiring, schema=first.schema,
                      demo="orchestration.demos.no_such_demo", commands={"x": "orchestration.cli:nope"})
    found = missing_pieces(broken, settings)
    assert any(m.startswith("demo: cannot import orchestration.demos.no_such_demo") for m in found)
    assert "command x: orchestration.cli:nope does not exist" in found


def test_a_pipeline_without_a_replay_path_is_reported(settings: Settings, monkeypatch) -> None:
    """A pipeline neither drained nor with a replay target cannot be replayed: the check says so."""
    import importlib

    pipeline = PIPELINES[0]
    wiring = importlib.import_module(pipeline.wiring)
    original = wiring.pipeline_defs
    monkeypatch.setattr(wiring, "pipeline_defs", lambda s: original(s).__class__(
        name=pipeline.name, jobs=original(s).jobs))
    [missing] = missing_pieces(pipeline, settings)
    assert missing.startswith("replay: neither drained nor given a replay target")


def wired_pipelines() -> set[str]:
    """The pipelines as the folders show them: each has its wiring module in orchestration/pipelines/."""
    return {p.stem for p in (PROJECT_ROOT / "orchestration" / "pipelines").glob("*.py") if p.stem != "__init__"}


def name_lists(names: set[str], roots: tuple[str, ...] = ("redrive", "resources", "assets", "sensors",
                                                          "orchestration", "devstack")) -> list[str]:
    """Literal lists, tuples or sets in the code naming three or more pipelines: a copy of the registry. (A table
    keyed by pipeline with a value for each, like the benchmarks' loads, is per-pipeline data, not a list.)"""
    found = []
    for top in roots:
        for path in sorted((PROJECT_ROOT / top).rglob("*.py")):
            if path == PROJECT_ROOT / "orchestration" / "registry.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                items = node.elts if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else None
                named = {i.value for i in items or () if isinstance(i, ast.Constant) and i.value in names}
                if len(named) >= 3:
                    found.append(f"{path.relative_to(PROJECT_ROOT)}:{node.lineno} names {sorted(named)}")
    return found


def test_the_registry_is_the_only_list_of_pipelines() -> None:
    """Every pipeline package with wiring is registered and every entry has its package; no module keeps a
    literal list of pipeline names of its own; the demo, Alembic and the CLI import no pipeline by name."""
    names = {p.name for p in PIPELINES}
    assert names == wired_pipelines()
    assert all((PROJECT_ROOT / "assets" / name / "__init__.py").exists() for name in names)
    assert name_lists(names) == []
    for path in ("orchestration/demo.py", "orchestration/cli.py", "migrations/env.py", "redrive/schema.py"):
        source = (PROJECT_ROOT / path).read_text()
        assert "orchestration.pipelines." not in source and "assets.evidence" not in source, path


def test_the_list_check_sees_a_copy(tmp_path: Path, monkeypatch) -> None:
    """The check is not vacuous: a module listing three pipelines by name is reported."""
    (tmp_path / "sensors").mkdir()
    (tmp_path / "sensors" / "copy.py").write_text("WATCHED = ('alpha', 'beta', 'gamma')\nOTHER = ['alpha']\n")
    monkeypatch.setitem(globals(), "PROJECT_ROOT", tmp_path)
    assert name_lists({"alpha", "beta", "gamma"}, roots=("sensors",)) == [
        "sensors/copy.py:1 names ['alpha', 'beta', 'gamma']"]


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
