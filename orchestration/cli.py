"""`redrive`: the operator's command for dead letters, alerts and the schema.

    redrive dlq list [--pipeline P] [--error-class C] [--status S] [--entity E] [--search T] [--group F] [--json]
    redrive dlq groups [--pipeline P] [--json]
    redrive dlq replay-group F --note "INC-123: key rotated" --confirm-safe [--rate 2]
    redrive dlq show ID [--json]
    redrive dlq replay ID --note "INC-123: key rotated" --confirm-safe [--from-start]
    redrive dlq replay-bulk --pipeline P --error-class C [--since …] --rate 2 --note … --confirm-safe
    redrive dlq resolve ID --note "redone by hand"
    redrive dlq reconcile [--limit N]
    redrive breaker [--window N] [--json]
    redrive rehearse list | RECIPE… | all       (on a running `make serve`)
    redrive console token NAME | serve [--host H] [--port P]
    redrive alerts dispatch
    redrive db upgrade | downgrade
    redrive metrics serve [--host H] [--port P]
    redrive retention plan [--json]
    redrive retention run [--batch-size N] [--pause S]

A replay marks the dead letter `replaying`; the `redrive_dead_letter_replays` sensor
starts the run (from the failed stage unless --from-start). Errors are one line,
never a stack trace.

The core's commands are plain click (issue 16 §6: `--help` and the reading commands answer in a
fraction of a second; typer's import alone cost more than the rest). Each pipeline's own commands
stay typer apps, mounted by name from the registry and imported only when one of them runs.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

import click

if TYPE_CHECKING:  # the heavy modules load inside the commands that use them: `--help` stays fast
    from datetime import datetime

    import sqlalchemy as sa

    from redrive.deadletter_reads import DeadLetter


class _PipelineCommand(click.Command):
    """A pipeline's typer app under its registry name, imported only when it runs (click's lazy-loading pattern).

    Every argument after the name, `--help` included, goes to the pipeline's own command, which parses it,
    prints its help and errors, and exits with its own status.
    """

    def __init__(self, name: str, target: str, pipeline: str) -> None:
        super().__init__(name, help=f"{pipeline} pipeline commands (`redrive {name} --help`)", add_help_option=False,
                         context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
        self.target = target

    def load(self) -> Any:
        """The pipeline's click group (typer's), with plain help: typer's rich help prints a flag as `--json <bool>`."""
        import importlib

        import typer

        module, attr = self.target.split(":")
        command = typer.main.get_group(getattr(importlib.import_module(module), attr))  # a group even with one command
        command.name = self.name
        _plain_help(command)
        return command

    def invoke(self, ctx: click.Context) -> Any:
        return self.load().main(args=list(ctx.args), prog_name=ctx.command_path)


def _plain_help(command: Any) -> None:
    command.rich_markup_mode = None
    for sub in getattr(command, "commands", {}).values():
        _plain_help(sub)


class _Group(click.Group):
    """Commands listed in the order they were added (click sorts them), and help when called bare."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, no_args_is_help=True, **kwargs)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


class _Redrive(_Group):
    """The core's commands, plus each pipeline's commands mounted by name without importing them."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*super().list_commands(ctx), *_pipeline_commands()]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return super().get_command(ctx, cmd_name) or _pipeline_commands().get(cmd_name)


def _pipeline_commands() -> dict[str, _PipelineCommand]:
    """Each pipeline's own commands (`redrive criticizer submit`, …), from the registry."""
    from orchestration.registry import PIPELINES

    return {name: _PipelineCommand(name, target, p.name) for p in PIPELINES for name, target in p.commands.items()}


# typer showed defaults and `[required]`; so does this
app = _Redrive("redrive", help="redrive operator commands", context_settings={"show_default": True})


@app.group(cls=_Group)
def dlq() -> None:
    """dead letters: list, show, replay, resolve"""


@app.group("metrics", cls=_Group)
def metrics_app() -> None:
    """Prometheus metrics of every pipeline"""


@app.group(cls=_Group)
def db() -> None:
    """schema migrations"""


@app.group("console", cls=_Group)
def console_app() -> None:
    """The dead-letter console: a web page of every pipeline's dead letters by root cause."""


@app.group("alerts", cls=_Group)
def alerts_app() -> None:
    """alert delivery"""


@app.group("retention", cls=_Group)
def retention_app() -> None:
    """what is kept how long, and the pruner"""


