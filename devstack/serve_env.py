"""`.data/serve.env`: the endpoints of a running `make serve`, for runbooks to source and for `redrive` to find.

`make serve` writes it once every service answers and removes it when it stops; the first line names the serve
process, so a file left by a killed serve is recognised as stale. Standard library only: the `redrive` command
reads it before anything heavy is imported (issue 27: a command answers in a fraction of a second there).

    set -a; . .data/serve.env; set +a      # then $DAGSTER_UI_URL, $CONVERSION_API, $DATABASE_URL, …
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path

FILE_NAME = "serve.env"
PID_KEY = "REDRIVE_SERVE_PID"
# What an operator needs, in the order printed: name, what it is.
ENDPOINTS: tuple[tuple[str, str], ...] = (
    ("DAGSTER_UI_URL", "Dagster UI (runs, assets, checks, sensors)"),
    ("CONVERSION_API", "conversion API and page (a token: python -m assets.conversion.api token alice)"),
    ("METRICS_URL", "Prometheus metrics of every pipeline"),
    ("DLQ_CONSOLE_URL", "dead-letter console (an operator token: redrive console token NAME)"),
    ("SANDBOX_URL", "the sandbox (LLM, case API, mail, PDF gateway, Slack, …; faults at /_admin/faults)"),
    ("AWS_ENDPOINT_URL", "S3 and SQS (moto)"),
    ("DATABASE_URL", "PostgreSQL of redrive (the `redrive` command's database)"),
)


def default_path() -> Path:
    """`$REDRIVE_DATA_DIR/serve.env`, the project's `.data/serve.env` by default (as redrive.settings says)."""
    data = os.environ.get("REDRIVE_DATA_DIR")
    return (Path(data) if data else Path(__file__).resolve().parents[1] / ".data") / FILE_NAME


def render(values: Mapping[str, str], pid: int) -> str:
    """Pure: the file's text, shell-quoted, one `NAME=value` a line."""
    lines = ["# written by `make serve`; removed when it stops. Source it: set -a; . .data/serve.env; set +a",
             f"{PID_KEY}={pid}"]
    lines += [f"{k}={shlex.quote(str(v))}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, str]:
    """Pure: the file's values (comments and blank lines skipped, shell quoting undone)."""
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        parts = shlex.split(value)
        out[key.strip()] = parts[0] if parts else ""
    return out


def write(path: Path, values: Mapping[str, str], pid: int | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(render(values, pid or os.getpid()))
    tmp.chmod(0o600)  # DATABASE_URL may carry a password
    tmp.replace(path)


def remove(path: Path) -> None:
    """Remove the file if it is this process's (a second serve's file is left alone)."""
    try:
        if parse(path.read_text()).get(PID_KEY) == str(os.getpid()):
            path.unlink()
    except FileNotFoundError:
        pass


def running(path: Path | None = None) -> dict[str, str] | None:
    """The values of a serve that is still running, or None (no file, or its serve process is gone)."""
    path = path or default_path()
    try:
        values = parse(path.read_text())
    except (FileNotFoundError, PermissionError):
        return None
    try:
        os.kill(int(values.get(PID_KEY, "")), 0)
    except (ValueError, ProcessLookupError):
        return None
    except PermissionError:
        pass  # alive, someone else's
    return values
