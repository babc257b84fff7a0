"""`redrive matching …`: triage documents whose matching is stuck, and re-queue them (seed 000).

    stuck [--older-than SECONDS] [--json]    `in-progress` longer than MATCHING_STUCK_AFTER_SECONDS: a worker died
    show DOCUMENT_ID [--json]                status, attempts (deliveries), last error, when the delivery started
    requeue DOCUMENT_ID… --note "INC-5: …"   back to `pending` and published again (what matching_requeue_job does)

A stuck document whose message SQS still holds is delivered again after the visibility timeout; after
its third delivery the message is in the DLQ and only a re-queue brings the document back. Errors
are one line, exit 2.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Annotated, Any

import typer

from assets.matching import repository
from assets.matching.settings import MatchingSettings
from resources.commands import engine, fail

app = typer.Typer(help="matching documents: stuck, show, requeue", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
SHOWN = ("id", "tenant", "matching_status", "matching_attempts", "matching_started_at", "matching_failed_at",
         "matching_error", "cluster_id")






def _iso(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


@app.command()
def stuck(older_than: Annotated[float | None, typer.Option(help="seconds in progress; default "
                                                                  "MATCHING_STUCK_AFTER_SECONDS")] = None,
          as_json: JsonOpt = False) -> None:
    """Documents `in-progress` longer than the stuck threshold (a worker died mid-delivery)."""
    from redrive.clock import SystemClock

    seconds = MatchingSettings().stuck_after_seconds if older_than is None else older_than
    with engine() as eng, eng.connect() as conn:
        found = repository.stuck_in_progress(conn, SystemClock().now() - timedelta(seconds=seconds))
    rows = [{"id": d.id, "tenant": d.tenant, "attempts": d.attempts, "started_at": d.started_at.isoformat()}
            for d in found]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    typer.echo(f"{len(rows)} documents in-progress for more than {seconds:g} s")
    for r in rows:
        typer.echo(f"  {r['id']}  tenant {r['tenant']}  delivery {r['attempts']}  started {r['started_at']}")


@app.command()
def show(document_id: str, as_json: JsonOpt = False) -> None:
    """A document's matching status, deliveries, last error and cluster."""
    with engine() as eng, eng.connect() as conn:
        doc = repository.get(conn, document_id)
    if doc is None:
        fail(f"document {document_id!r} does not exist")
    out = {k: _iso(doc.get(k)) for k in SHOWN}
    if as_json:
        typer.echo(json.dumps(out))
        return
    for k in SHOWN:
        typer.echo(f"{k:>20}: {out[k]}")


@app.command()
def requeue(document_ids: Annotated[list[str], typer.Argument(help="document ids")],
            note: Annotated[str, typer.Option("--note", help="why (ticket, what was fixed)")] = "") -> None:
    """Set documents back to `pending` and publish them to the matching queue again (idempotent to match)."""
    if not note.strip():
        fail("say why with --note (ticket and what was fixed)")
    from assets.matching import ingestion
    from assets.matching.pipeline import matching_resource
    from redrive.settings import Settings

    settings = Settings()
    with engine() as eng:
        queued = ingestion.requeue(eng, matching_resource(settings, MatchingSettings()).queue(), document_ids)
    missing = sorted(set(document_ids) - set(queued))
    typer.echo(f"re-queued {len(queued)} documents ({note.strip()})"
               + (f"; unknown: {', '.join(missing)}" if missing else ""))
    if missing and not queued:
        raise typer.Exit(2)


if __name__ == "__main__":
    app()