def json_option(f: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="machine-readable output")(f)


@contextmanager
def database_url() -> Iterator[str]:
    """DATABASE_URL as it is (the deployed case: no settings, no Dagster import); unset, the database of a running
    `make serve` (its .data/serve.env: no server to start, issue 27); else the embedded server for this command."""
    url = os.environ.get("DATABASE_URL") or served_database_url()
    if url:
        yield url
        return
    from redrive.settings import Settings
    from resources.postgres import database_session

    with database_session(Settings()) as url:
        yield url


def served_database_url() -> str | None:
    """The DATABASE_URL of a `make serve` that is running (devstack.serve_env), or None."""
    from devstack import serve_env

    served = serve_env.running()
    return served.get("DATABASE_URL") if served else None


@contextmanager
def connection() -> Iterator[sa.Connection]:
    from redrive.db import engine_for

    with database_url() as url, engine_for(url).begin() as conn:
        yield conn


@contextmanager
def reading() -> Iterator[Any]:
    """A read-only psycopg2 cursor for `dlq list/show`: the core's read queries (redrive.deadletter_reads) without
    loading SQLAlchemy, so an operator's look answers in a fraction of a second."""
    import psycopg2

    with database_url() as url:
        scheme, sep, rest = url.partition("://")
        conn = psycopg2.connect(scheme.split("+")[0] + sep + rest)  # libpq knows no "+psycopg2"
        try:
            conn.set_session(readonly=True, autocommit=True)
            with conn.cursor() as cursor:
                yield cursor
        finally:
            conn.close()


def fail(message: str) -> NoReturn:
    """The canonical error: one line on stderr, exit status 2, never a stack trace."""
    click.echo(f"error: {message}", err=True)
    raise click.exceptions.Exit(2)


def check_pipeline(pipeline: str | None) -> None:
    """A pipeline the registry does not know is a typo, not an empty result (issue 13 §15)."""
    from orchestration.registry import PIPELINES

    names = [p.name for p in PIPELINES]
    if pipeline is not None and pipeline not in names:
        fail(f"unknown pipeline {pipeline!r}; one of: {', '.join(names)}")


def check_statuses(statuses: list[str]) -> None:
    from redrive.deadletter_reads import STATUSES

    for status in statuses:
        if status not in STATUSES:
            fail(f"unknown status {status!r}; one of: {', '.join(STATUSES)}")


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
    from datetime import datetime

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
@click.option("--pipeline", help="only this pipeline")
@click.option("--error-class", help="only this error class")
@click.option("--status", multiple=True, help="open, replaying, escalated, resolved")
@click.option("--entity", help="this entity, or the entities under it (a partition's users, a file job's rows)")
@click.option("--search", help="text in the message, entity, stage or error class (any case)")
@click.option("--group", "fingerprint", help="one root cause: a fingerprint `redrive dlq groups` shows")
@click.option("--limit", type=int, default=100)
@json_option
def dlq_list(pipeline: str | None, error_class: str | None, status: tuple[str, ...], entity: str | None,
             search: str | None, fingerprint: str | None, limit: int, as_json: bool) -> None:
    """Dead letters, newest failure first (open, replaying and escalated by default)."""
    check_pipeline(pipeline)
    check_statuses(status or [])
    from redrive import deadletter_reads as reads

    flt = reads.Filter(pipeline=pipeline, error_class=error_class,
                       statuses=tuple(status) if status else (reads.OPEN, reads.ESCALATED, reads.REPLAYING),
                       limit=limit, entity=entity, search=search, fingerprint=fingerprint)
    with reading() as cursor:
        rows = reads.list_(cursor, flt)
    click.echo(json.dumps([r.as_json() for r in rows], default=str, indent=2) if as_json else table(rows))


