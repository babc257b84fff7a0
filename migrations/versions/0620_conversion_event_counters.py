"""conversion: its job events count themselves as they are written (issue 28: counters that never go back)

A statement-level trigger on `conversion_job_events` adds each statement's events to the core's counters
(`metric_counters`, name `conversion_job_events`, labels event and label) and its completions and
retries, with their durations, to the core's stage observations (`redrive_observe`, migration 0020), in
the transaction that writes them: the worker's one statement per turn stays one round trip, every event
path is counted (the API's uploads, manual retries, the reclaim, fenced writes), and /metrics no longer
scans the events, which the pruner may now delete.

Revision ID: 0620
Revises: 0602
Create Date: 2026-11-26 18:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0620'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = '0020'

# Counters first, then observations (redrive.counters: one order everywhere). The label is what
# /metrics splits an event by: its error code, its reason, or the refused write.
FUNCTION = """
CREATE OR REPLACE FUNCTION conversion_count_events() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    INSERT INTO metric_counters (name, labels, shard, value)
    SELECT 'conversion_job_events', l, CAST(pg_backend_pid() % 16 AS smallint), count(*)
    FROM (SELECT jsonb_build_object('event', event,
                                    'label', COALESCE(meta->>'error_code', meta->>'reason', meta->>'write', '')) AS l
          FROM counted_events) AS e
    GROUP BY l ORDER BY l
    ON CONFLICT (name, labels, shard) DO UPDATE SET value = metric_counters.value + excluded.value,
                                                    updated_at = now();
    FOR r IN
        SELECT event, COALESCE(meta->>'error_code', '') AS code,
               array_agg(COALESCE(CAST(meta->>'duration_ms' AS float8) / 1000, -1)) AS seconds
        FROM counted_events WHERE event IN ('complete', 'retry')
        GROUP BY 1, 2 ORDER BY 1, 2
    LOOP
        PERFORM redrive_observe('conversion', 'convert', CASE WHEN r.event = 'complete' THEN 'ok' ELSE 'retry' END,
                                r.code, cardinality(r.seconds), r.seconds);
        IF r.event = 'complete' THEN
            PERFORM redrive_observe('conversion', 'convert', 'done', '', cardinality(r.seconds), NULL);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$
"""

TRIGGER = """
CREATE TRIGGER conversion_job_events_counted AFTER INSERT ON conversion_job_events
REFERENCING NEW TABLE AS counted_events FOR EACH STATEMENT EXECUTE FUNCTION conversion_count_events()
"""

# What the events said until now, so the counters go on from there instead of dropping to zero.
BACKFILL = [
    """
INSERT INTO metric_counters (name, labels, shard, value)
SELECT 'conversion_job_events', l, 0, count(*)
FROM (SELECT jsonb_build_object('event', event,
                                'label', COALESCE(meta->>'error_code', meta->>'reason', meta->>'write', '')) AS l
      FROM conversion_job_events) AS e
GROUP BY l
ON CONFLICT (name, labels, shard) DO UPDATE SET value = metric_counters.value + excluded.value""",
    """
SELECT redrive_observe('conversion', 'convert', CASE WHEN event = 'complete' THEN 'ok' ELSE 'retry' END, code,
                       cardinality(seconds), seconds)
FROM (SELECT event, COALESCE(meta->>'error_code', '') AS code,
             array_agg(COALESCE(CAST(meta->>'duration_ms' AS float8) / 1000, -1)) AS seconds
      FROM conversion_job_events WHERE event IN ('complete', 'retry') GROUP BY 1, 2) AS e""",
    """
SELECT redrive_observe('conversion', 'convert', 'done', '', count(*), NULL)
FROM conversion_job_events WHERE event = 'complete' HAVING count(*) > 0""",
]


def upgrade() -> None:
    op.execute(FUNCTION)
    for statement in BACKFILL:
        op.execute(statement)
    op.execute(TRIGGER)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS conversion_job_events_counted ON conversion_job_events")
    op.execute("DROP FUNCTION IF EXISTS conversion_count_events()")
