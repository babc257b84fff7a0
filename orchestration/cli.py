"""`redrive`: the operator's command for dead letters, alerts and the schema.

    redrive dlq list [--pipeline P] [--error-class C] [--status S] [--json]
    redrive dlq show ID [--json]
    redrive dlq replay ID --note "INC-123: key rotated" --confirm-safe [--from-start]
    redrive dlq replay-bulk --pipeline P --error-class C [--since …] --rate 2 --note … --confirm-safe
    redrive dlq resolve ID --note "redone by hand"
    redrive dlq reconcile [--limit N]
    redrive alerts dispatch
    redrive db upgrade | downgrade

A replay marks the dead letter `replaying`; the `redrive_dead_letter_replays` sensor
starts the run (from the failed stage unless --from-start). Errors are one line,
never a stack trace.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated, Any

import sqlalchemy as sa
import typer

from redrive import deadletters
from redrive.clock import SystemClock
from redrive.db import downgrade_base, engine_for, upgrade_head
from redrive.deadletters import DeadLetter, ReplayRefused
from redrive.settings import Settings
from resources.database import database_session

app = typer.Typer(help="redrive operator commands", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
dlq = typer.Typer(help="dead letters: list, show, replay, resolve", no_args_is_help=True)
db = typer.Typer(help="schema migrations", no_args_is_help=True)
alerts_app = typer.Typer(help="alert delivery", no_args_is_help=True)
app.add_typer(dlq, name="dlq")
app.add_typer(db, name="db")
app.add_typer(alerts_app, name="alerts")

def _mount_pipeline_commands() -> None:
    """Each pipeline's own commands (`redrive criticizer submit`, …), from the registry."""
    import importlib

    from orchestration.registry import PIPELINES

    for pipeline in PIPELINES:
        for name, target in pipeline.commands.items():
            module, attr = target.split(":")
            app.add_typer(getattr(importlib.import_module(module), attr), name=name)


_mount_pipeline_commands()

JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


@contextmanager
def connection() -> Iterator[sa.Connection]:
    with database_session(Settings()) as url, engine_for(url).begin() as conn:
        yield conn


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def table(rows: list[DeadLetter]) -> str:
    headers = ["id", "pipeline", "stage", "entity", "error_class", "attempts", "status", "replays", "last_failure"]
    data = [[str(r.id), r.pipeline, r.stage, r.entity_ref, r.error_class, str(r.attempts), r.status,
             str(r.replay_count), r.last_failure_at.strftime("%Y-%m-%d %H:%M:%S")] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in data)) if data else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in data)])


def show_text(letter: DeadLetter) -> str:
    fields: list[tuple[str, Any]] = [
        ("id", letter.id), ("pipeline", letter.pipeline), ("stage", letter.stage), ("entity", letter.entity_ref),
        ("tenant", letter.tenant), ("status", letter.status), ("error_class", letter.error_class),
        ("retryable", letter.retryable), ("message", letter.error_message), ("attempts", letter.attempts),
        ("stage_attempts", json.dumps(letter.stage_attempts)), ("upstream_status", letter.upstream_status),
        ("first_failure_at", letter.first_failure_at.isoformat()), ("last_failure_at", letter.last_failure_at.isoformat()),
        ("occurrences", letter.occurrences), ("replays", letter.replay_count), ("replay_from", letter.replay_from),
        ("remediation", letter.remediation_evidence), ("payload_ref", json.dumps(letter.payload_ref)),
        ("context", json.dumps(letter.sanitized_context, default=str)), ("run_id", letter.run_id),
    ]
    out = [f"{k:>17}: {v}" for k, v in fields if v is not None]
    out.append("            notes:")
    out += [f"  - {n.get('at', '')} {n.get('kind', '')} ({n.get('by', '')}): {n.get('text', '')}" for n in letter.notes]
    out.append("       last_stack:")
    out += ["    " + line for line in letter.last_stack.splitlines()[-30:]]
    return "\n".join(out)


