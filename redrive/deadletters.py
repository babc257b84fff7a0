"""Dead letters: one table and one API for every pipeline (002 §8.4, §8.5).

A dead letter is the final state of an entity's failed work, not a log line: one
active row per (pipeline, entity), enforced by a partial unique index, so the same
final failure recorded twice (a re-executed op, two workers) stays one row. What
goes in is sanitized here, at the only door, so no caller can forget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, insert

from redrive.sanitize import sanitize_context, sanitize_text
from redrive import work
from redrive.schema import dead_letters, work_items

# the record, the filter and the read queries live where a reader needs no SQLAlchemy (`redrive dlq list`)
from redrive.deadletter_reads import ESCALATED, OPEN, REPLAYING, RESOLVED, DeadLetter, Filter
from redrive.deadletter_reads import GET_SQL, LIST_SQL, list_params

if TYPE_CHECKING:  # an annotation only: reading dead letters need not load every client library failures knows
    from redrive.failures import Failure

FROM_FAILED_STAGE, FROM_START = "failed_stage", "start"


class ReplayRefused(Exception):
    """The operator asked for a replay that §8.5 does not allow yet; the message says why."""


@dataclass(frozen=True)
class Recorded:
    """What `record` did: a new dead letter, a repeat of an active one, or an escalation after replay."""

    dead_letter: DeadLetter
    created: bool
    escalated: bool = False
    replay_failed: bool = False


@dataclass(frozen=True)
class FinalFailure:
    pipeline: str
    stage: str
    entity_ref: str
    failure: Failure
    attempts: int
    at: datetime
    tenant: str | None = None
    stack: str = ""
    context: Mapping[str, Any] = field(default_factory=dict)
    payload_ref: Mapping[str, Any] = field(default_factory=dict)
    stage_attempts: Mapping[str, int] = field(default_factory=dict)
    run_id: str | None = None


def _note(at: datetime, kind: str, text: str, by: str = "redrive") -> sa.BindParameter[Any]:
    """A one-element JSONB array to append to `notes` (bound as JSON, never spliced into SQL)."""
    return sa.literal([{"at": at.isoformat(), "kind": kind, "by": by, "text": sanitize_text(text)}], JSONB)


def record(conn: sa.Connection, final: FinalFailure) -> Recorded:
    """Record an entity's final failure exactly once.

    New entity → a new `open` row. Active row being replayed → the replay failed:
    the same non-retryable error_class again escalates (§8.5), another class reopens
    it. Active row not being replayed → the same failure reported again: counted,
    not duplicated.
    """
    f = final.failure
    context = sanitize_context(
        {
            **final.context,
            "stage": final.stage,
            "attempts": final.attempts,
            "stage_attempts": dict(final.stage_attempts),
            "upstream_status": f.upstream_status,
            "retry_after": f.retry_after,
        }
    )
    values = {
        "pipeline": final.pipeline,
        "stage": final.stage,
        "entity_ref": final.entity_ref,
        "tenant": final.tenant,
        "error_class": f.code,
        "error_message": sanitize_text(f.message)[:500],
        "retryable": f.retryable,
        "last_stack": sanitize_text(final.stack or f.detail)[:20000],
        "sanitized_context": context,
        "payload_ref": sanitize_context(dict(final.payload_ref)),
        "attempts": final.attempts,
        "stage_attempts": dict(final.stage_attempts),
        "upstream_status": f.upstream_status,
        "first_failure_at": final.at,
        "last_failure_at": final.at,
        "run_id": final.run_id,
    }
    current = _active_row(conn, final.pipeline, final.entity_ref, lock=True)
    if current is None:
        stmt = (
            insert(dead_letters)
            .values(**values, notes=_note(final.at, "dead_lettered", f.code))
            .on_conflict_do_nothing(
                index_elements=["pipeline", "entity_ref"], index_where=sa.text("status <> 'resolved'")
            )
            .returning(*dead_letters.c)
        )
        row = conn.execute(stmt).first()
        if row is not None:
            return Recorded(DeadLetter.from_row(row), created=True)
        # Another transaction recorded it between our SELECT and INSERT: treat as a repeat.
        current = _active_row(conn, final.pipeline, final.entity_ref, lock=True)
        assert current is not None  # the conflicting row is committed and visible now

    was_replaying = current.status == REPLAYING
    escalate = was_replaying and current.error_class == f.code and not f.retryable
    updates: dict[str, Any] = {
        **{k: v for k, v in values.items() if k not in {"first_failure_at", "pipeline", "entity_ref"}},
        "occurrences": dead_letters.c.occurrences + 1,
        "updated_at": sa.func.now(),
    }
    if was_replaying:
        updates["status"] = ESCALATED if escalate else OPEN
        kind = "replay_failed_escalated" if escalate else "replay_failed"
        updates["notes"] = dead_letters.c.notes.op("||")(
            _note(final.at, kind, f"{f.code} at stage {final.stage}")
        )
        if escalate:
            updates["escalated_at"] = final.at
    row = conn.execute(
        sa.update(dead_letters).where(dead_letters.c.id == current.id).values(**updates).returning(*dead_letters.c)
    ).one()
    return Recorded(DeadLetter.from_row(row), created=False, escalated=escalate, replay_failed=was_replaying)


def unrecorded(pipeline: str, entity_ref: sa.ColumnElement[Any],
               failed_at: sa.ColumnElement[Any] | None = None) -> sa.ColumnElement[bool]:
    """SQL: the entity that failed at ``failed_at`` has no dead letter for that failure (any status).

    For a pipeline's "failed for good" query (redrive.reconcile): a letter written for this failure
    or a later one counts, resolved or not, so an operator's resolve is never undone; an older
    letter does not, so a job that failed again after a manual retry is still caught. Without
    ``failed_at`` any letter of the entity counts (for entities that fail for good only once).
    """
    conditions = [dead_letters.c.pipeline == pipeline, dead_letters.c.entity_ref == entity_ref]
    if failed_at is not None:
        conditions.append(dead_letters.c.last_failure_at >= failed_at)
    return ~sa.exists().where(*conditions)


def get(conn: sa.Connection, dead_letter_id: int) -> DeadLetter | None:
    row = conn.exec_driver_sql(GET_SQL, {"id": dead_letter_id}).first()
    return DeadLetter.from_row(row) if row else None


def _active_row(conn: sa.Connection, pipeline: str, entity_ref: str, *, lock: bool = False) -> sa.Row[Any] | None:
    """The entity's one active (not resolved) dead letter, optionally locked for update."""
    q = sa.select(dead_letters).where(
        dead_letters.c.pipeline == pipeline,
        dead_letters.c.entity_ref == entity_ref,
        dead_letters.c.status != RESOLVED,
    )
    return conn.execute(q.with_for_update() if lock else q).first()