@dlq.command("groups")
@click.option("--pipeline", help="only this pipeline")
@click.option("--status", multiple=True, help="open, replaying, escalated, resolved (default: all but resolved)")
@click.option("--limit", type=int, default=50)
@json_option
def dlq_groups(pipeline: str | None, status: tuple[str, ...], limit: int, as_json: bool) -> None:
    """Dead letters by root cause (pipeline, stage, error class, fingerprint of the message): counts, first and
    last seen, a sample. `dlq list --group F` lists one; `dlq replay-group F` replays it."""
    check_pipeline(pipeline)
    check_statuses(status or [])
    from redrive import deadletter_reads as reads

    flt = reads.Filter(pipeline=pipeline, limit=limit,
                       statuses=tuple(status) if status else (reads.OPEN, reads.ESCALATED, reads.REPLAYING))
    with reading() as cursor:
        found = reads.groups(cursor, flt)
    if as_json:
        click.echo(json.dumps([g.as_json() for g in found], indent=2))
        return
    headers = ["group", "pipeline", "stage", "error_class", "letters", "first_seen", "last_seen", "sample"]
    data = [[g.fingerprint, g.pipeline, g.stage, g.error_class, str(g.letters), f"{g.first_seen:%Y-%m-%d %H:%M}",
             f"{g.last_seen:%Y-%m-%d %H:%M}", f"#{g.sample_id} {g.sample_entity}: {g.sample_message}"[:90]]
            for g in found]
    widths = [max(len(h), *(len(r[i]) for r in data)) if data else len(h) for i, h in enumerate(headers)]
    for row in [headers, ["-" * w for w in widths], *data]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


@dlq.command("show")
@click.argument("dead_letter_id", type=int)
@json_option
def dlq_show(dead_letter_id: int, as_json: bool) -> None:
    """Everything triage needs (§8.5): error class, stage, attempts, context, stack, notes."""
    from redrive import deadletter_reads as reads

    with reading() as cursor:
        letter = reads.get(cursor, dead_letter_id)
    if letter is None:
        fail(f"dead letter {dead_letter_id} does not exist")
    url = run_url(letter.run_id)
    if as_json:
        click.echo(json.dumps({**letter.as_json(), "run_url": url}, default=str, indent=2))
    else:
        click.echo(show_text(letter) if url is None else show_text(letter).replace(
            f"           run_id: {letter.run_id}", f"           run_id: {letter.run_id}\n          run_url: {url}", 1))


def run_url(run_id: str | None) -> str | None:
    """The run's page in the Dagster UI: DAGSTER_UI_URL, else a running serve's, else Dagster's default port."""
    if not run_id:
        return None
    base = os.environ.get("DAGSTER_UI_URL")
    if not base:
        from devstack import serve_env

        base = (serve_env.running() or {}).get("DAGSTER_UI_URL", "http://localhost:3000")
    return f"{base.rstrip('/')}/runs/{run_id}"


@dlq.command("replay")
@click.argument("dead_letter_id", type=int)
@click.option("--note", help="remediation evidence: ticket and what was fixed")
@click.option("--confirm-safe", is_flag=True, help="the replay is idempotent or safe")
@click.option("--from-start", is_flag=True, help="restart all stages")
@click.option("--operator", default="operator", help="who asks")
@json_option
def dlq_replay(dead_letter_id: int, note: str | None, confirm_safe: bool, from_start: bool, operator: str,
               as_json: bool) -> None:
    """Replay from the failed stage after remediation; a sensor starts the run (the message says which)."""
    from redrive import deadletters
    from redrive.clock import SystemClock
    from redrive.deadletters import ReplayRefused

    try:
        with connection() as conn:
            letter = deadletters.request_replay(conn, dead_letter_id, evidence=note, confirm_safe=confirm_safe,
                                                at=SystemClock().now(), operator=operator, from_start=from_start)
            drained = deadletters.is_drained(conn, letter.pipeline, letter.entity_ref)
    except ReplayRefused as refused:
        fail(str(refused))
    if as_json:
        click.echo(json.dumps(letter.as_json(), default=str, indent=2))
    else:
        where = "all stages" if from_start else f"stage {letter.stage}"
        click.echo(f"dead letter {letter.id}: replay {letter.replay_count} requested from {where}; "
                   f"{replay_starter(letter.pipeline, drained)}")


def replay_starter(pipeline: str, drained: bool) -> str:
    """Pure: who runs a requested replay: a drained entity's work row falls due, anything else gets a run."""
    from redrive.run_keys import REPLAY_SENSOR, due_work_sensor_name

    if drained:
        return f"its work row is due now: the {due_work_sensor_name(pipeline)} sensor's next drain run replays it"
    return f"the {REPLAY_SENSOR} sensor starts the run"


