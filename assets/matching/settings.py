"""The matching worker's knobs, read from MATCHING_* environment variables when definitions are built.

Every duration is a setting, so tests and rehearsals run the seed's minutes in seconds. The
seed's own numbers (5 min / 30 min visibility steps, 2 s → 4 s → 8 s LLM backoff, 3 deliveries)
are the core's constants `MATCHING_VISIBILITY_BACKOFF` and `MATCHING_LLM_BACKOFF`; what is
configured here is how they are scaled and the queue around them.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class MatchingSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MATCHING_", extra="ignore", case_sensitive=False)

    queue_name: str = Field(default="redrive-matching", description="The matching queue (SQS).")
    dlq_name: str = Field(default="redrive-matching-dlq", description="Its dead-letter queue.")
    visibility_timeout_seconds: int = Field(
        default=60, ge=0, le=43200, description="The main queue's visibility timeout while a message is processed."
    )
    max_receive_count: int = Field(default=3, ge=1, le=1000, description="Redrive policy: deliveries before the DLQ.")
    batch_size: int = Field(default=5, ge=1, le=10, description="Messages per ReceiveMessage, processed concurrently.")
    in_flight: int | None = Field(
        default=None, ge=1, le=256,
        description="Documents one drain run processes at once, a task each, no thread while it waits on the LLM "
                    "(unset: two batches); size it to the LLM's slots over the drain runs at once (docs/operating.md, "
                    "Upstream limits).")
    max_batches_per_run: int = Field(default=100, ge=1, description="A drain run stops after this many batches.")
    receive_wait_seconds: int = Field(default=1, ge=0, le=20, description="Long-poll wait of each ReceiveMessage.")
    max_concurrent_drains: int = Field(default=1, ge=1, description="The queue sensor starts no more drain runs.")
    sensor_interval_seconds: int = Field(default=30, ge=1, description="How often the queue sensor checks depth.")
    visibility_scale: float | None = Field(
        default=None, gt=0,
        description="Multiplies the 5/30 min visibility steps; unset: REDRIVE_TIME_SCALE, like every other wait.",
    )
    llm_max_attempts: int = Field(default=3, ge=1, le=10, description="In-process LLM attempts per delivery (000).")
    candidate_limit: int = Field(default=10, ge=1, le=50, description="Candidates shown to the LLM per document.")
    stuck_after_seconds: float = Field(
        default=600.0, ge=0, description="An in-progress document older than this is a crashed-worker signal."
    )
    stuck_sensor_interval_seconds: int = Field(default=60, ge=1)
    admin_document_url: str = Field(
        default="http://localhost:3000/admin/documents/{document_id}",
        description="Admin page of a document in alerts; {document_id} and {tenant} are filled in.",
    )