def active_for(conn: sa.Connection, pipeline: str, entity_ref: str) -> DeadLetter | None:
    row = _active_row(conn, pipeline, entity_ref)
    return DeadLetter.from_row(row) if row else None


def active_under(conn: sa.Connection, pipeline: str, entity_ref: str) -> list[str]:
    """The entities with an active dead letter that are `entity_ref` or under it (`{entity_ref}:…`), sorted:
    e.g. the users of a matchmaking partition that are not done (issue 27: such a partition is not green)."""
    prefix = f"{entity_ref}:"
    return list(conn.execute(
        sa.select(dead_letters.c.entity_ref).where(
            dead_letters.c.pipeline == pipeline, dead_letters.c.status != RESOLVED,
            sa.or_(dead_letters.c.entity_ref == entity_ref,
                   sa.func.left(dead_letters.c.entity_ref, len(prefix)) == prefix))
        .order_by(dead_letters.c.entity_ref)).scalars())


def list_(conn: sa.Connection, flt: Filter = Filter()) -> list[DeadLetter]:
    """Dead letters by filter, newest failure first (the same query `redrive dlq list` runs on psycopg2)."""
    return [DeadLetter.from_row(r) for r in conn.exec_driver_sql(LIST_SQL, list_params(flt))]


def request_replay(
    conn: sa.Connection,
    dead_letter_id: int,
    *,
    evidence: str | None,
    confirm_safe: bool,
    at: datetime,
    operator: str = "operator",
    from_start: bool = False,
) -> DeadLetter:
    """§8.5 pre-replay validation, then mark for replay; a sensor turns it into a run.

    Refused without remediation evidence or without the operator's statement that
    the replay is idempotent or safe for duplicate effects.
    """
    row = conn.execute(sa.select(dead_letters).where(dead_letters.c.id == dead_letter_id).with_for_update()).first()
    if row is None:
        raise ReplayRefused(f"dead letter {dead_letter_id} does not exist")
    if row.status == RESOLVED:
        raise ReplayRefused(f"dead letter {dead_letter_id} is resolved; nothing to replay")
    if row.status == REPLAYING:
        raise ReplayRefused(f"dead letter {dead_letter_id} is already being replayed")
    if not evidence or not evidence.strip():
        raise ReplayRefused(
            "replay refused: record the remediation evidence first (--note 'ticket/incident and what was fixed')"
        )
    if not confirm_safe:
        raise ReplayRefused("replay refused: confirm the replay is idempotent or safe for duplicate effects (--confirm-safe)")
    note = _note(at, "replay_requested", f"{'full restart' if from_start else 'from ' + row.stage}: {evidence}", operator)
    updated = conn.execute(
        sa.update(dead_letters)
        .where(dead_letters.c.id == dead_letter_id)
        .values(
            status=REPLAYING,
            replay_count=dead_letters.c.replay_count + 1,
            replay_from=FROM_START if from_start else FROM_FAILED_STAGE,
            remediation_evidence=sanitize_text(evidence),
            notes=dead_letters.c.notes.op("||")(sa.cast(note, JSONB)),
            updated_at=sa.func.now(),
        )
        .returning(*dead_letters.c)
    ).one()
    # A drained pipeline's entity replays by its work row falling due (the drain run picks it up,
    # many letters per run); other pipelines' replays are started by the replay sensor.
    work.replay(conn, row.pipeline, row.entity_ref, dead_letter_id=row.id, from_start=from_start, now=at)
    return DeadLetter.from_row(updated)


