"""Retention: what each kind of row (and file) is kept for, and the one pruner that removes what expired.

A deployment runs for months; without this everything it writes stays forever (issue 28). Each
kind of row is a :class:`Rule`: its table, when a row of it *finished* (a SQL predicate that is
false for anything open, due, leased or retrying), how old that makes it, the setting that says
how long it is kept, and what goes with it (files, or personal fields cleared where the record
itself is kept longer: an idempotency key, an audit trail). The core keeps the rules of its own
tables here; a pipeline declares its own in its repository (`retention_rules`, named by its entry
in `orchestration/registry.py`), and this module is the only pruning loop (Oban's Pruner, River's
cleaner, procrastinate's `remove_old_jobs` — a loop written once).

Guarantees, whatever a rule says:
- an entity with an unresolved dead letter, an open work row (due or leased) or a waiting durable
  timer is never touched (the core adds that guard to every rule naming its entity);
- rows are removed in batches of ``batch_size`` (one short transaction each, `FOR UPDATE SKIP
  LOCKED`: a batch never waits for a worker's lock, and no worker waits on a finished row), with a
  pause between batches, oldest first, through a partial index on the rule's age (migrations 0021,
  0121, 0221, 0321, 0421, 0521, 0621);
- a row's files are removed inside its batch's transaction, after the row is locked and before
  the row is deleted: killed mid-batch, the transaction rolls back and the expired row is still
  there, its files maybe already gone, and the next run finishes it — nothing that should stay is
  lost, and running twice is the same as running once;
- counters (:mod:`redrive.counters`, stage observations) are never pruned: metrics do not go back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

import sqlalchemy as sa

log = logging.getLogger(__name__)


class Windows(Protocol):
    """How long each kind of row is kept, in days (a `redrive.settings.Settings`); 0 or less: for ever."""

    def __getattr__(self, name: str) -> Any: ...


@dataclass(frozen=True)
class Entity:
    """How a row names its entity to the core (dead letters, work rows, durable timers).

    ``ref`` is a SQL expression over the row (alias ``t``). With ``separator`` the row stands for a
    whole family of entities (an evidence file job and its rows `<job>/<row>`): any of them open
    keeps the row."""

    pipeline: str
    ref: str
    separator: str | None = None


@dataclass(frozen=True)
class Rule:
    """One kind of row and how long it is kept after it finished."""

    name: str  # `<pipeline or core>.<what>`, as `redrive retention plan` lists it
    table: str
    key: tuple[str, ...]  # its primary key's columns
    keep: str  # the Settings field with its window in days
    age: str  # SQL over `t`: when the row finished (the window counts from here)
    finished: str  # SQL over `t`: true only for rows nothing will work on again
    what: str  # one line for the docs table and the plan: what goes, what stays
    entity: Entity | None = None
    # column → SQL value: clear these (personal data) and keep the row; `finished` must exclude cleared rows
    scrub: Mapping[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = ()  # columns naming the row's files, handed to `remove`
    remove: Callable[[Sequence[Mapping[str, Any]]], None] | None = None
    # (table, column naming this row's first key column): rows without a cascading foreign key that go
    # in the same statement, in this order (an evidence file job's artifacts, rows and outbox events)
    children: tuple[tuple[str, str], ...] = ()

    @property
    def action(self) -> str:
        return "clear " + ", ".join(self.scrub) if self.scrub else "delete"


def _guard(entity: Entity | None) -> str:
    """The core's promise on every rule: nothing of an entity that is still owed anything."""
    if entity is None:
        return ""

    def matches(alias: str) -> str:
        if entity.separator is None:
            return f"{alias}.entity_ref = ({entity.ref})"
        return (f"({alias}.entity_ref = ({entity.ref}) OR "
                f"starts_with({alias}.entity_ref, ({entity.ref}) || '{entity.separator}'))")

    return (
        f" AND NOT EXISTS (SELECT 1 FROM dead_letters AS d WHERE d.pipeline = :pipeline AND d.status <> 'resolved'"
        f" AND {matches('d')})"
        f" AND NOT EXISTS (SELECT 1 FROM work_items AS w WHERE w.pipeline = :pipeline"
        f" AND w.status IN ('due', 'leased') AND {matches('w')})"
        f" AND NOT EXISTS (SELECT 1 FROM deferred_attempts AS x WHERE x.pipeline = :pipeline"
        f" AND x.status = 'waiting' AND {matches('x')})"
    )


