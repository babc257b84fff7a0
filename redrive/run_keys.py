"""Run keys for sensors that request work.

Dagster never launches a run key a second time, also when the run with that key
failed (dagster-io/dagster#15982). A key of the entity alone would therefore block
every retry and replay of a failed entity forever. So every key names the entity
*and* the attempt or replay number: a repeated tick for the same attempt is
deduplicated by Dagster, the next attempt gets a new key. Keys never hold the wall
clock (STYLE §6): a rerun derives the same key again.
"""

from __future__ import annotations


def run_key(pipeline: str, entity_ref: str, *, attempt: int | None = None, replay: int | None = None,
            purpose: str = "run") -> str:
    if (attempt is None) == (replay is None):
        raise ValueError("a run key names exactly one of attempt or replay")
    suffix = f"attempt-{attempt}" if attempt is not None else f"replay-{replay}"
    return f"{pipeline}:{purpose}:{entity_ref}:{suffix}"


# The sensors that start runs, by name, for messages that tell an operator what happens next (no Dagster import).
REPLAY_SENSOR = "redrive_dead_letter_replays"  # starts the runs of replays that are not work rows


def due_work_sensor_name(pipeline: str) -> str:
    """The sensor that starts `pipeline`'s drain runs (new work, retries and replays falling due)."""
    return f"{pipeline}_due_work"
