"""`redrive evidence …`: look at a file job and force its N2 (004 §5) before the deadline.

    show FILE_JOB_ID [--json]                  status, N1/N2, artifacts attached / in flight / failed
    force-n2 FILE_JOB_ID --note "INC-9: …"     what 004 §5's 24 h deadline does, now

A forced N2 closes what is still retryable (`PERMANENT_FAILED`) and makes the touched rows due: the
next drain run of the file job dead-letters them and sends N2. Errors are one line, exit 2.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any
from uuid import UUID

import typer

from assets.evidence import repository as repo
from assets.evidence import service
from resources.commands import engine, fail

app = typer.Typer(help="evidence file jobs: show, force-n2", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]






def job_id_of(value: str) -> UUID:
    try:
        return UUID(value)
    except ValueError:
        fail(f"not a file job id (a UUID): {value!r}")


def _iso(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


@app.command()
def show(file_job: Annotated[str, typer.Argument(help="file job id")], as_json: JsonOpt = False) -> None:
    """A file job: status, N1 and N2, its artifacts attached, in flight and failed."""
    job_id = job_id_of(file_job)
    with engine() as eng, eng.connect() as conn:
        job = repo.get_file_job(conn, job_id)
        if job is None:
            fail(f"file job {job_id} does not exist")
        facts = repo.job_facts(conn, job, details=True)
    failed = [{"artifact": str(f.artifact_id), "case": f.case_ref, "file": f.file_name, "code": f.error_code,
               "final": f.final} for f in facts.failed]
    out = {"id": str(job.id), "source": job.source_name, "status": job.status, "error_code": job.error_code,
           "artifacts": facts.total, "attached": facts.attached, "in_flight": facts.in_flight,
           "n1_sent_at": _iso(job.n1_sent_at), "n2_requested_at": _iso(job.n2_requested_at),
           "n2_sent_at": _iso(job.n2_sent_at), "n2_forced": job.n2_forced, "failed": failed}
    if as_json:
        typer.echo(json.dumps(out))
        return
    n2 = ("not yet" if job.n2_requested_at is None else
          f"{'forced, ' if job.n2_forced else ''}{'sent ' + job.n2_sent_at.isoformat() if job.n2_sent_at else 'requested'}")
    typer.echo(f"file job {job.id} ({job.source_name}): {job.status}")
    typer.echo(f"  artifacts: {facts.total}, attached {facts.attached}, in flight {facts.in_flight}, "
               f"failed {len(failed)}")
    typer.echo(f"  N1: {'sent ' + job.n1_sent_at.isoformat() if job.n1_sent_at else 'not yet'}; N2: {n2}")
    for f in failed:
        typer.echo(f"  {f['case']}  {f['file']}  {f['code']}  {'final' if f['final'] else 'retry pending'}")


@app.command("force-n2")
def force_n2(file_job: Annotated[str, typer.Argument(help="file job id")],
             note: Annotated[str, typer.Option("--note", help="why now (ticket, reason)")] = "") -> None:
    """Send N2 now instead of at the 24 h deadline; what is still retryable is closed as failed."""
    if not note.strip():
        fail("say why with --note (ticket and reason); it is logged with the forced N2")
    job_id = job_id_of(file_job)
    from assets.evidence.settings import EvidenceSettings  # (defines a Dagster resource: only where it is needed)
    from redrive.clock import SystemClock

    knobs = EvidenceSettings()
    try:
        with engine() as eng:
            job = service.force_n2_now(eng, job_id, now=SystemClock().now(),
                                       mark_permanent=knobs.n2_force_marks_permanent)
    except service.N2NotForced as refused:
        fail(str(refused))
    operator = os.environ.get("USER", "operator")
    typer.echo(f"file job {job.id}: N2 forced by {operator} ({note.strip()}); the next drain run of the file job "
               "sends it and dead-letters the closed rows")


if __name__ == "__main__":
    app()