def _expired(rule: Rule) -> str:
    return f"FROM {rule.table} AS t WHERE ({rule.finished}) AND ({rule.age}) < :cutoff{_guard(rule.entity)}"


def batch_sql(rule: Rule) -> str:
    """One batch: lock the oldest expired rows (skipping locked ones), then delete or clear them."""
    columns = list(dict.fromkeys([*rule.key, *rule.files]))
    match = " AND ".join(f"t.{k} = doomed.{k}" for k in rule.key)
    returning = ", ".join(f"doomed.{c}" for c in columns)  # the values before a scrub cleared them
    doomed = (f"WITH doomed AS (SELECT {', '.join(f't.{c}' for c in columns)} {_expired(rule)} "
              f"ORDER BY ({rule.age}) LIMIT :batch FOR UPDATE OF t SKIP LOCKED)")
    if rule.scrub:
        sets = ", ".join(f"{column} = {value}" for column, value in rule.scrub.items())
        return f"{doomed} UPDATE {rule.table} AS t SET {sets} FROM doomed WHERE {match} RETURNING {returning}"
    # children first, in CTEs of the same statement (foreign keys are checked at its end)
    children = "".join(f", child_{n} AS (DELETE FROM {table} AS c USING doomed WHERE c.{column} = doomed.{rule.key[0]})"
                       for n, (table, column) in enumerate(rule.children))
    return f"{doomed}{children} DELETE FROM {rule.table} AS t USING doomed WHERE {match} RETURNING {returning}"


def cutoff(rule: Rule, windows: Windows, now: datetime) -> datetime | None:
    """When a row of this rule must have finished before to go now; None when the rule keeps for ever."""
    days = float(getattr(windows, rule.keep))
    return None if days <= 0 else now - timedelta(days=days)


def _params(rule: Rule, at: datetime, now: datetime, **extra: Any) -> dict[str, Any]:
    return {"cutoff": at, "now": now, "pipeline": rule.entity.pipeline if rule.entity else None, **extra}


@dataclass(frozen=True)
class Planned:
    rule: Rule
    days: float
    rows: int
    oldest: datetime | None


def plan(engine: sa.Engine, rules: Sequence[Rule], windows: Windows, now: datetime) -> list[Planned]:
    """What a run would remove now, rule by rule (`redrive retention plan`); changes nothing."""
    out = []
    with engine.connect() as conn:
        for rule in rules:
            at = cutoff(rule, windows, now)
            days = float(getattr(windows, rule.keep))
            if at is None:
                out.append(Planned(rule, days, 0, None))
                continue
            n, oldest = conn.execute(sa.text(f"SELECT count(*), min({rule.age}) {_expired(rule)}"),
                                     _params(rule, at, now)).one()
            out.append(Planned(rule, days, int(n), oldest))
    return out


@dataclass
class Pruned:
    rows: dict[str, int] = field(default_factory=dict)  # rule name → rows deleted or cleared
    batches: int = 0
    files: int = 0
    complete: bool = True  # False when the run stopped at its time limit with work left

    @property
    def total(self) -> int:
        return sum(self.rows.values())