def replays_pending(conn: sa.Connection, limit: int = 50, started: Mapping[int, int] | None = None) -> list[DeadLetter]:
    """Replays the replay sensor starts as runs: those of entities that have no work row.

    `started` maps letters whose replay run the sensor already requested to that replay's number;
    they are left out while that replay is still the current one, so a backlog of a thousand replays
    is walked through instead of the same first `limit` being listed every tick. A replay requested
    again (its number is higher) comes round again.
    """
    drained = sa.exists().where(work_items.c.pipeline == dead_letters.c.pipeline,
                                work_items.c.entity_ref == dead_letters.c.entity_ref)
    query = sa.select(dead_letters).where(dead_letters.c.status == REPLAYING, ~drained)
    if started:
        pairs = sa.values(sa.column("id", sa.BigInteger), sa.column("replay_count", sa.Integer),
                          name="started").data(list(started.items()))
        query = query.where(~sa.exists().where(pairs.c.id == dead_letters.c.id,
                                              pairs.c.replay_count == dead_letters.c.replay_count))
    rows = conn.execute(query.order_by(dead_letters.c.updated_at, dead_letters.c.id).limit(limit))
    return [DeadLetter.from_row(r) for r in rows]


def reopen_failed_replays(conn: sa.Connection, letter_ids: Sequence[int], *, run_id: str, reason: str,
                          at: datetime) -> list[DeadLetter]:
    """A replay run failed before it could settle its letters (its worker was killed, the database went
    away): the letters it was replaying go back to `open` with a note, so an operator can replay them
    again. Letters the run did settle (resolved, or recorded failed again) are left as they are."""
    if not letter_ids:
        return []
    note = _note(at, "replay_failed", f"replay run {run_id} failed: {reason}")
    rows = conn.execute(
        sa.update(dead_letters)
        .where(dead_letters.c.id.in_(list(letter_ids)), dead_letters.c.status == REPLAYING)
        .values(status=OPEN, notes=dead_letters.c.notes.op("||")(note), updated_at=sa.func.now())
        .returning(*dead_letters.c)
    )
    return [DeadLetter.from_row(r) for r in rows]


