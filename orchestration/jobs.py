"""Jobs of the code location that belong to no pipeline: the operators' healthcheck."""

from __future__ import annotations

import dagster as dg

from assets.healthcheck import stack_healthcheck

healthcheck_job = dg.define_asset_job(
    "stack_healthcheck_job",
    selection=[stack_healthcheck],
    description="Round trip through every dependency; run it first when something looks wrong.",
)
