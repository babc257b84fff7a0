"""`redrive review …`: create, inspect and repair review notification jobs.

    create --idempotency-key K --changelist CL-4711 --review-version 3 --recipient a@x --recipient b@x
           [--summary TEXT] [--json]
    show JOB_KEY_OR_ID [--json]      the job, its work row (due when, attempts, last error), its outbox
    status [--json]                  jobs per status, the work queue, open dead letters
    waive DELIVERY_ID --note "INC-7: reviewer left the team"

`create` is idempotent per key (a repeat prints the original job, mode `duplicate`); a version
below the changelist's latest is refused. A created job is due at once: the due-work sensor starts
a drain run. Errors are one line on stderr with exit code 2, never a stack trace.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Annotated, Any

import typer

from assets.review_notifications import api, policy, repository
from resources.commands import engine, fail

app = typer.Typer(help="review notification jobs: create, show, status, waive", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
KNOWN_ERRORS = (policy.InvalidRequest, policy.VersionRegression, repository.UnknownJob)






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
    if as_json:
        typer.echo(json.dumps(submission.as_json()))
        return
    job = submission.job
    note = "" if submission.request_matches else " (this key was first used with another request; that one stands)"
    typer.echo(f"{job.key} (job {job.id}): {submission.mode}, status {job.status}{note}")


@app.command()
def show(job: Annotated[str, typer.Argument(help="job key (CL-4711:v3) or id")], as_json: JsonOpt = False) -> None:
    """A job, its work row and its outbox rows."""
    try:
        with engine() as eng:
            found, deliveries = api.show(eng, job)
            scheduled = api.work_state(eng, found.key)
    except KNOWN_ERRORS as exc:
        fail(str(exc))
    queue = None if scheduled is None else {
        "status": scheduled.status, "due_at": _iso(scheduled.due_at), "stage": scheduled.stage,
        "attempts": dict(scheduled.attempts), "last_error": scheduled.last_error, "lease_owner": scheduled.lease_owner}
    rows = [{"id": d.id, "recipient": d.recipient, "status": d.status, "notification_id": d.notification_id,
             "notified_at": d.notified_at.isoformat() if d.notified_at else None, "attempts": d.attempts,
             "reconciliations": d.reconciliations, "last_error": d.last_error} for d in deliveries]
    if as_json:
        typer.echo(json.dumps({**found.as_json(), "work": queue, "deliveries": rows}))
        return
    typer.echo(f"{found.key} (job {found.id}): {found.status}  key={found.idempotency_key}  result={found.result}")
    if queue is not None:
        when = "" if queue["status"] == "done" else f" due {queue['due_at']}"
        held = f" (held by {queue['lease_owner']})" if queue["lease_owner"] else ""
        typer.echo(f"  work: {queue['status']}{when}{held} attempts={queue['attempts']} "
                   f"{queue['last_error'] or ''}".rstrip())
    for r in rows:
        typer.echo(f"  {r['id']:>6}  {r['status']:<10} attempts={r['attempts']} "
                   f"reconciled={r['reconciliations']}  {r['recipient']}  {r['last_error'] or ''}".rstrip())


@app.command()
def status(as_json: JsonOpt = False) -> None:
    """Jobs per status, the work queue (due now, being worked, next due) and open dead letters."""
    with engine() as eng:
        summary = api.status(eng)
    if as_json:
        typer.echo(json.dumps(summary, default=_iso))
        return
    jobs = ", ".join(f"{n} {s}" for s, n in summary["jobs"].items()) or "none"
    queue = summary["work"]
    typer.echo(f"jobs: {jobs}")
    typer.echo(f"work queue: {queue['due']} due now, {queue['leased']} being worked, next due "
               f"{_iso(queue['next_due_at']) or '-'}; rows {queue['rows']}")
    typer.echo(f"open dead letters: {summary['dead_letters']['jobs']} jobs, {summary['dead_letters']['recipients']} "
               "recipients (`redrive dlq list --pipeline review_notifications`)")


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


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
