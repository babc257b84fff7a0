"""Issue 27 §5: the Makefile finds whichever supported Python the machine has (3.11 or 3.12)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from redrive.settings import PROJECT_ROOT

MAKE = shutil.which("make")


def python_make_picks(bin_dir: Path) -> str:
    """The PYTHON the Makefile settles on with only `bin_dir` (plus the tools its recipes use) on PATH."""
    for tool in ("cat", "cksum", "cut", "echo"):
        (bin_dir / tool).symlink_to(Path(shutil.which(tool)).resolve())
    done = subprocess.run([MAKE, "-s", "--eval", "show: ; @echo $(PYTHON)", "show"], cwd=PROJECT_ROOT,
                          env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(MAKE is None, reason="make is not installed")
@pytest.mark.parametrize("name", ["python3.12", "python3"])
def test_a_machine_with_only_a_supported_python_under_another_name_uses_it(tmp_path: Path, name: str) -> None:
    """No python3.11: the Makefile takes python3.12, or a `python3` whose version is supported."""
    (tmp_path / name).symlink_to(Path(sys.executable).resolve())
    assert python_make_picks(tmp_path) == str(tmp_path / name)