def replays_still_current(conn: sa.Connection, started: Mapping[int, int]) -> dict[int, int]:
    """Of the replays a sensor started, those whose letter is still replaying that same replay."""
    if not started:
        return {}
    rows = conn.execute(sa.select(dead_letters.c.id, dead_letters.c.replay_count).where(
        dead_letters.c.id.in_(list(started)), dead_letters.c.status == REPLAYING))
    return {r.id: r.replay_count for r in rows if started.get(r.id) == r.replay_count}


def close_after_success(conn: sa.Connection, pipeline: str, entity_ref: str, at: datetime) -> DeadLetter | None:
    """Post-replay verification: the entity's work completed, so its dead letter is annotated and closed.

    The note says how: `replay_succeeded` when the letter was being replayed, `work_completed` when the work
    completed some other way (an owner's Retry, a rerun of its partition, a later attempt), so the record
    never claims a replay nobody asked for (issue 27)."""
    replayed = _note(at, "replay_succeeded", "work completed after replay")
    other = _note(at, "work_completed", "work completed without a replay (an owner's Retry, a rerun or a later "
                                        "attempt)")
    row = conn.execute(
        sa.update(dead_letters)
        .where(
            dead_letters.c.pipeline == pipeline,
            dead_letters.c.entity_ref == entity_ref,
            dead_letters.c.status != RESOLVED,
        )
        .values(
            status=RESOLVED,
            resolved_at=at,
            notes=dead_letters.c.notes.op("||")(sa.case((dead_letters.c.status == REPLAYING, sa.cast(replayed, JSONB)),
                                                        else_=sa.cast(other, JSONB))),
            updated_at=sa.func.now(),
        )
        .returning(*dead_letters.c)
    ).first()
    return DeadLetter.from_row(row) if row else None


def note_active(conn: sa.Connection, pipeline: str, entity_ref: str, *, kind: str, text: str, at: datetime,
                by: str) -> DeadLetter | None:
    """Append a note to the entity's active dead letter, if it has one (e.g. an owner pressed Retry)."""
    row = conn.execute(
        sa.update(dead_letters)
        .where(dead_letters.c.pipeline == pipeline, dead_letters.c.entity_ref == entity_ref,
               dead_letters.c.status != RESOLVED)
        .values(notes=dead_letters.c.notes.op("||")(sa.cast(_note(at, kind, text, by), JSONB)),
                updated_at=sa.func.now())
        .returning(*dead_letters.c)
    ).first()
    return DeadLetter.from_row(row) if row else None


def is_drained(conn: sa.Connection, pipeline: str, entity_ref: str) -> bool:
    """The entity is a row of the work queue: its replay is that row falling due (a drain run), not a run."""
    return conn.execute(sa.select(sa.exists().where(work_items.c.pipeline == pipeline,
                                                    work_items.c.entity_ref == entity_ref))).scalar_one()


def resolve(conn: sa.Connection, dead_letter_id: int, *, note: str, at: datetime, operator: str = "operator") -> DeadLetter:
    """Close without replay (e.g. the work was redone by hand); the note is required."""
    if not note or not note.strip():
        raise ReplayRefused("resolve refused: say why in --note")
    row = conn.execute(
        sa.update(dead_letters)
        .where(dead_letters.c.id == dead_letter_id, dead_letters.c.status != RESOLVED)
        .values(
            status=RESOLVED,
            resolved_at=at,
            notes=dead_letters.c.notes.op("||")(_note(at, "resolved", note, operator)),
            updated_at=sa.func.now(),
        )
        .returning(*dead_letters.c)
    ).first()
    if row is None:
        raise ReplayRefused(f"dead letter {dead_letter_id} does not exist or is already resolved")
    return DeadLetter.from_row(row)