def prune(engine: sa.Engine, rules: Sequence[Rule], windows: Windows, now: datetime, *, batch_size: int = 1000,
          pause_seconds: float = 0.1, max_seconds: float | None = None, sleep: Callable[[float], None] = time.sleep,
          monotonic: Callable[[], float] = time.monotonic) -> Pruned:
    """Remove what has expired, rule by rule in the order given (children before their parents), in
    batches with a pause between; stops early (``complete`` False) once ``max_seconds`` have passed."""
    out = Pruned()
    started = monotonic()
    for rule in rules:
        at = cutoff(rule, windows, now)
        out.rows.setdefault(rule.name, 0)
        if at is None:
            continue
        statement = sa.text(batch_sql(rule))
        while True:
            if max_seconds is not None and monotonic() - started > max_seconds:
                out.complete = False
                return out
            with engine.begin() as conn:
                # never queue behind a lock for long (a foreign key's row held by a worker): the batch
                # fails, rolls back, and the next run takes it
                conn.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
                rows = [dict(r._mapping) for r in conn.execute(statement, _params(rule, at, now, batch=batch_size))]
                if rows and rule.remove is not None:
                    rule.remove(rows)  # inside the transaction: a failure here keeps the rows
                    out.files += sum(1 for r in rows for c in rule.files if r.get(c))
            if not rows:
                break
            out.rows[rule.name] += len(rows)
            out.batches += 1
            if len(rows) < batch_size:
                break
            sleep(pause_seconds)
    return out


# ------------------------------------------------------------------------------------- the core's rules

FINISHED_WORK = "retention_finished_work_days"
RESOLVED_DEAD_LETTERS = "retention_resolved_dead_letter_days"
ALERTS = "retention_alert_days"
HEALTHCHECKS = "retention_healthcheck_days"

CORE_RULES: tuple[Rule, ...] = (
    Rule("core.work_items", "work_items", ("id",), FINISHED_WORK, "t.updated_at",
         "t.status IN ('done', 'dead') AND NOT EXISTS (SELECT 1 FROM dead_letters AS d WHERE d.pipeline = t.pipeline "
         "AND d.entity_ref = t.entity_ref AND d.status <> 'resolved')",
         "work-queue rows done, or dead with their dead letter resolved"),
    Rule("core.stage_checkpoints", "stage_checkpoints", ("pipeline", "entity_ref", "stage"), FINISHED_WORK,
         "t.completed_at",
         "NOT EXISTS (SELECT 1 FROM dead_letters AS d WHERE d.pipeline = t.pipeline AND d.entity_ref = t.entity_ref "
         "AND d.status <> 'resolved') AND NOT EXISTS (SELECT 1 FROM work_items AS w WHERE w.pipeline = t.pipeline "
         "AND w.entity_ref = t.entity_ref AND w.status IN ('due', 'leased')) AND NOT EXISTS (SELECT 1 FROM "
         "deferred_attempts AS x WHERE x.pipeline = t.pipeline AND x.entity_ref = t.entity_ref AND x.status = 'waiting')",
         "stage outputs kept for a replay, once their entity has nothing open"),
    Rule("core.deferred_attempts", "deferred_attempts", ("id",), FINISHED_WORK, "t.due_at",
         "t.status <> 'waiting'", "durable retry timers already started or cancelled"),
    Rule("core.dead_letters", "dead_letters", ("id",), RESOLVED_DEAD_LETTERS, "t.resolved_at",
         "t.status = 'resolved'", "resolved dead letters (an unresolved one is kept for ever)"),
    Rule("core.alerts", "alerts", ("id",), ALERTS, "t.created_at",
         "NOT EXISTS (SELECT 1 FROM alert_deliveries AS a WHERE a.alert_id = t.id AND a.status = 'pending')",
         "alerts and their deliveries, once none is pending"),
    Rule("core.healthchecks", "healthchecks", ("run_key",), HEALTHCHECKS, "t.checked_at", "true",
         "the smoke job's traces"),
)


def all_rules(pipeline_rules: Iterable[Rule]) -> list[Rule]:
    """Pipelines' rules first (their rows may name core rows, never the reverse), then the core's."""
    return [*pipeline_rules, *CORE_RULES]
