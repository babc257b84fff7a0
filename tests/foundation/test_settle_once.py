"""Pipelines settle a failed entity through the core (`redrive.settle`), never with their own copy of
"decide, then retry it or dead-letter it": no module under `assets/` calls `fail_for_good` or the
core's `decide` itself, except the places allowed below, each with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DECIDERS = {"decide", "decide_stage"}  # redrive.budgets: the retry decision itself

# (module path, enclosing function) -> why it may stay
ALLOWED = {
    ("assets/conversion/worker.py", "_record_final"):
        "the reclaim step (003 §3.4) decides in SQL, for every expired lease in one statement "
        "(`reclaim_expired`), and dead-letters a lease lost on the last attempt inside that statement's transaction",
    ("assets/criticizer/policy.py", "next_attempt"):
        "002 §8.2/§8.3 stated as a pure function for its policy tests; criticizer requests are settled by the drain",
    ("assets/evidence/policy.py", "decide_write"):
        "004's per-artifact retry columns (retry_count, next_retry_at, is_retryable) inside one drained entity; "
        "the entity's own final failure is settled by the drain",
}


def direct_settlements(source: str) -> list[tuple[str, str]]:
    """(enclosing function, what it calls) for every direct `fail_for_good` or `decide` call in `source`."""
    tree = ast.parse(source)
    deciders = set()
    budgets_aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "redrive.budgets":
            deciders |= {a.asname or a.name for a in node.names if a.name in DECIDERS}
        if isinstance(node, ast.ImportFrom) and node.module == "redrive":
            budgets_aliases |= {a.asname or a.name for a in node.names if a.name == "budgets"}
        if isinstance(node, ast.Import):
            budgets_aliases |= {a.asname or a.name for a in node.names if a.name == "redrive.budgets"}
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else where
            if isinstance(child, ast.Call):
                func = child.func
                if isinstance(func, ast.Attribute) and func.attr == "fail_for_good":
                    found.append((here, "fail_for_good"))
                elif isinstance(func, ast.Name) and func.id in deciders:
                    found.append((here, "decide"))
                elif isinstance(func, ast.Attribute) and func.attr in DECIDERS and \
                        ast.unparse(func.value) in budgets_aliases | {"redrive.budgets"}:
                    found.append((here, "decide"))
            visit(child, here)

    visit(tree, "<module>")
    return found


def all_direct_settlements() -> dict[tuple[str, str], str]:
    out = {}
    for path in sorted((ROOT / "assets").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for where, what in direct_settlements(path.read_text()):
            out[(rel, where)] = what
    return out


def test_no_pipeline_decides_or_dead_letters_by_hand() -> None:
    """Every `fail_for_good` / `decide` call under assets/ is on the allow-list; the rest go through `redrive.settle`."""
    unexpected = {site: what for site, what in all_direct_settlements().items() if site not in ALLOWED}
    assert unexpected == {}, f"settle these through redrive.settle.settle: {unexpected}"


def test_the_allow_list_names_only_places_that_still_exist() -> None:
    """An allowed place that no longer calls the core directly is struck from the list (it cannot hide a new one)."""
    assert set(ALLOWED) <= set(all_direct_settlements())


def test_the_scan_finds_a_copy_in_each_shape() -> None:
    """The scanner sees a by-hand settlement however `decide` was imported, and fail_for_good on any receiver."""
    source = '''
from redrive.budgets import decide as judge
from redrive import budgets
import redrive.budgets

class Worker:
    def _failed(self, failure):
        decision = judge(failure, 1, 3, BACKOFF, rng)
        if not decision.retry:
            self.runtime.fail_for_good(final)

def other(failure):
    return budgets.decide(failure, 1, 3, BACKOFF, rng), redrive.budgets.decide_stage(failure)
'''
    assert direct_settlements(source) == [("_failed", "decide"), ("_failed", "fail_for_good"),
                                          ("other", "decide"), ("other", "decide")]
