"""Issue 27: the newcomer's check. A fresh clone, `make serve` as the README says (it installs its own virtualenv
and starts everything on embedded defaults), `redrive rehearse` in a second shell, then every runbook section of
docs/operating.md (1 to 9) run line by line as written, with the variables the recipes printed.

The clone is of the repository's HEAD (on CI, the commit under test; locally, uncommitted changes are not in it).
Nothing of this checkout reaches it: not the virtualenv, `.data`, `DATABASE_URL` nor any variable of the test
session, only PATH (without virtualenvs), HOME and the locale, as a newcomer's shell has. It costs an install
and a topology (minutes), so `make test-ci`'s second pass leaves it out: it starts its own PostgreSQL whatever
DATABASE_URL says, as the chaos test does.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devstack import serve_env
from redrive.settings import PROJECT_ROOT
from tests.foundation.test_operating import run_steps, section

pytestmark = [pytest.mark.newcomer, pytest.mark.timeout(3600)]

KEPT = ("HOME", "USER", "LANG", "LC_ALL", "TMPDIR", "XDG_CACHE_HOME", "CI", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
KEPT_PREFIXES = ("PIP_", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy")
# what a clean checkout does not have, when the project is not a git work tree to clone
NOT_CHECKED_IN = (".venv", ".data", ".dagster_home", ".git", "__pycache__", "*.egg-info", ".pytest_cache",
                  ".ruff_cache", "site")


def newcomer_env() -> dict[str, str]:
    """A newcomer's shell: PATH without any virtualenv's bin, HOME, the locale, how pip and proxies are set up on
    this machine; nothing of redrive's."""
    path = [p for p in os.environ["PATH"].split(os.pathsep)
            if not (Path(p) / "activate").exists() and not Path(p, "..", "pyvenv.cfg").exists()]
    kept = {k: v for k, v in os.environ.items() if k in KEPT or k.startswith(KEPT_PREFIXES)}
    return {"PATH": os.pathsep.join(path), **kept}


def fresh_copy(target: Path) -> None:
    """`git clone` of HEAD; where the project is not a git work tree (a CI that checks out files only), a copy
    of it without what a checkout lacks."""
    inside = subprocess.run(["git", "-C", str(PROJECT_ROOT), "rev-parse", "--is-inside-work-tree"],
                            capture_output=True, text=True, timeout=60) if shutil.which("git") else None
    if inside is not None and inside.returncode == 0 and inside.stdout.strip() == "true":
        subprocess.run(["git", "clone", "-q", str(PROJECT_ROOT), str(target)], check=True, timeout=300)
    else:
        shutil.copytree(PROJECT_ROOT, target, ignore=shutil.ignore_patterns(*NOT_CHECKED_IN), symlinks=True)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Path, dict[str, str]]]:
    """`make serve` in a fresh clone, until its .data/serve.env is written; Ctrl-C (SIGINT) stops it after.
    The clone is in a folder others may enter (as a home directory is): as root, the embedded PostgreSQL runs
    as a user of its own, which pytest's private temporary folders would lock out."""
    folder = Path(tempfile.mkdtemp(prefix="redrive-newcomer-"))
    folder.chmod(0o755)
    clone = folder / "redrive"
    fresh_copy(clone)
    log = clone.parent / "make-serve.log"
    env = newcomer_env()
    with open(log, "wb") as out:
        serve = subprocess.Popen(["make", "serve"], cwd=clone, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    env_file = clone / ".data" / "serve.env"
    try:
        deadline = time.monotonic() + 1800  # an install from the registries, then the topology
        while not env_file.exists():
            assert serve.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(2)  # waiting for a process we started; not a timing assertion
        yield clone, {**env, **serve_env.parse(env_file.read_text())}
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGINT)  # the terminal's Ctrl-C
            try:
                serve.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait(30)
    printed = log.read_text(errors="replace")
    shutil.rmtree(folder, ignore_errors=True)
    assert "serve: stopped everything it started." in printed, printed[-4000:]


def rehearse(clone: Path, env: dict[str, str], recipe: str) -> dict[str, str]:
    """`set -a; . .data/serve.env; set +a; redrive rehearse RECIPE` in the clone, as the page says; its exports."""
    shell = f"set -a; . .data/serve.env; set +a; redrive rehearse {shlex.quote(recipe)} --timeout 300"
    done = subprocess.run(["bash", "-c", shell], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "Traceback" not in done.stderr, (recipe, done.stdout, done.stderr[-3000:])
    exported = {}
    for line in done.stdout.splitlines():
        assert line.startswith("export "), (recipe, line)
        name, _, value = line.removeprefix("export ").partition("=")
        [exported[name]] = shlex.split(value)
    return exported


def test_a_newcomer_serves_rehearses_and_follows_every_runbook_as_written(served) -> None:
    clone, stack = served
    page = {**stack, "PATH": f"{clone / '.venv' / 'bin'}:{stack['PATH']}"}

    def follow(title: str, recipe: str | None = None) -> None:
        values = rehearse(clone, page, recipe) if recipe else {}
        run_steps(section(title), {**page, **values}, cwd=clone, inherit=False)

    listed = subprocess.run(["bash", "-c", "redrive rehearse list"], cwd=clone, env=page, capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0 and "bad-profile" in listed.stdout, listed
    follow("3. Replay a dead letter", "llm-401")
    follow("4. Bulk redrive")
    follow("8. Waive a recipient", "undeliverable-recipient")
    follow("5. Press Retry", "gateway-reject")
    follow("6. Read the breaker", "gateway-outage")
    profile = rehearse(clone, page, "bad-profile")
    fix = 'psql "$DATABASE_URL" -c "UPDATE matchmaking_users SET age_min = 18, age_max = 99 WHERE age_min > age_max"'
    if not shutil.which("psql"):  # the page's fix needs PostgreSQL's client; without it, the same through Python
        fix = ("python -c 'import os, sqlalchemy as sa; from redrive.db import engine_for; "
               "engine_for(os.environ[\"DATABASE_URL\"]).begin().__enter__().execute(sa.text("
               "\"UPDATE matchmaking_users SET age_min = 18, age_max = 99 WHERE age_min > age_max\"))'")
    fixed = subprocess.run(["bash", "-c", fix], cwd=clone, env=page, capture_output=True, text=True, timeout=60)
    assert fixed.returncode == 0, fixed.stderr
    run_steps(section("1. Rerun a failed partition"), {**page, **profile}, cwd=clone, inherit=False)
    follow("2. Backfill a range")
    follow("9. Force N2", "evidence-zip")
    follow("7. Triage a stuck document", "stuck-document")  # last: it SIGKILLs a drain run's worker
