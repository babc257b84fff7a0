"""The core's runtime as a Dagster resource: database, alert channels, clock, time scale."""

from __future__ import annotations

import json

from dagster import ConfigurableResource, InitResourceContext
from pydantic import Field

from redrive import liveness, upstreams
from redrive.upstream_policy import UpstreamLimits

from redrive.clock import Clock, SystemClock
from redrive.reliability import Reliability
from resources.database import PostgresResource
from resources.notify import NotifierResource


class ReliabilityResource(ConfigurableResource):
    """What every pipeline uses to dead-letter, alert and defer; one per code location."""

    database: PostgresResource
    notifier: NotifierResource
    time_scale: float = Field(default=1.0, description="Multiplies every backoff wait (REDRIVE_TIME_SCALE).")
    durable_threshold_seconds: float = Field(default=300.0, description="Longer waits become durable timers.")
    burst_window_seconds: float = Field(default=300.0, description="Alerts of one kind within it become one message.")
    ui_url: str = "http://localhost:3000"

    jitter_seed: str = Field(default="", description="Seeds jitter; fixed per entity, stage and attempt.")
    upstream_limits: str = Field(default="{}", description="Limits per upstream as JSON (REDRIVE_UPSTREAM_*), "
                                 "shared by every process through PostgreSQL.")
    heartbeat_seconds: float = Field(default=liveness.HEARTBEAT_SECONDS,
                                     description="A run using this resource beats this often (the run watchdog).")

    # Every run worker that uses the core beats while its run lasts (issue 25): the watchdog fails a STARTED run
    # whose worker went silent, whatever killed it. Outside a run (sensors, commands) nothing starts.
    def setup_for_execution(self, context: InitResourceContext) -> None:
        run = context.dagster_run
        if run is not None:
            liveness.start_for_run(self.database.engine(), run.run_id, interval=self.heartbeat_seconds,
                                   now=SystemClock().now)

    def teardown_after_execution(self, context: InitResourceContext) -> None:
        if context.dagster_run is not None:
            liveness.stop_for_run(context.dagster_run.run_id)

    def runtime(self, clock: Clock | None = None) -> Reliability:
        runtime = Reliability(
            engine=self.database.engine(),
            channels=self.notifier.channels(),
            clock=clock or SystemClock(),
            jitter_seed=self.jitter_seed,
            time_scale=self.time_scale,
            durable_threshold=self.durable_threshold_seconds,
            burst_window=self.burst_window_seconds,
            ui_url=self.ui_url,
        )
        limits = {name: UpstreamLimits.model_validate(value) for name, value in json.loads(self.upstream_limits).items()}
        # the calls of this process's resources go through these limits (`redrive.upstreams.guarded`)
        upstreams.install_once(runtime.engine, limits, SystemClock(), runtime.retry_budget_exhausted)
        return runtime