@dlq.command("replay-bulk")
@click.option("--pipeline", required=True, help="pipeline to redrive")
@click.option("--note", required=True, help="remediation evidence")
@click.option("--confirm-safe", is_flag=True)
@click.option("--error-class")
@click.option("--since", help="ISO time, inclusive")
@click.option("--until", help="ISO time, exclusive")
@click.option("--rate", type=float, default=1.0, help="replays requested per second")
@click.option("--limit", type=int, default=1000)
@click.option("--group", "fingerprint", help="only this root cause (a fingerprint of `redrive dlq groups`)")
def dlq_replay_bulk(pipeline: str, note: str, confirm_safe: bool, error_class: str | None, since: str | None,
                    until: str | None, rate: float, limit: int, fingerprint: str | None) -> None:
    """Replay many dead letters by filter at a bounded rate, so a recovered upstream is not flooded."""
    check_pipeline(pipeline)
    _replay_bulk(pipeline, note, confirm_safe, error_class, since, until, rate, limit, fingerprint)


@dlq.command("replay-group")
@click.argument("fingerprint")
@click.option("--note", required=True, help="remediation evidence")
@click.option("--confirm-safe", is_flag=True)
@click.option("--rate", type=float, default=1.0, help="replays requested per second")
@click.option("--limit", type=int, default=1000)
def dlq_replay_group(fingerprint: str, note: str, confirm_safe: bool, rate: float, limit: int) -> None:
    """Replay every open letter of one root cause (`redrive dlq groups`), throttled like replay-bulk."""
    _replay_bulk(None, note, confirm_safe, None, None, None, rate, limit, fingerprint)


def _replay_bulk(pipeline: str | None, note: str, confirm_safe: bool, error_class: str | None, since: str | None,
                 until: str | None, rate: float, limit: int, fingerprint: str | None) -> None:
    import time

    from redrive import deadletters
    from redrive.bulk import bulk_replay
    from redrive.clock import SystemClock
    from redrive.db import engine_for

    flt = deadletters.Filter(pipeline=pipeline, error_class=error_class, since=parse_time(since),
                             until=parse_time(until), limit=limit, fingerprint=fingerprint)
    with database_url() as url:
        report = bulk_replay(engine_for(url), flt, evidence=note, confirm_safe=confirm_safe, rate=rate,
                             clock=SystemClock(), sleep=time.sleep)
    click.echo(f"requested {report.requested} replays, refused {report.refused}")
    for line in report.refusals[:20]:
        click.echo(f"  refused: {line}")


@dlq.command("resolve")
@click.argument("dead_letter_id", type=int)
@click.option("--note", help="why it is closed")
@click.option("--operator", default="operator")
@json_option
def dlq_resolve(dead_letter_id: int, note: str | None, operator: str, as_json: bool) -> None:
    """Close a dead letter without replay; the note says why."""
    from redrive import deadletters
    from redrive.clock import SystemClock
    from redrive.deadletters import ReplayRefused

    try:
        with connection() as conn:
            letter = deadletters.resolve(conn, dead_letter_id, note=note or "", at=SystemClock().now(),
                                         operator=operator)
    except ReplayRefused as refused:
        fail(str(refused))
    click.echo(json.dumps(letter.as_json(), default=str, indent=2) if as_json else f"dead letter {letter.id}: resolved")


@dlq.command("reconcile")
@click.option("--limit", type=int, default=100, help="at most this many per pipeline")
def dlq_reconcile(limit: int) -> None:
    """Dead-letter (and alert) every entity failed for good without a dead letter, as the
    redrive_dead_letter_reconciliation sensor does every 5 minutes."""
    from orchestration.registry import load_pipelines  # the command is an edge: it may load the pipelines
    from redrive.db import engine_for
    from redrive.reconcile import reconcile
    from redrive.reliability import Reliability
    from redrive.settings import Settings
    from resources.factory import notifier_from

    settings = Settings()
    sources = {k: v for p in load_pipelines(settings) for k, v in p.failed_for_good.items()}
    with database_url() as url:
        runtime = Reliability(engine=engine_for(url),
                              channels=notifier_from(settings).channels(),
                              burst_window=settings.alert_burst_window_seconds)
        repaired = reconcile(runtime, sources, limit=limit)
    for r in repaired:
        click.echo(f"{r.pipeline} {r.entity_ref}: dead letter {r.dead_letter_id} written")
    click.echo(f"{len(repaired)} repaired ({', '.join(sources)} checked)")


