"""All SQL of the core's work queue (`work_items`): enqueue, claim, extend, settle, replay.

One row per entity of a drained pipeline. The row's `due_at` is when it may be worked
next: a retry moves it forward, a lease moves it to the lease's end, so a claim is one
index range (`status IN (due, leased) AND due_at <= now`) and a holder that died simply
lets its rows fall due again. Every write by a holder names the `lease_epoch` it claimed
with; a write after the row was reclaimed changes nothing and returns False.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, insert

from redrive.liveness import holder_alive
from redrive.schema import TZ, work_items

DUE, LEASED, DONE, DEAD = "due", "leased", "done", "dead"
OPEN_STATUSES = (DUE, LEASED)


@dataclass(frozen=True)
class WorkItem:
    id: int
    pipeline: str
    entity_ref: str
    group_key: str | None
    stage: str | None
    attempts: Mapping[str, int]
    payload: Mapping[str, Any]
    lease_epoch: int
    due_at: datetime

    @classmethod
    def from_row(cls, row: sa.Row[Any]) -> WorkItem:
        return cls(row.id, row.pipeline, row.entity_ref, row.group_key, row.stage, dict(row.attempts or {}),
                   dict(row.payload or {}), row.lease_epoch, row.due_at)


def enqueue(conn: sa.Connection, pipeline: str, entity_ref: str, *, now: datetime, group_key: str | None = None,
            payload: Mapping[str, Any] | None = None, reopen: bool = False) -> bool:
    """Make the entity's work due now; idempotent per entity. True if a row was added or reopened.

    `reopen` starts finished work again with fresh budgets (a versioned rerun): done or dead rows
    become due; an open row is left as it is, so a duplicate request never doubles the work.
    """
    stmt = insert(work_items).values(pipeline=pipeline, entity_ref=entity_ref, group_key=group_key, status=DUE,
                                     due_at=now, payload=dict(payload or {}))
    if reopen:
        stmt = stmt.on_conflict_do_update(
            index_elements=["pipeline", "entity_ref"],
            set_={"status": DUE, "due_at": now, "attempts": sa.text("'{}'::jsonb"), "stage": None,
                  "payload": stmt.excluded.payload, "last_error": None, "updated_at": now},
            where=work_items.c.status.in_((DONE, DEAD)),
        )
    else:
        stmt = stmt.on_conflict_do_nothing(index_elements=["pipeline", "entity_ref"])
    return conn.execute(stmt.returning(work_items.c.id)).first() is not None


def enqueue_many(conn: sa.Connection, pipeline: str, entities: Sequence[tuple[str, str | None]], *,
                 now: datetime) -> int:
    """`enqueue` for many entities in one statement (a file job's rows at ingest); rows already there stay."""
    if not entities:
        return 0
    rows = [{"pipeline": pipeline, "entity_ref": ref, "group_key": group, "status": DUE, "due_at": now, "payload": {}}
            for ref, group in entities]
    stmt = insert(work_items).on_conflict_do_nothing(index_elements=["pipeline", "entity_ref"])
    return len(conn.execute(stmt.returning(work_items.c.id), rows).all())


def claim(conn: sa.Connection, pipeline: str, *, owner: str, limit: int, lease_seconds: float, now: datetime,
          group_key: str | None = None) -> list[WorkItem]:
    """Lease up to `limit` due rows (oldest due first), skipping rows another holder is claiming.
    A holder the watchdog declared dead claims nothing (`redrive.liveness`)."""
    rows = conn.execute(_CLAIM_GROUP if group_key is not None else _CLAIM, {
        "claim_pipeline": pipeline, "claim_owner": owner, "claim_limit": limit, "claim_now": now,
        "claim_group": group_key, "lease_end": now + timedelta(seconds=lease_seconds)})
    return sorted((WorkItem.from_row(r) for r in rows), key=lambda i: i.id)


def _claim_statement(*, grouped: bool) -> sa.Update:
    picked = sa.select(work_items.c.id).where(
        holder_alive(sa.bindparam("claim_owner", type_=sa.Text)),
        work_items.c.pipeline == sa.bindparam("claim_pipeline", type_=sa.Text),
        work_items.c.status.in_(OPEN_STATUSES),
        work_items.c.due_at <= sa.bindparam("claim_now", type_=TZ),
    )
    if grouped:
        picked = picked.where(work_items.c.group_key == sa.bindparam("claim_group", type_=sa.Text))
    picked = picked.order_by(work_items.c.due_at).limit(sa.bindparam("claim_limit", type_=sa.Integer)) \
        .with_for_update(skip_locked=True).cte("picked")
    return (sa.update(work_items)
            .where(work_items.c.id == picked.c.id)
            .values(status=LEASED, lease_owner=sa.bindparam("claim_owner", type_=sa.Text),
                    lease_epoch=work_items.c.lease_epoch + 1, due_at=sa.bindparam("lease_end", type_=TZ),
                    updated_at=sa.bindparam("claim_now", type_=TZ))
            .returning(*work_items.c))


# The statements a holder runs for every entity are built once, with bound parameters: building one and its cache
# key at every call cost the drain more CPU than PostgreSQL's executing it (issue 26: CPU an entity).
_CLAIM, _CLAIM_GROUP = _claim_statement(grouped=False), _claim_statement(grouped=True)


def _fence(row_id: Any, epoch: Any) -> sa.ColumnElement[bool]:
    """Still ours: the epoch we claimed with, still leased, and our holder not declared dead (issue 25)."""
    return sa.and_(work_items.c.id == row_id, work_items.c.lease_epoch == epoch,
                   work_items.c.status == LEASED, holder_alive(work_items.c.lease_owner))


def _held(item: WorkItem) -> sa.ColumnElement[bool]:
    return _fence(item.id, item.lease_epoch)


def _settlement(**values: Any) -> sa.Update:
    """A held row's settlement (the fence's id and epoch bound at each call), built once: `_settle` runs it."""
    held = _fence(sa.bindparam("held_id", type_=sa.BigInteger), sa.bindparam("held_epoch", type_=sa.BigInteger))
    return sa.update(work_items).where(held).values(lease_owner=None, updated_at=sa.bindparam("settled_at", type_=TZ),
                                                    **values)


def _settle(conn: sa.Connection, statement: sa.Update, item: WorkItem, now: datetime, **params: Any) -> bool:
    """True if the row was still ours and is settled; False if its lease was taken (fencing)."""
    return conn.execute(statement, {"held_id": item.id, "held_epoch": item.lease_epoch, "settled_at": now,
                                    **params}).rowcount == 1


_NEW_ATTEMPTS = sa.bindparam("new_attempts", type_=JSONB)
_NEW_PAYLOAD = sa.bindparam("new_payload", type_=JSONB)
_NEW_STAGE = sa.bindparam("new_stage", type_=sa.Text)
_NEW_ERROR = sa.bindparam("new_error", type_=sa.Text)
_NEW_DUE_AT = sa.bindparam("new_due_at", type_=TZ)
_COMPLETE = _settlement(status=DONE, stage=None, attempts=_NEW_ATTEMPTS, payload={}, last_error=None)
_RESCHEDULE = _settlement(status=DUE, due_at=_NEW_DUE_AT, stage=_NEW_STAGE, attempts=_NEW_ATTEMPTS,
                          last_error=_NEW_ERROR, payload=_NEW_PAYLOAD)
_DEFER = _settlement(status=DUE, due_at=_NEW_DUE_AT, attempts=_NEW_ATTEMPTS, payload=_NEW_PAYLOAD)
_BURY = _settlement(status=DEAD, stage=_NEW_STAGE, attempts=_NEW_ATTEMPTS, last_error=_NEW_ERROR, payload={})


def extend(conn: sa.Connection, items: Sequence[WorkItem], *, lease_seconds: float, now: datetime) -> int:
    """Push the leases of rows still held forward; the count still held."""
    if not items:
        return 0
    held = sa.or_(*[_held(i) for i in items])
    return conn.execute(sa.update(work_items).where(held)
                        .values(due_at=now + timedelta(seconds=lease_seconds), updated_at=now)).rowcount


def complete(conn: sa.Connection, item: WorkItem, *, now: datetime,
             attempts: Mapping[str, int] | None = None) -> bool:
    return _settle(conn, _COMPLETE, item, now, new_attempts=dict(attempts if attempts is not None else item.attempts))


def reschedule(conn: sa.Connection, item: WorkItem, *, due_at: datetime, stage: str, attempts: Mapping[str, int],
               error: str, now: datetime) -> bool:
    """The next attempt is a row falling due, not a run (the seeds' schedules live here)."""
    return _settle(conn, _RESCHEDULE, item, now, new_due_at=due_at, new_stage=stage, new_attempts=dict(attempts),
                   new_error=error[:500], new_payload=_without_replay_start(item.payload))


def defer(conn: sa.Connection, item: WorkItem, *, due_at: datetime, attempts: Mapping[str, int],
          now: datetime) -> bool:
    """Not finished, not failed: the entity has more work on its own schedule (evidence: artifacts whose
    next retry falls due later), so the row falls due then; no failure is recorded."""
    return _settle(conn, _DEFER, item, now, new_due_at=due_at, new_attempts=dict(attempts),
                   new_payload=_without_replay_start(item.payload))


def poke(conn: sa.Connection, pipeline: str, entity_refs: Sequence[str], *, now: datetime) -> int:
    """Make these entities' waiting rows due now (work outside the drain changed what they wait for).
    Leased rows are left to their holder; finished rows stay finished."""
    if not entity_refs:
        return 0
    return conn.execute(sa.update(work_items).where(
        work_items.c.pipeline == pipeline, work_items.c.entity_ref.in_(list(entity_refs)),
        work_items.c.status == DUE, work_items.c.due_at > now).values(due_at=now, updated_at=now)).rowcount


def bury(conn: sa.Connection, item: WorkItem, *, stage: str, attempts: Mapping[str, int], error: str,
         now: datetime) -> bool:
    """Dead: the dead letter (written in the same transaction) is now the entity's record."""
    return _settle(conn, _BURY, item, now, new_stage=stage, new_attempts=dict(attempts), new_error=error[:500])


def record_dead(conn: sa.Connection, pipeline: str, entity_ref: str, *, stage: str, attempts: Mapping[str, int],
                error: str, now: datetime, group_key: str | None = None) -> bool:
    """A part of another entity's work died for good (one recipient of a review job, with a dead letter
    of its own): give it a dead row, so `replay` of that letter makes it due like any drained entity.

    Written in the dead letter's transaction. An open row (being worked or due) is left alone.
    """
    stmt = insert(work_items).values(pipeline=pipeline, entity_ref=entity_ref, group_key=group_key, status=DEAD,
                                     due_at=now, stage=stage, attempts=dict(attempts), last_error=error[:500])
    stmt = stmt.on_conflict_do_update(
        index_elements=["pipeline", "entity_ref"],
        set_={"status": DEAD, "stage": stage, "attempts": stmt.excluded.attempts, "payload": sa.text("'{}'::jsonb"),
              "last_error": stmt.excluded.last_error, "lease_owner": None, "updated_at": now},
        where=work_items.c.status.in_((DONE, DEAD)),
    )
    return conn.execute(stmt.returning(work_items.c.id)).first() is not None


def release(conn: sa.Connection, items: Sequence[WorkItem], *, now: datetime) -> int:
    """Give unstarted rows back at once (a run stopping early), due now, attempts untouched."""
    if not items:
        return 0
    return conn.execute(sa.update(work_items).where(sa.or_(*[_held(i) for i in items]))
                        .values(status=DUE, due_at=now, lease_owner=None, updated_at=now)).rowcount


def release_owner(conn: sa.Connection, owner: str, *, now: datetime) -> int:
    """Everything a dead run still leases, due now (its process is gone: no need to wait out the lease).

    Attempts stay as they are; the fencing check (`_held`) refuses a settlement of the old lease.
    """
    return conn.execute(sa.update(work_items).where(work_items.c.lease_owner == owner,
                                                    work_items.c.status == LEASED)
                        .values(status=DUE, due_at=now, lease_owner=None, updated_at=now)).rowcount


def replay(conn: sa.Connection, pipeline: str, entity_ref: str, *, dead_letter_id: int, from_start: bool,
           now: datetime) -> bool:
    """A dead letter's replay makes its row due again with fresh budgets. False: not a drained entity."""
    payload = {"replay_of": dead_letter_id, "replay_from": "start" if from_start else "failed_stage"}
    return conn.execute(
        sa.update(work_items)
        .where(work_items.c.pipeline == pipeline, work_items.c.entity_ref == entity_ref)
        # fresh budgets from the failed stage on (completed stages keep their counts: their checkpoints
        # are reused); a full restart starts every stage over
        .values(status=DUE, due_at=now, lease_owner=None,
                attempts=sa.text("'{}'::jsonb") if from_start else
                work_items.c.attempts.op("-")(sa.func.coalesce(work_items.c.stage, "")),
                payload=work_items.c.payload.op("||")(sa.cast(payload, JSONB)), updated_at=now)
    ).rowcount == 1


def _without_replay_start(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A full restart clears checkpoints once, on its first attempt; later retries keep new ones."""
    return {k: v for k, v in payload.items() if not (k == "replay_from" and v == "start")}


@dataclass(frozen=True)
class State:
    """An entity's scheduling state as an operator reads it (`redrive <pipeline> show`)."""

    status: str
    due_at: datetime
    stage: str | None
    attempts: Mapping[str, int]
    last_error: str | None
    lease_owner: str | None
    updated_at: datetime


def state(conn: sa.Connection, pipeline: str, entity_ref: str) -> State | None:
    row = conn.execute(sa.select(work_items).where(work_items.c.pipeline == pipeline,
                                                   work_items.c.entity_ref == entity_ref)).first()
    if row is None:
        return None
    return State(row.status, row.due_at, row.stage, dict(row.attempts or {}), row.last_error, row.lease_owner,
                 row.updated_at)


def has_item(conn: sa.Connection, pipeline: str, entity_ref: str) -> bool:
    return conn.execute(sa.select(work_items.c.id).where(
        work_items.c.pipeline == pipeline, work_items.c.entity_ref == entity_ref)).first() is not None


@dataclass(frozen=True)
class Backlog:
    due: int  # due now (including expired leases)
    leased: int  # held by a live lease
    next_due_at: datetime | None  # the earliest open row's due time


def backlog(conn: sa.Connection, pipeline: str, now: datetime, *, group_key: str | None = None) -> Backlog:
    q = sa.select(
        sa.func.count().filter(work_items.c.due_at <= now),
        sa.func.count().filter(sa.and_(work_items.c.status == LEASED, work_items.c.due_at > now)),
        sa.func.min(work_items.c.due_at),
    ).where(work_items.c.pipeline == pipeline, work_items.c.status.in_(OPEN_STATUSES))
    if group_key is not None:
        q = q.where(work_items.c.group_key == group_key)
    due, leased, next_due = conn.execute(q).one()
    return Backlog(due, leased, next_due)


def due_groups(conn: sa.Connection, pipeline: str, now: datetime, *, limit: int = 100) -> list[tuple[str, int]]:
    """Groups (e.g. evidence file jobs) with due rows, and how many, oldest due first."""
    rows = conn.execute(
        sa.select(work_items.c.group_key, sa.func.count(), sa.func.min(work_items.c.due_at).label("first"))
        .where(work_items.c.pipeline == pipeline, work_items.c.status.in_(OPEN_STATUSES),
               work_items.c.due_at <= now, work_items.c.group_key.is_not(None))
        .group_by(work_items.c.group_key).order_by(sa.text("first")).limit(limit)
    )
    return [(r.group_key, r.count) for r in rows]


def counts(conn: sa.Connection, pipeline: str | None = None) -> dict[str, int]:
    """Rows per status, for status commands and metrics."""
    q = sa.select(work_items.c.status, sa.func.count()).group_by(work_items.c.status)
    if pipeline:
        q = q.where(work_items.c.pipeline == pipeline)
    return {status: n for status, n in conn.execute(q)}
