"""The `redrive` command: bad values are errors, boolean options are flags, and reading commands stay light."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from orchestration.cli import _PipelineCommand, app
from orchestration.registry import PIPELINES
from redrive import deadletters
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from redrive.schema import DEAD_LETTER_STATUSES

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)
# What the read-only path must not pay for: the orchestrator, data frames, AWS, the pipelines' own code.
HEAVY = ("dagster", "pandas", "numpy", "boto3", "assets", "sensors", "resources", "alembic")


def redrive(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "redrive"
    return subprocess.run([str(exe), *args], env={**os.environ, "DATABASE_URL": db_url}, capture_output=True,
                          text=True, timeout=120)


def seed_letter(engine: sa.Engine, pipeline: str) -> None:
    with engine.begin() as conn:
        deadletters.record(conn, FinalFailure(pipeline=pipeline, stage="attach", entity_ref=f"{pipeline}-1",
                                              failure=Failure.of(Code.UPSTREAM_UNAVAILABLE), attempts=3, at=T0))


@pytest.mark.parametrize("args, word", [
    (("dlq", "list", "--pipeline", "nope"), "nope"),
    (("dlq", "list", "--status", "bogus"), "bogus"),
    (("dlq", "list", "--status", "open", "--status", "bogus"), "bogus"),
    (("dlq", "replay-bulk", "--pipeline", "nope", "--note", "x", "--confirm-safe"), "nope"),
])
def test_unknown_pipeline_or_status_is_one_line_and_exit_2(db_url: str, args: tuple[str, ...], word: str) -> None:
    """A typo in --pipeline or --status answers one line naming the bad value and exits 2, not an empty list."""
    result = redrive(db_url, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and repr(word) in lines[0], result.stderr
    assert result.stdout == ""


def test_the_error_names_the_valid_values_from_the_registry_and_schema(db_url: str) -> None:
    """The one line lists what would have been accepted, taken from the registry and the schema."""
    pipeline = redrive(db_url, "dlq", "list", "--pipeline", "nope").stderr
    status = redrive(db_url, "dlq", "list", "--status", "bogus").stderr
    assert all(p.name in pipeline for p in PIPELINES)
    assert all(s in status for s in DEAD_LETTER_STATUSES)


def test_every_registered_pipeline_and_status_is_accepted(engine: sa.Engine, db_url: str) -> None:
    """Valid values still filter: each registered pipeline's letter is found by its own name."""
    for p in PIPELINES:
        seed_letter(engine, p.name)
    for p in PIPELINES:
        result = redrive(db_url, "dlq", "list", "--pipeline", p.name, "--json", *sum(
            (("--status", s) for s in DEAD_LETTER_STATUSES), ()))
        assert result.returncode == 0, result.stderr
        assert [row["pipeline"] for row in json.loads(result.stdout)] == [p.name]


def _walk(command, path: str = "redrive"):
    """Every command under the root, into the pipelines' own (typer, a click of its own) groups."""
    if isinstance(command, _PipelineCommand):
        command = command.load()
    yield path, command
    if hasattr(command, "list_commands"):
        ctx = command.make_context(path, ["--help"], resilient_parsing=True)
        for name in command.list_commands(ctx):
            yield from _walk(command.get_command(ctx, name), f"{path} {name}")


def _flags(command) -> list:
    return [p for p in command.params if p.param_type_name == "option" and p.is_flag]


def test_boolean_options_are_one_way_flags() -> None:
    """No boolean option of any command, the pipelines' included, shows as a `--x/--no-x` pair."""
    pairs, flags = [], set()
    for path, command in _walk(app):
        for param in _flags(command):
            if param.name != "help":
                flags.add(param.opts[0])
                if param.secondary_opts:
                    pairs.append(f"{path} {'/'.join(param.opts + param.secondary_opts)}")
    assert pairs == []
    assert {"--confirm-safe", "--from-start", "--json"} <= flags  # the walk reached the commands that have them


def test_help_shows_boolean_options_as_flags() -> None:
    """Every command's help shows `--json`, `--confirm-safe`, … bare, never with a value placeholder like `<bool>`."""
    runner = CliRunner()
    seen = 0
    for path, command in _walk(app):
        result = runner.invoke(app, [*path.split()[1:], "--help"])
        assert result.exit_code == 0, (path, result.output)
        flags = [p.opts[0] for p in _flags(command)]
        for line in result.output.splitlines():
            words = line.split()
            if words and words[0] in flags:
                seen += 1
                assert len(words) == 1 or not words[1].startswith("<"), (path, line)
        assert "<bool>" not in result.output, (path, result.output)
    assert seen >= 10


def test_pipeline_commands_are_mounted_from_the_registry() -> None:
    """Every command a pipeline registers is listed by `redrive --help` and runs its own sub-app."""
    ctx = app.make_context("redrive", ["--help"], resilient_parsing=True)
    runner = CliRunner()
    for p in PIPELINES:
        for name in p.commands:
            assert name in app.list_commands(ctx)
            mounted = app.resolve_command(ctx, [name, "--help"])[1]
            assert isinstance(mounted, _PipelineCommand)
            loaded = mounted.load()
            subs = loaded.list_commands(loaded.make_context(name, ["--help"], resilient_parsing=True))
            assert loaded.name == name and subs
            shown = runner.invoke(app, [name, "--help"])  # the sub-app parses the rest and prints its own help
            assert shown.exit_code == 0 and f"Usage: redrive {name} " in shown.output, shown.output
            assert all(sub in shown.output for sub in subs), shown.output


def _modules_after(db_url: str, *args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run the console entry in a fresh interpreter and report which top-level packages it imported."""
    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print('MODULES ' + ' '.join(sorted({m.split('.')[0] for m in sys.modules})),"
             " file=sys.stderr))\n"
             f"sys.argv = ['redrive', *{list(args)!r}]\n"
             "from orchestration.cli import main\nmain()\n")
    result = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "DATABASE_URL": db_url},
                            capture_output=True, text=True, timeout=120)
    line = next(x for x in result.stderr.splitlines() if x.startswith("MODULES "))
    return result, set(line.split()[1:])


@pytest.mark.parametrize("args", [("--help",), ("dlq", "list"), ("dlq", "show", "1"), ("dlq", "--help")])
def test_help_and_reading_commands_do_not_import_the_heavy_modules(db_url: str, args: tuple[str, ...]) -> None:
    """`redrive --help`, `dlq list` and `dlq show` load neither Dagster, pandas, boto3, any pipeline, nor
    SQLAlchemy (they read through psycopg2 with the core's query text), pydantic, nor typer (the root is
    plain click; a pipeline's typer app loads when it runs)."""
    result, modules = _modules_after(db_url, *args)
    assert result.returncode in (0, 2), result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(modules & {*HEAVY, "sqlalchemy", "pydantic", "typer"}) == []
    if "--help" not in args:
        assert "psycopg2" in modules  # the probe does see what the command really used


# The pipelines' own read-only commands need their pipeline, never the orchestrator or data frames.
PIPELINE_READS = [("breaker",), ("review", "status"), ("criticizer", "status", "nope"), ("matching", "stuck"),
                  ("evidence", "show", "00000000-0000-0000-0000-000000000000")]


@pytest.mark.parametrize("args", PIPELINE_READS)
def test_status_commands_do_not_import_dagster_or_pandas(db_url: str, args: tuple[str, ...]) -> None:
    """`redrive breaker` and each pipeline's status command answer without Dagster or pandas."""
    result, modules = _modules_after(db_url, *args)
    assert result.returncode in (0, 2), result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(modules & {"dagster", "pandas"}) == []
    assert "psycopg2" in modules
