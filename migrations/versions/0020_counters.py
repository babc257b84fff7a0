"""counters that never go back (issue 28): metric_counters, sharded stage observations, redrive_observe()

Revision ID: 0020
Revises: 0006
Create Date: 2026-11-26 18:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0020'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# redrive.observations.BUCKETS when this was written (a test checks the function against the code).
BOUNDS = "{0.005,0.01,0.025,0.05,0.1,0.25,0.5,1.0,2.5,5.0,10.0,30.0,60.0,120.0}"
SHARDS = 16

# Adds `p_count` outcomes to the writer's shard row: the non-negative durations of `p_seconds` are
# bucketed (bucket i = number of bounds below the duration, the last one +Inf) and summed. PL/pgSQL, not
# SQL: a SQL function's statement is planned again at every call (before PostgreSQL 18), a PL/pgSQL
# function's once per session, and this runs in the conversion worker's every turn.
OBSERVE = f"""
CREATE OR REPLACE FUNCTION redrive_observe(p_pipeline text, p_stage text, p_outcome text, p_error_class text,
                                           p_count bigint, p_seconds float8[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    bounds CONSTANT float8[] := CAST('{BOUNDS}' AS float8[]);
    v_buckets bigint[] := array_fill(CAST(0 AS bigint), ARRAY[cardinality(CAST('{BOUNDS}' AS float8[])) + 1]);
    v_total float8 := 0;
    v_x float8;
    v_k int;
BEGIN
    IF p_count IS NULL OR p_count <= 0 THEN
        RETURN;
    END IF;
    IF p_seconds IS NOT NULL THEN
        FOREACH v_x IN ARRAY p_seconds LOOP
            IF v_x >= 0 THEN
                v_k := 1;
                WHILE v_k <= cardinality(bounds) AND bounds[v_k] < v_x LOOP
                    v_k := v_k + 1;
                END LOOP;
                v_buckets[v_k] := v_buckets[v_k] + 1;
                v_total := v_total + v_x;
            END IF;
        END LOOP;
    END IF;
    INSERT INTO stage_observations (pipeline, stage, outcome, error_class, shard, count, buckets, sum_seconds)
    VALUES (p_pipeline, p_stage, p_outcome, COALESCE(p_error_class, ''), CAST(pg_backend_pid() % {SHARDS} AS smallint),
            p_count, v_buckets, v_total)
    ON CONFLICT (pipeline, stage, outcome, error_class, shard) DO UPDATE SET
        count = stage_observations.count + excluded.count,
        buckets = ARRAY(SELECT o.n + a.n FROM unnest(stage_observations.buckets) WITH ORDINALITY AS o(n, ord)
                        JOIN unnest(excluded.buckets) WITH ORDINALITY AS a(n, ord) USING (ord) ORDER BY ord),
        sum_seconds = stage_observations.sum_seconds + excluded.sum_seconds,
        updated_at = now();
END
$$
"""


def upgrade() -> None:
    op.create_table('metric_counters',
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('labels', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"),
              nullable=False),
    sa.Column('shard', sa.SmallInteger(), server_default='0', nullable=False),
    sa.Column('value', sa.Float(), server_default='0', nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('name', 'labels', 'shard', name=op.f('pk_metric_counters'))
    )
    op.add_column('stage_observations', sa.Column('shard', sa.SmallInteger(), server_default='0', nullable=False))
    op.drop_constraint('pk_stage_observations', 'stage_observations', type_='primary')
    op.create_primary_key('pk_stage_observations', 'stage_observations',
                          ['pipeline', 'stage', 'outcome', 'error_class', 'shard'])
    op.execute(OBSERVE)
    # Counters that were derived from history until now start from what the history says, so they go on
    # from there instead of dropping to zero: dead-lettered entities (the `failed` observations until now)
    # and alert messages (one per channel, group and sending time: a folded burst was one message).
    op.execute("""
INSERT INTO metric_counters (name, labels, shard, value)
SELECT 'items_failed', jsonb_build_object('error_class', error_class, 'pipeline', pipeline), 0, sum(count)
FROM stage_observations WHERE outcome = 'failed' GROUP BY pipeline, error_class""")
    op.execute("""
INSERT INTO metric_counters (name, labels, shard, value)
SELECT 'alerts_sent', jsonb_build_object('channel', channel, 'pipeline', pipeline), 0, count(*)
FROM (SELECT DISTINCT a.pipeline, d.channel, a.group_key, d.sent_at
      FROM alert_deliveries AS d JOIN alerts AS a ON a.id = d.alert_id WHERE d.status = 'sent') AS m
GROUP BY pipeline, channel""")


def downgrade() -> None:
    op.execute("DROP FUNCTION IF EXISTS redrive_observe(text, text, text, text, bigint, float8[])")
    op.execute("""
DELETE FROM stage_observations AS o USING (
    SELECT pipeline, stage, outcome, error_class, min(shard) AS keep FROM stage_observations
    GROUP BY 1, 2, 3, 4 HAVING count(*) > 1) AS d
WHERE o.pipeline = d.pipeline AND o.stage = d.stage AND o.outcome = d.outcome AND o.error_class = d.error_class
  AND o.shard <> d.keep""")  # loses the other shards' counts: a downgrade is for an emergency
    op.drop_constraint('pk_stage_observations', 'stage_observations', type_='primary')
    op.create_primary_key('pk_stage_observations', 'stage_observations',
                          ['pipeline', 'stage', 'outcome', 'error_class'])
    op.drop_column('stage_observations', 'shard')
    op.drop_table('metric_counters')
