"""`python -m assets.criticizer.cli`: submit critique requests and see where they stand.

    python -m assets.criticizer.cli submit --artifact-url URL --rubric TEXT|--rubric-file PATH \\
        --webhook-url URL [--header 'Name: value']... [--header-from-env Name=ENV_VAR]... \\
        [--request-id ID] [--tenant T] [--json]
    python -m assets.criticizer.cli status REQUEST_ID [--json]
    python -m assets.criticizer.cli list [--status submitted|processing|done] [--json]

`--header-from-env` reads a header's value from an environment variable, so a webhook
credential need not appear in shell history or the process list. Errors are one line
(exit 2 for bad input), never a stack trace, and never echo a header value.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from assets.criticizer import api, repository
from assets.criticizer.policy import PIPELINE
from redrive.db import engine_for
from redrive.run_keys import due_work_sensor_name
from resources.postgres import database_session
from redrive.settings import Settings

app = typer.Typer(help="criticizer requests: submit, status, list", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def parse_headers(pairs: list[str], from_env: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or not name.strip():
            fail("--header takes 'Name: value'")
        headers[name.strip()] = value.strip()
    for pair in from_env:
        name, sep, variable = pair.partition("=")
        if not sep or not name.strip() or not variable.strip():
            fail("--header-from-env takes Name=ENV_VAR")
        value = os.environ.get(variable.strip())
        if value is None:
            fail(f"--header-from-env: environment variable {variable.strip()} is not set")
        headers[name.strip()] = value  # type: ignore[assignment]
    return headers


@app.command("submit")
def submit(
    artifact_url: Annotated[str, typer.Option(help="URL of the artifact to review")],
    webhook_url: Annotated[str, typer.Option(help="where the critique is posted")],
    rubric: Annotated[str | None, typer.Option(help="the rubric text")] = None,
    rubric_file: Annotated[Path | None, typer.Option(help="read the rubric from this file")] = None,
    header: Annotated[list[str] | None, typer.Option(help="webhook header 'Name: value' (repeatable)")] = None,
    header_from_env: Annotated[list[str] | None, typer.Option(help="webhook header Name=ENV_VAR (repeatable)")] = None,
    request_id: Annotated[str | None, typer.Option(help="your id; default: derived from the content")] = None,
    tenant: Annotated[str | None, typer.Option()] = None,
    as_json: JsonOpt = False,
) -> None:
    """Submit a critique request; the criticizer_due_work sensor's next drain run takes it."""
    if (rubric is None) == (rubric_file is None):
        fail("give exactly one of --rubric or --rubric-file")
    if rubric_file is not None:
        try:
            rubric = rubric_file.read_text(encoding="utf-8")
        except OSError as exc:
            fail(f"cannot read --rubric-file: {exc.strerror}")
    request = {"artifact_url": artifact_url, "rubric": rubric, "webhook_url": webhook_url,
               "webhook_headers": parse_headers(header or [], header_from_env or []),
               "request_id": request_id, "tenant": tenant}
    try:
        with database_session(Settings()) as url:
            submitted = api.submit(engine_for(url), request)  # artifact stores from the configuration
    except (api.InvalidRequest, api.RequestIdConflict) as refused:
        fail(str(refused))
    if as_json:
        typer.echo(json.dumps({"request_id": submitted.request_id, "created": submitted.created}))
    else:
        verb = "submitted" if submitted.created else "already submitted (nothing changed)"
        typer.echo(f"critique request {submitted.request_id}: {verb}; the {due_work_sensor_name(PIPELINE)} sensor's "
                   "next drain run takes it")


@app.command("status")
def status(request_id: str, as_json: JsonOpt = False) -> None:
    """Where a request stands: stages done, attempts, critique, dead letter."""
    try:
        with database_session(Settings()) as url:
            found = api.status(engine_for(url), request_id)
    except api.UnknownRequest as missing:
        fail(str(missing))
    if as_json:
        typer.echo(json.dumps(found.as_json(), default=str, indent=2))
        return
    typer.echo(f"{found.request_id}: {found.status}; stages done: {', '.join(found.completed_stages) or '-'}; "
               f"attempts: {json.dumps(dict(found.stage_attempts))}")
    if found.dead_letter_id is not None:
        typer.echo(f"  dead letter {found.dead_letter_id}: {found.error_class} at {found.failed_stage} "
                   f"(`redrive dlq show {found.dead_letter_id}`)")
    if found.critique:
        typer.echo(f"  critique: {found.critique['verdict']} ({found.critique['score']}/10)")


@app.command("list")
def list_requests(status: Annotated[str | None, typer.Option(help="submitted, processing or done")] = None,
                  limit: int = 50, as_json: JsonOpt = False) -> None:
    """Recent requests, newest first."""
    with database_session(Settings()) as url, engine_for(url).connect() as conn:
        rows = repository.list_(conn, status=status, limit=limit)
    out = [{"request_id": r.request_id, "status": r.status, "stage_attempts": dict(r.stage_attempts),
            "created_at": r.created_at.isoformat() if r.created_at else None} for r in rows]
    if as_json:
        typer.echo(json.dumps(out, indent=2))
    else:
        for r in out:
            typer.echo(f"{r['request_id']}  {r['status']}  {json.dumps(r['stage_attempts'])}")


def main() -> None:  # pragma: no cover - console entry
    from redrive import logs

    logs.configure(default_level="WARNING", only_if_set=True)
    try:
        app()
    except Exception as exc:  # noqa: BLE001 - one line for operators, never a stack trace
        from redrive.sanitize import sanitize_text

        typer.echo(f"error: {sanitize_text(type(exc).__name__ + ': ' + str(exc))[:300]}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