@app.command("rehearse")
@click.argument("recipes", nargs=-1)
@click.option("--timeout", type=float, default=180.0, help="seconds to wait for each armed failure to happen")
def rehearse(recipes: tuple[str, ...], timeout: float) -> None:
    """Arm a failure to practise a runbook on, on a running `make serve`: `redrive rehearse list`, then
    `eval "$(redrive rehearse RECIPE)"` sets the runbook's shell variables ($LETTER, …)."""
    from orchestration import rehearse as r

    if not recipes or list(recipes) == ["list"]:
        width = max(len(x.name) for x in r.RECIPES)
        for x in r.RECIPES:
            click.echo(f"{x.name:<{width}}  {x.fault}; for: {'; '.join(x.sections)}")
        return
    try:
        names = list(recipes)
        for name in names if names != ["all"] else []:
            r.recipe(name)  # an unknown name fails before anything is seeded
        click.echo(f"rehearse: arming {', '.join(names)} and waiting for the stack to meet it …", err=True)
        values = r.arm(names, r.stack_env(), timeout=timeout)
    except r.RehearsalError as refused:
        fail(str(refused))
    click.echo(r.exports(values))
    click.echo("rehearse: done; the runbooks of docs/operating.md can now be followed as written", err=True)


@app.command("breaker")
@click.option("--window", type=int, default=20, help="calls in the window (the guarded pipeline's CIRCUIT_WINDOW)")
@json_option
def breaker_status(window: int, as_json: bool) -> None:
    """Each circuit breaker: open or closed, since when, last probe, failures in its window."""
    from redrive import breaker
    from redrive.clock import SystemClock

    now = SystemClock().now()
    with connection() as conn:
        rows = [(s, breaker.window(conn, s.name, s.window_floor, window)) for s in breaker.all_states(conn)]
    out = [{"name": s.name, "state": s.state, "opened_at": s.opened_at, "last_probe_at": s.last_probe_at,
            "open_count": s.open_count, "open_seconds": round(s.open_seconds(now), 1),
            "window_calls": len(calls), "window_failures": calls.count(False)} for s, calls in rows]
    if as_json:
        click.echo(json.dumps(out, default=str, indent=2))
        return
    if not out:
        click.echo("no breaker has recorded a call yet")
    for b in out:
        since = f" since {b['opened_at']:%Y-%m-%d %H:%M:%S}" if b["state"] == "open" else ""
        probe = f", last probe {b['last_probe_at']:%H:%M:%S}" if b["last_probe_at"] else ""
        click.echo(f"{b['name']}: {b['state']}{since}{probe}; {b['window_failures']} of the last "
                   f"{b['window_calls']} calls failed; opened {b['open_count']} times, {b['open_seconds']} s open")


@alerts_app.command("dispatch")
def alerts_dispatch() -> None:
    """Send pending alerts now (the alert sensor does this every 30 s)."""
    from redrive.db import engine_for
    from redrive.reliability import Reliability
    from redrive.settings import Settings
    from resources.factory import notifier_from

    settings = Settings()
    with database_url() as url:
        runtime = Reliability(engine=engine_for(url),
                              channels=notifier_from(settings).channels(),
                              burst_window=settings.alert_burst_window_seconds)
        report = runtime.try_dispatch()
    click.echo(f"{report}" if report else "no channel configured")


@db.command("upgrade")
def db_upgrade() -> None:
    """alembic upgrade head; with DAGSTER_PG_URL set, Dagster's tables too where they are missing."""
    from orchestration.storage import prepare_dagster_storage
    from redrive.db import upgrade_head

    with database_url() as url:
        upgrade_head(url)
    click.echo("schema at head")
    if os.environ.get("DAGSTER_PG_URL"):
        prepare_dagster_storage(os.environ["DAGSTER_PG_URL"])
        click.echo("Dagster's storage ready")


@db.command("downgrade")
@click.option("--yes", is_flag=True, help="really drop every redrive table")
def db_downgrade(yes: bool) -> None:
    """alembic downgrade base (drops redrive's tables)."""
    if not yes:
        fail("this drops every redrive table; pass --yes")
    from redrive.db import downgrade_base

    with database_url() as url:
        downgrade_base(url)
    click.echo("schema at base")


