"""The Dagster UI as an operator meets it (issue 16 §4): every sensor and schedule says what it does."""

from __future__ import annotations

from orchestration.definitions import build_definitions
from redrive.settings import Settings


def test_every_sensor_and_schedule_has_a_description(settings: Settings) -> None:
    """Walk the repository the code location serves: a sensor or schedule without a description fails here."""
    repository = build_definitions(settings).get_repository_def()
    instigators = [("sensor", s.name, s.description) for s in repository.sensor_defs]
    instigators += [("schedule", s.name, s.description) for s in repository.schedule_defs]
    assert len(instigators) > 10  # the walk saw the whole code location
    missing = sorted(f"{kind} {name}" for kind, name, description in instigators
                     if not (description or "").strip())
    assert missing == []
