"""The `redrive` command is on the PATH after install and answers in one line, never a stack trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def redrive(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).parent / "redrive"
    return subprocess.run([str(exe), *args], env={**os.environ, "DATABASE_URL": db_url}, capture_output=True,
                          text=True, timeout=120)


def test_installed_command_lists_dead_letters_as_json(db_url: str) -> None:
    """`redrive dlq list --json` from the installed entry point prints a JSON list."""
    result = redrive(db_url, "dlq", "list", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []


def test_unknown_dead_letter_is_a_one_line_error(db_url: str) -> None:
    """A missing id exits 2 with one line on stderr and no traceback."""
    result = redrive(db_url, "dlq", "show", "12345")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: dead letter 12345 does not exist"
    assert "Traceback" not in result.stderr + result.stdout


def test_unreachable_database_is_a_one_line_error(tmp_path) -> None:
    """A wrong DATABASE_URL (with a password) gives one sanitized line, not a stack trace or the password."""
    result = redrive("postgresql://admin:s3cret-canary@127.0.0.1:1/nope", "dlq", "list")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "s3cret-canary" not in result.stderr
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