@metrics_app.command("serve")
@click.option("--host", default="127.0.0.1", help="address to listen on")
@click.option("--port", type=int, default=9108, help="port of /metrics")
def metrics_serve(host: str, port: int) -> None:
    """Serve /metrics for Prometheus until SIGTERM: every pipeline's series, read from PostgreSQL per scrape."""
    from orchestration.metrics import serve
    from redrive import logs
    from redrive.clock import SystemClock
    from redrive.db import engine_for

    with database_url() as url:
        click.echo(logs.line(f"serving http://{host}:{port}/metrics"), err=True)
        serve(engine_for(url), SystemClock(), host, port)


@retention_app.command("plan")
@json_option
def retention_plan(as_json: bool) -> None:
    """What `retention run` would remove now, rule by rule (changes nothing)."""
    from orchestration.registry import retention_rules
    from redrive import retention
    from redrive.clock import SystemClock
    from redrive.db import engine_for
    from redrive.settings import Settings

    settings = Settings()
    with database_url() as url:
        planned = retention.plan(engine_for(url), retention_rules(settings), settings, SystemClock().now())
    out = [{"rule": p.rule.name, "action": p.rule.action, "kept_days": p.days, "setting": p.rule.keep.upper(),
            "rows": p.rows, "oldest": p.oldest, "what": p.rule.what} for p in planned]
    if as_json:
        click.echo(json.dumps(out, default=str, indent=2))
        return
    for p in out:
        kept = "for ever" if p["kept_days"] <= 0 else f"{p['kept_days']:g} days"
        oldest = f", oldest {p['oldest']:%Y-%m-%d %H:%M}" if p["oldest"] else ""
        click.echo(f"{p['rule']}: {p['action']} {p['rows']} rows{oldest} (kept {kept}, {p['setting']}): {p['what']}")
    click.echo(f"{sum(p['rows'] for p in out)} rows would go; open, due, leased, retrying or dead-lettered work never")


@retention_app.command("run")
@click.option("--batch-size", type=int, default=None, help="rows per batch (RETENTION_BATCH_SIZE)")
@click.option("--pause", type=float, default=None, help="seconds between batches (RETENTION_PAUSE_SECONDS)")
def retention_run(batch_size: int | None, pause: float | None) -> None:
    """Remove what has expired now (the hourly `retention_schedule` does this too; Dagster runs excepted)."""
    from orchestration.registry import retention_rules
    from redrive import retention
    from redrive.clock import SystemClock
    from redrive.db import engine_for
    from redrive.settings import Settings

    settings = Settings()
    with database_url() as url:
        pruned = retention.prune(engine_for(url), retention_rules(settings), settings, SystemClock().now(),
                                 batch_size=batch_size or settings.retention_batch_size,
                                 pause_seconds=settings.retention_pause_seconds if pause is None else pause,
                                 max_seconds=settings.retention_max_run_seconds)
    for rule, n in pruned.rows.items():
        if n:
            click.echo(f"{rule}: {n} rows")
    click.echo(f"{pruned.total} rows in {pruned.batches} batches, {pruned.files} files"
               + ("" if pruned.complete else "; stopped at RETENTION_MAX_RUN_SECONDS, run again to go on"))


@console_app.command("token")
@click.argument("operator")
def console_token(operator: str) -> None:
    """A new operator token for OPERATOR (shown once; only its hash is stored)."""
    from redrive import operators

    with connection() as conn:
        click.echo(operators.create_token(conn, operator))


@console_app.command("serve")
@click.option("--host", default="127.0.0.1", help="address to listen on")
@click.option("--port", type=int, default=8095, help="port of the page and its API")
def console_serve(host: str, port: int) -> None:
    """Serve the dead-letter console until SIGTERM (the Dagster run links use DAGSTER_UI_URL)."""
    import uvicorn

    from orchestration.console import create_app
    from redrive import logs
    from redrive.db import engine_for
    from redrive.settings import Settings

    with database_url() as url:
        click.echo(logs.line(f"serving the dead-letter console on http://{host}:{port}/"), err=True)
        uvicorn.run(create_app(engine_for(url), ui_url=Settings().dagster_ui_url), host=host, port=port,
                    log_config=None, access_log=False)


def main() -> None:  # pragma: no cover - console entry
    from redrive import logs

    logs.configure(default_level="WARNING", only_if_set=True)
    try:
        app()
    except Exception as exc:  # noqa: BLE001 - one canonical line for operators, never a stack trace
        from redrive.failures import classify_exception

        failure = classify_exception(exc)
        click.echo(f"error: {failure.code}: {failure.message}", err=True)
        sys.exit(1)
