"""evidence has one pipeline name: file-job rows recorded as `evidence_file_jobs` become `evidence` (issue 27)

A file job's entity is `{job}`, a row's `{job}/{row}`, so the two kinds never share an entity under one name.
The one case that could collide — a file job with an active letter under both names (a failed drain run of its
partition wrote one under `evidence`) — keeps the `evidence` letter; the other is resolved with a note naming it.

Revision ID: 0030
Revises: 0021
Create Date: 2026-11-26 19:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0030'
down_revision: str | None = '0021'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD, NEW = 'evidence_file_jobs', 'evidence'


def _rename(old: str, new: str) -> None:
    params = {'old': old, 'new': new}
    # an active letter of the same entity under the new name wins; the old one is closed, saying so
    op.get_bind().execute(sa.text("""
        UPDATE dead_letters d SET status = 'resolved', resolved_at = now(), updated_at = now(),
            notes = d.notes || jsonb_build_array(jsonb_build_object(
                'at', now(), 'kind', 'merged', 'by', 'migration 0030',
                'text', 'pipeline ' || :old || ' is now ' || :new || '; dead letter ' || n.id || ' is this entity''s record'))
        FROM dead_letters n
        WHERE d.pipeline = :old AND d.status <> 'resolved'
          AND n.pipeline = :new AND n.entity_ref = d.entity_ref AND n.status <> 'resolved'"""), params)
    for table in ('dead_letters', 'alerts'):
        op.get_bind().execute(sa.text(f"UPDATE {table} SET pipeline = :new WHERE pipeline = :old"), params)
    # the rest is keyed by (pipeline, entity, …): renamed unless the same key exists under the new name
    for table, key in (('deferred_attempts', ('entity_ref', 'attempt')), ('stage_checkpoints', ('entity_ref', 'stage')),
                       ('work_items', ('entity_ref',))):
        same = " AND ".join(f"n.{c} = t.{c}" for c in key)
        op.get_bind().execute(sa.text(f"""
            UPDATE {table} t SET pipeline = :new WHERE t.pipeline = :old
              AND NOT EXISTS (SELECT 1 FROM {table} n WHERE n.pipeline = :new AND {same})"""), params)
    # counters add up under the new name
    op.get_bind().execute(sa.text("""
        INSERT INTO stage_observations AS s (pipeline, stage, outcome, error_class, shard, count, buckets,
                                             sum_seconds, updated_at)
        SELECT :new, stage, outcome, error_class, shard, count, buckets, sum_seconds, updated_at
        FROM stage_observations WHERE pipeline = :old
        ON CONFLICT (pipeline, stage, outcome, error_class, shard) DO UPDATE SET
            count = s.count + excluded.count, sum_seconds = s.sum_seconds + excluded.sum_seconds,
            buckets = (SELECT array_agg(coalesce(a, 0) + coalesce(b, 0) ORDER BY i)
                       FROM unnest(s.buckets, excluded.buckets) WITH ORDINALITY AS u(a, b, i)),
            updated_at = greatest(s.updated_at, excluded.updated_at)"""), params)
    op.get_bind().execute(sa.text("DELETE FROM stage_observations WHERE pipeline = :old"), params)
    op.get_bind().execute(sa.text("""
        INSERT INTO metric_counters AS c (name, labels, shard, value)
        SELECT name, jsonb_set(labels, '{pipeline}', to_jsonb(CAST(:new AS text))), shard, value
        FROM metric_counters WHERE labels ->> 'pipeline' = :old
        ON CONFLICT (name, labels, shard) DO UPDATE SET value = c.value + excluded.value"""), params)
    op.get_bind().execute(sa.text("DELETE FROM metric_counters WHERE labels ->> 'pipeline' = :old"), params)


def upgrade() -> None:
    _rename(OLD, NEW)


def downgrade() -> None:
    # file jobs are the evidence entities without a row part; their records go back under the old name
    op.get_bind().execute(sa.text("""
        UPDATE dead_letters SET pipeline = :old WHERE pipeline = :new AND position('/' in entity_ref) = 0"""),
        {'old': OLD, 'new': NEW})