def parse_time(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        fail(f"not an ISO time: {value!r}")
    if parsed.tzinfo is None:
        fail(f"give a timezone with {value!r} (e.g. {value}+00:00)")
    return parsed


@dlq.command("list")
def dlq_list(
    pipeline: Annotated[str | None, typer.Option(help="only this pipeline")] = None,
    error_class: Annotated[str | None, typer.Option(help="only this error class")] = None,
    status: Annotated[list[str] | None, typer.Option(help="open, replaying, escalated, resolved")] = None,
    limit: int = 100,
    as_json: JsonOpt = False,
) -> None:
    """Dead letters, newest failure first (open and escalated by default)."""
    flt = deadletters.Filter(pipeline=pipeline, error_class=error_class,
                             statuses=tuple(status) if status else (deadletters.OPEN, deadletters.ESCALATED,
                                                                    deadletters.REPLAYING), limit=limit)
    with connection() as conn:
        rows = deadletters.list_(conn, flt)
    typer.echo(json.dumps([r.as_json() for r in rows], default=str, indent=2) if as_json else table(rows))


@dlq.command("show")
def dlq_show(dead_letter_id: int, as_json: JsonOpt = False) -> None:
    """Everything triage needs (§8.5): error class, stage, attempts, context, stack, notes."""
    with connection() as conn:
        letter = deadletters.get(conn, dead_letter_id)
    if letter is None:
        fail(f"dead letter {dead_letter_id} does not exist")
    typer.echo(json.dumps(letter.as_json(), default=str, indent=2) if as_json else show_text(letter))


@dlq.command("replay")
def dlq_replay(
    dead_letter_id: int,
    note: Annotated[str | None, typer.Option(help="remediation evidence: ticket and what was fixed")] = None,
    confirm_safe: Annotated[bool, typer.Option("--confirm-safe", help="the replay is idempotent or safe")] = False,
    from_start: Annotated[bool, typer.Option("--from-start", help="restart all stages")] = False,
    operator: Annotated[str, typer.Option(help="who asks")] = "operator",
    as_json: JsonOpt = False,
) -> None:
    """Replay from the failed stage after remediation; the replay sensor starts the run."""
    try:
        with connection() as conn:
            letter = deadletters.request_replay(conn, dead_letter_id, evidence=note, confirm_safe=confirm_safe,
                                                at=SystemClock().now(), operator=operator, from_start=from_start)
    except ReplayRefused as refused:
        fail(str(refused))
    if as_json:
        typer.echo(json.dumps(letter.as_json(), default=str, indent=2))
    else:
        where = "all stages" if from_start else f"stage {letter.stage}"
        typer.echo(f"dead letter {letter.id}: replay {letter.replay_count} requested from {where}; "
                   "the redrive_dead_letter_replays sensor starts the run")


@dlq.command("replay-bulk")
def dlq_replay_bulk(
    pipeline: Annotated[str, typer.Option(help="pipeline to redrive")],
    note: Annotated[str, typer.Option(help="remediation evidence")],
    confirm_safe: Annotated[bool, typer.Option("--confirm-safe")] = False,
    error_class: Annotated[str | None, typer.Option()] = None,
    since: Annotated[str | None, typer.Option(help="ISO time, inclusive")] = None,
    until: Annotated[str | None, typer.Option(help="ISO time, exclusive")] = None,
    rate: Annotated[float, typer.Option(help="replays requested per second")] = 1.0,
    limit: int = 1000,
) -> None:
    """Replay many dead letters by filter at a bounded rate, so a recovered upstream is not flooded."""
    from redrive.bulk import bulk_replay

    flt = deadletters.Filter(pipeline=pipeline, error_class=error_class, since=parse_time(since),
                             until=parse_time(until), limit=limit)
    with database_session(Settings()) as url:
        report = bulk_replay(engine_for(url), flt, evidence=note, confirm_safe=confirm_safe, rate=rate,
                             clock=SystemClock(), sleep=time.sleep)
    typer.echo(f"requested {report.requested} replays, refused {report.refused}")
    for line in report.refusals[:20]:
        typer.echo(f"  refused: {line}")


@dlq.command("resolve")
def dlq_resolve(dead_letter_id: int, note: Annotated[str | None, typer.Option(help="why it is closed")] = None,
                operator: str = "operator", as_json: JsonOpt = False) -> None:
    """Close a dead letter without replay; the note says why."""
    try:
        with connection() as conn:
            letter = deadletters.resolve(conn, dead_letter_id, note=note or "", at=SystemClock().now(),
                                         operator=operator)
    except ReplayRefused as refused:
        fail(str(refused))
    typer.echo(json.dumps(letter.as_json(), default=str, indent=2) if as_json else f"dead letter {letter.id}: resolved")


@dlq.command("reconcile")
def dlq_reconcile(limit: Annotated[int, typer.Option(help="at most this many per pipeline")] = 100) -> None:
    """Dead-letter (and alert) every entity failed for good without a dead letter, as the
    redrive_dead_letter_reconciliation sensor does every 5 minutes."""
    from orchestration.registry import load_pipelines  # the command is an edge: it may load the pipelines
    from redrive.reconcile import reconcile
    from redrive.reliability import Reliability
    from resources.factory import notifier_from

    settings = Settings()
    sources = {k: v for p in load_pipelines(settings) for k, v in p.failed_for_good.items()}
    with database_session(settings) as url:
        runtime = Reliability(engine=engine_for(url),
                              channels=notifier_from(settings).process_config_and_initialize().channels(),
                              burst_window=settings.alert_burst_window_seconds)
        repaired = reconcile(runtime, sources, limit=limit)
    for r in repaired:
        typer.echo(f"{r.pipeline} {r.entity_ref}: dead letter {r.dead_letter_id} written")
    typer.echo(f"{len(repaired)} repaired ({', '.join(sources)} checked)")


@alerts_app.command("dispatch")
def alerts_dispatch() -> None:
    """Send pending alerts now (the alert sensor does this every 30 s)."""
    from resources.factory import notifier_from
    from redrive.reliability import Reliability

    settings = Settings()
    with database_session(settings) as url:
        runtime = Reliability(engine=engine_for(url), channels=notifier_from(settings).process_config_and_initialize().channels(),
                              burst_window=settings.alert_burst_window_seconds)
        report = runtime.try_dispatch()
    typer.echo(f"{report}" if report else "no channel configured")


@db.command("upgrade")
def db_upgrade() -> None:
    """alembic upgrade head."""
    with database_session(Settings()) as url:
        upgrade_head(url)
    typer.echo("schema at head")


@db.command("downgrade")
def db_downgrade(yes: Annotated[bool, typer.Option("--yes", help="really drop every redrive table")] = False) -> None:
    """alembic downgrade base (drops redrive's tables)."""
    if not yes:
        fail("this drops every redrive table; pass --yes")
    with database_session(Settings()) as url:
        downgrade_base(url)
    typer.echo("schema at base")


def main() -> None:  # pragma: no cover - console entry
    from redrive import logs

    logs.install()
    try:
        app()
    except Exception as exc:  # noqa: BLE001 - one canonical line for operators, never a stack trace
        from redrive.failures import classify_exception

        failure = classify_exception(exc)
        typer.echo(f"error: {failure.code}: {failure.message}", err=True)
        sys.exit(1)
