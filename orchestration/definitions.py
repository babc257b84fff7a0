"""The single Definitions of the redrive code location (loaded by workspace.yaml)."""

from __future__ import annotations

import dagster as dg

from assets.healthcheck import stack_healthcheck
from assets.rehearsal import pipeline as rehearsal
from orchestration.jobs import JOBS
from redrive import logs
from redrive.settings import Settings
from resources.factory import build_resources
from sensors.core import (
    ReplayTarget,
    alert_delivery_sensor,
    dead_letter_replay_sensor,
    deferred_retry_sensor,
    run_failure_alert_sensor,
)

REPLAY_TARGETS = {
    rehearsal.PIPELINE: ReplayTarget(job=rehearsal.rehearsal_job, run_config=rehearsal.run_config),
}


def build_definitions(settings: Settings | None = None) -> dg.Definitions:
    """Build everything from settings read now, never at import time of a module."""
    settings = settings or Settings()
    logs.install()
    return dg.Definitions(
        assets=[stack_healthcheck],
        jobs=JOBS,
        sensors=[
            alert_delivery_sensor(),
            run_failure_alert_sensor(),
            dead_letter_replay_sensor(REPLAY_TARGETS),
            *[deferred_retry_sensor(name, target) for name, target in REPLAY_TARGETS.items()],
        ],
        resources=build_resources(settings),
    )


@dg.definitions
def defs() -> dg.Definitions:
    return build_definitions()
