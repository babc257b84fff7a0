"""Review notifications' fixtures: a core runtime on a frozen clock, the mail provider (the sandbox), jobs,
and two ways to drain: as the daemon does (due-work sensor tick → a real run of the drain job) and the
core's `Drain` called directly on an injected clock."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa

from assets.review_notifications import api, pipeline, policy, repository
from assets.review_notifications.delivery import Deliverer
from redrive import work
from redrive.clock import Clock, FrozenClock
from redrive.drain import Drain, DrainReport
from redrive.reliability import Reliability
from redrive.settings import Settings
from resources.factory import notifier_from
from resources.review_notifications import MailProvider

RECIPIENTS = ("ana@example.com", "bo@example.com", "cy@example.com")
SENSOR = "review_notifications_due_work"


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock()


@pytest.fixture
def runtime(engine: sa.Engine, settings: Settings, clock: FrozenClock) -> Reliability:
    """The core as the op gets it: alerts to the sandbox's Slack webhook and mail, time frozen."""
    return Reliability(engine=engine, channels=notifier_from(settings).channels(), clock=clock, time_scale=1.0,
                       burst_window=0.0)


@pytest.fixture
def mail(stack) -> Iterator[MailProvider]:
    with MailProvider(f"{os.environ['SANDBOX_URL']}/mail/v1", "sandbox-token") as provider:
        yield provider


@pytest.fixture
def deliverer(engine: sa.Engine, mail: MailProvider, runtime: Reliability, clock: FrozenClock) -> Deliverer:
    """Sleeps on the frozen clock: backoff waits are recorded in `clock.sleeps`, never slept."""
    return Deliverer(engine, mail, runtime, sleep=clock.sleep)


def make_job(engine: sa.Engine, *, key: str = "req-1", changelist: str = "CL-1", version: int = 3,
             recipients: Sequence[str] = RECIPIENTS, summary: str = "Looks good",
             clock: Clock | None = None) -> repository.Job:
    submission = api.submit(engine, {"idempotency_key": key, "changelist_id": changelist,
                                     "review_version": version, "recipients": list(recipients),
                                     "summary": summary}, clock=clock)
    return submission.job


def notifications(sandbox: Any) -> list[dict[str, Any]]:
    """The sandbox's `mail.send` effects of review notifications (alert emails use other tokens)."""
    return [e for e in sandbox.effects("mail.send") if e["idempotency_token"].startswith(policy.TOKEN_PREFIX)]


def rows(engine: sa.Engine, job_id: int) -> list[repository.Delivery]:
    with engine.connect() as conn:
        return repository.deliveries_of(conn, job_id)


def work_row(engine: sa.Engine, ref: str) -> work.State | None:
    with engine.connect() as conn:
        return work.state(conn, policy.PIPELINE, ref)


@dataclass
class Daemon:
    """The due-work sensor ticked as the daemon does (cursor kept, run keys launched once) and its runs
    executed in process: each result is one real run of the drain job."""

    defs: dg.Definitions
    instance: dg.DagsterInstance
    cursor: str | None = None
    runs: list[dg.ExecuteInProcessResult] = field(default_factory=list)

    def tick(self, run_config: dict[str, Any] | None = None) -> list[dg.ExecuteInProcessResult]:
        from orchestration.demo import evaluate_sensor_tick

        tick = evaluate_sensor_tick(self.defs, self.instance, SENSOR, self.cursor)
        self.cursor = tick.cursor
        out = []
        for req in tick.run_requests:
            if self.instance.get_runs(filters=dg.RunsFilter(tags={"dagster/run_key": req.run_key})):
                continue
            job = self.defs.resolve_job_def(req.job_name or pipeline.JOB_NAME)
            out.append(job.execute_in_process(run_config=run_config, instance=self.instance,
                                              tags={**(req.tags or {}), "dagster/run_key": req.run_key},
                                              raise_on_error=False))
        self.runs += out
        return out

    def drain(self, run_config: dict[str, Any] | None = None) -> dg.ExecuteInProcessResult:
        """One tick that must start exactly one drain run; its result."""
        [run] = self.tick(run_config)
        return run


@pytest.fixture
def daemon(defs: dg.Definitions, instance: dg.DagsterInstance) -> Daemon:
    return Daemon(defs, instance)


def output(run: dg.ExecuteInProcessResult) -> dict[str, Any]:
    """The drain run's counts: the core's (claimed, done, retried, dead_lettered) and the pipeline's (sent, …)."""
    return run.output_for_node("send_notifications")


def drain_now(runtime: Reliability, mail: MailProvider, **bounds: Any) -> DrainReport:
    """The core's drain with this pipeline's handler, on the runtime's (injected) clock; no lingering."""
    handler = pipeline.ReviewJobHandler(runtime, mail)
    bounds = {"linger_seconds": 0.0, "concurrency": 4, **bounds}
    return Drain(reliability=runtime, pipeline=policy.PIPELINE, policies=pipeline.stage_policies(),
                 owner="test", **bounds).run(handler)
