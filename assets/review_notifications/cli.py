"""`python -m assets.review_notifications.cli`: create, show and repair review notification jobs.

    create --idempotency-key K --changelist CL-4711 --review-version 3 --recipient a@x --recipient b@x
           [--summary TEXT] [--json]
    show JOB_KEY_OR_ID [--json]
    waive DELIVERY_ID --note "INC-7: reviewer left the team"

`create` is idempotent per key (a repeat prints the original job, mode `duplicate`); a version
below the changelist's latest is refused. With DAGSTER_HOME set the job's partition is added to
that instance at once; otherwise the `review_notifications_pending_jobs` sensor adds it. Errors
are one line on stderr with exit code 2, never a stack trace.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn

import sqlalchemy as sa
import typer

from assets.review_notifications import api, policy, repository
from redrive.db import engine_for
from resources.database import database_session
from redrive.settings import Settings

app = typer.Typer(help="review notification jobs: create, show, waive", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
KNOWN_ERRORS = (policy.InvalidRequest, policy.VersionRegression, repository.UnknownJob)


@contextmanager
def engine() -> Iterator[sa.Engine]:
    with database_session(Settings()) as url:
        yield engine_for(url)


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def dagster_instance() -> Any:
    if not os.environ.get("DAGSTER_HOME"):
        return None
    import dagster as dg

    return dg.DagsterInstance.get()


@app.command()
def create(
    idempotency_key: Annotated[str, typer.Option("--idempotency-key", help="the caller's key; a repeat is a no-op")],
    changelist: Annotated[str, typer.Option("--changelist", help="changelist id, e.g. CL-4711")],
    review_version: Annotated[str, typer.Option("--review-version", help="3 or v3")],
    recipient: Annotated[list[str], typer.Option("--recipient", help="reviewer address; repeat the option")],
    summary: Annotated[str, typer.Option("--summary", help="review summary for the email")] = "",
    as_json: JsonOpt = False,
) -> None:
    """Create a job (or get the one this key or version already has)."""
    request = {"idempotency_key": idempotency_key, "changelist_id": changelist, "review_version": review_version,
               "recipients": recipient, "summary": summary}
    try:
        with engine() as eng:
            submission = api.submit(eng, request)
    except KNOWN_ERRORS as exc:
        fail(str(exc))
    try:
        instance = dagster_instance()
        if instance is not None:
            api.register_partition(instance, submission.job.key)
    except Exception as exc:  # noqa: BLE001 - the job is saved; the pending-jobs sensor adds the partition
        typer.echo(f"warning: partition not added now ({type(exc).__name__}); the sensor will add it", err=True)
    if as_json:
        typer.echo(json.dumps(submission.as_json()))
        return
    job = submission.job
    note = "" if submission.request_matches else " (this key was first used with another request; that one stands)"
    typer.echo(f"{job.key} (job {job.id}): {submission.mode}, status {job.status}{note}")


@app.command()
def show(job: Annotated[str, typer.Argument(help="job key (CL-4711:v3) or id")], as_json: JsonOpt = False) -> None:
    """A job and its outbox rows."""
    try:
        with engine() as eng:
            found, deliveries = api.show(eng, job)
    except KNOWN_ERRORS as exc:
        fail(str(exc))
    rows = [{"id": d.id, "recipient": d.recipient, "status": d.status, "notification_id": d.notification_id,
             "notified_at": d.notified_at.isoformat() if d.notified_at else None, "attempts": d.attempts,
             "reconciliations": d.reconciliations, "last_error": d.last_error} for d in deliveries]
    if as_json:
        typer.echo(json.dumps({**found.as_json(), "deliveries": rows}))
        return
    typer.echo(f"{found.key} (job {found.id}): {found.status}  key={found.idempotency_key}  result={found.result}")
    for r in rows:
        typer.echo(f"  {r['id']:>6}  {r['status']:<10} attempts={r['attempts']} "
                   f"reconciled={r['reconciliations']}  {r['recipient']}  {r['last_error'] or ''}".rstrip())


@app.command()
def waive(delivery_id: int, note: Annotated[str, typer.Option("--note", help="why (ticket, reason)")] = "") -> None:
    """Drop an undeliverable recipient from the required set; resolves its dead letter, re-finalizes the job."""
    try:
        with engine() as eng:
            job = api.waive(eng, delivery_id, note=note, operator=os.environ.get("USER", "operator"))
    except KNOWN_ERRORS as exc:
        fail(str(exc))
    typer.echo(f"delivery {delivery_id} waived; {job.key} is {job.status}")


if __name__ == "__main__":
    app()
