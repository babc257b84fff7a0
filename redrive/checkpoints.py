"""Outputs of completed stages, kept so a replay starts at the failed stage (002 §8.5).

Chosen over Dagster's re-execution from failure: a checkpoint is a row any later run
can read (a sensor-launched replay, a full restart that clears it, a new code
version), needs no IO manager shared between runs, and an operator can inspect it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from redrive.db import compiled_once
from redrive.schema import stage_checkpoints


def load(conn: sa.Connection, pipeline: str, entity_ref: str, stage: str) -> dict[str, Any] | None:
    row = conn.execute(
        sa.select(stage_checkpoints.c.output).where(
            stage_checkpoints.c.pipeline == pipeline,
            stage_checkpoints.c.entity_ref == entity_ref,
            stage_checkpoints.c.stage == stage,
        )
    ).first()
    return dict(row.output) if row else None


def load_all(conn: sa.Connection, pipeline: str, entity_ref: str) -> dict[str, dict[str, Any]]:
    """Every checkpointed stage's output of the entity, by stage."""
    rows = conn.execute(sa.select(stage_checkpoints.c.stage, stage_checkpoints.c.output).where(
        stage_checkpoints.c.pipeline == pipeline, stage_checkpoints.c.entity_ref == entity_ref))
    return {row.stage: dict(row.output) for row in rows}


def save(conn: sa.Connection, pipeline: str, entity_ref: str, stage: str, output: Mapping[str, Any]) -> None:
    conn.execute(_SAVE, {"pipeline": pipeline, "entity_ref": entity_ref, "stage": stage, "output": dict(output)})


def _save_statement() -> sa.TextClause:
    """Compiled once (a stage's checkpoint is written for every entity; compiling it again each time cost the
    drain more CPU than the write), its values bound at each call."""
    stmt = insert(stage_checkpoints)
    return compiled_once(stmt.on_conflict_do_update(
        index_elements=["pipeline", "entity_ref", "stage"],
        set_={"output": stmt.excluded.output, "completed_at": sa.func.now()},
    ), "pipeline", "entity_ref", "stage", "output")


_SAVE = _save_statement()


def clear(conn: sa.Connection, pipeline: str, entity_ref: str) -> int:
    """A full restart forgets what the stages produced."""
    return conn.execute(
        sa.delete(stage_checkpoints).where(
            stage_checkpoints.c.pipeline == pipeline, stage_checkpoints.c.entity_ref == entity_ref
        )
    ).rowcount
