"""The core's tables: dead letters, alerts and their deliveries, durable retry timers, stage checkpoints.

Every pipeline shares these; a pipeline's own tables live beside its repository and
register on the same MetaData, so `alembic check` sees one schema.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB, UUID

from redrive.deadletter_reads import STATUSES

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)

TZ = sa.DateTime(timezone=True)
NOW = sa.text("now()")

# A dead letter is a documented *state* of an entity's work (River), one active row per entity.
DEAD_LETTER_STATUSES = STATUSES  # redrive.deadletter_reads: the one list

dead_letters = sa.Table(
    "dead_letters",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("pipeline", sa.Text, nullable=False),
    sa.Column("stage", sa.Text, nullable=False),
    sa.Column("entity_ref", sa.Text, nullable=False),
    sa.Column("tenant", sa.Text),
    sa.Column("error_class", sa.Text, nullable=False),
    sa.Column("error_message", sa.Text, nullable=False),
    sa.Column("retryable", sa.Boolean, nullable=False),
    sa.Column("last_stack", sa.Text, nullable=False, server_default=""),
    sa.Column("sanitized_context", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("payload_ref", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("stage_attempts", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("upstream_status", sa.Integer),
    sa.Column("first_failure_at", TZ, nullable=False),
    sa.Column("last_failure_at", TZ, nullable=False),
    sa.Column("occurrences", sa.Integer, nullable=False, server_default="1"),
    sa.Column("status", sa.Text, nullable=False, server_default="open"),
    sa.Column("replay_count", sa.Integer, nullable=False, server_default="0"),
    sa.Column("replay_from", sa.Text),
    sa.Column("remediation_evidence", sa.Text),
    sa.Column("notes", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
    sa.Column("run_id", sa.Text),
    sa.Column("escalated_at", TZ),
    sa.Column("resolved_at", TZ),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    sa.CheckConstraint(
        "status IN ('open', 'replaying', 'escalated', 'resolved')", name="status"
    ),
    sa.Index(
        "uq_dead_letters_active_entity",
        "pipeline",
        "entity_ref",
        unique=True,
        postgresql_where=sa.text("status <> 'resolved'"),
    ),
    sa.Index("ix_dead_letters_triage", "pipeline", "status", "error_class", "last_failure_at"),
    sa.Index("ix_dead_letters_resolved", "resolved_at", postgresql_where=sa.text("status = 'resolved'")),  # pruner
    # the open letters by pipeline and class with their oldest failure (a scrape, the backlog sensor): read from
    # the index alone, not the letters' rows; and the replays the replay sensor starts, oldest first
    sa.Index("ix_dead_letters_open", "pipeline", "error_class", "first_failure_at",
             postgresql_where=sa.text("status <> 'resolved'")),
    sa.Index("ix_dead_letters_replaying", "updated_at", "id", postgresql_where=sa.text("status = 'replaying'")),
    # every letter of an entity, whatever its status: "has this failure a letter?" (redrive.deadletters.unrecorded,
    # the reconciliation's probe per failure) is one index lookup, not a walk over the pipeline's letters
    sa.Index("ix_dead_letters_entity", "pipeline", "entity_ref", "last_failure_at"),
)

alerts = sa.Table(
    "alerts",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("dedupe_key", sa.Text, nullable=False, unique=True),
    # The alert's identity outside this database (provider idempotency tokens): serial ids repeat in a
    # recreated or restored database, a random UUID does not (issue 13 item 4).
    sa.Column("uid", UUID(as_uuid=False), nullable=False, unique=True, server_default=sa.text("gen_random_uuid()")),
    sa.Column("group_key", sa.Text, nullable=False),
    sa.Column("pipeline", sa.Text, nullable=False),
    sa.Column("kind", sa.Text, nullable=False),
    sa.Column("entity_ref", sa.Text),
    sa.Column("tenant", sa.Text),
    sa.Column("error_class", sa.Text),
    sa.Column("summary", sa.Text, nullable=False),
    sa.Column("attempts", sa.Integer),
    sa.Column("link", sa.Text),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Index("ix_alerts_created_at", "created_at"),  # the pruner's range
)

alert_deliveries = sa.Table(
    "alert_deliveries",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("alert_id", sa.BigInteger, sa.ForeignKey("alerts.id", ondelete="CASCADE"), nullable=False),
    sa.Column("channel", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False, server_default="pending"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("next_attempt_at", TZ, nullable=False, server_default=NOW),
    sa.Column("last_error", sa.Text),
    sa.Column("sent_at", TZ),
    sa.Column("message_id", sa.Text),
    sa.UniqueConstraint("alert_id", "channel"),
    sa.CheckConstraint("status IN ('pending', 'sent', 'failed')", name="status"),
    sa.Index(
        "ix_alert_deliveries_due",
        "next_attempt_at",
        postgresql_where=sa.text("status = 'pending'"),
    ),
)

# Durable retry timers: a wait too long to hold a run worker for (000's 30 min, 004's 60 min).
deferred_attempts = sa.Table(
    "deferred_attempts",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("pipeline", sa.Text, nullable=False),
    sa.Column("entity_ref", sa.Text, nullable=False),
    sa.Column("attempt", sa.Integer, nullable=False),
    sa.Column("due_at", TZ, nullable=False),
    sa.Column("status", sa.Text, nullable=False, server_default="waiting"),
    sa.Column("payload", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("requested_at", TZ),
    sa.UniqueConstraint("pipeline", "entity_ref", "attempt"),
    sa.CheckConstraint("status IN ('waiting', 'requested', 'cancelled')", name="status"),
    sa.Index("ix_deferred_attempts_due", "due_at", postgresql_where=sa.text("status = 'waiting'")),
    sa.Index("ix_deferred_attempts_finished", "due_at", postgresql_where=sa.text("status <> 'waiting'")),  # pruner
)

# Outputs of completed stages, so a replay starts at the failed stage (002 §8.5).
stage_checkpoints = sa.Table(
    "stage_checkpoints",
    metadata,
    sa.Column("pipeline", sa.Text, primary_key=True),
    sa.Column("entity_ref", sa.Text, primary_key=True),
    sa.Column("stage", sa.Text, primary_key=True),
    sa.Column("output", JSONB, nullable=False),
    sa.Column("completed_at", TZ, nullable=False, server_default=NOW),
    sa.Index("ix_stage_checkpoints_completed_at", "completed_at"),  # the pruner's range
)

# The foundation's smoke job proves each dependency end to end and leaves a trace here.
healthchecks = sa.Table(
    "healthchecks",
    metadata,
    sa.Column("run_key", sa.Text, primary_key=True),
    sa.Column("checked_at", TZ, nullable=False),
    sa.Column("results", JSONB, nullable=False),
)

# The core's work queue: one row per entity of a drained pipeline, carrying its scheduling state.
# A retry is the row becoming due again; a lease is the row's due time pushed past the lease's end
# (River's shape): a claim takes rows whose due time has passed, so an expired lease is claimable
# with no rescuer, and `lease_epoch` fences every write of the holder.
WORK_STATUSES = ("due", "leased", "done", "dead")

work_items = sa.Table(
    "work_items",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("pipeline", sa.Text, nullable=False),
    sa.Column("entity_ref", sa.Text, nullable=False),
    sa.Column("group_key", sa.Text),
    sa.Column("status", sa.Text, nullable=False, server_default="due"),
    sa.Column("due_at", TZ, nullable=False),
    sa.Column("stage", sa.Text),
    sa.Column("attempts", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("payload", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("lease_owner", sa.Text),
    sa.Column("lease_epoch", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    sa.UniqueConstraint("pipeline", "entity_ref"),
    sa.CheckConstraint("status IN ('due', 'leased', 'done', 'dead')", name="status"),
    sa.Index("ix_work_items_claim", "pipeline", "due_at", postgresql_where=sa.text("status IN ('due', 'leased')")),
    sa.Index("ix_work_items_group_claim", "pipeline", "group_key", "due_at",
             postgresql_where=sa.text("status IN ('due', 'leased') AND group_key IS NOT NULL")),
    sa.Index("ix_work_items_finished", "updated_at", postgresql_where=sa.text("status IN ('done', 'dead')")),  # pruner
)

# Liveness (issue 25): every run worker beats here; the watchdog marks a silent run dead, and every write of a
# work-queue holder checks in its own transaction that its holder is not dead (a fence like a lease's epoch).
run_heartbeats = sa.Table(
    "run_heartbeats",
    metadata,
    sa.Column("holder", sa.Text, primary_key=True),  # "run:<dagster run id>", the drain's lease owner
    sa.Column("run_id", sa.Text, nullable=False),
    sa.Column("started_at", TZ, nullable=False),
    sa.Column("beat_at", TZ, nullable=False),
    sa.Column("dead_at", TZ),
    sa.Column("dead_reason", sa.Text),
    sa.Index("ix_run_heartbeats_beat_at", "beat_at"),
)

# Each pipeline's progress as the stall watch last saw it: a counter of settled attempts, when it last moved,
# and the stall it is in (alerted once per episode).
pipeline_progress = sa.Table(
    "pipeline_progress",
    metadata,
    sa.Column("pipeline", sa.Text, primary_key=True),
    sa.Column("progress", sa.BigInteger, nullable=False),
    sa.Column("progressed_at", TZ, nullable=False),
    sa.Column("due", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("stalled_since", TZ),
    sa.Column("checked_at", TZ, nullable=False),
)
