"""What retry-safe send-and-mark and the drain run cost per recipient, against a naive "send, then mark" loop.

    python -m bench review_notifications                # under the bench stack (make bench runs all)
    BENCH_RN_RECIPIENTS=100 python -m bench.review_notifications   # smaller, standalone

Baseline (same session, same sandbox and PostgreSQL): for each outbox row, POST the mail and write
`notification_id`/`notified_at` in one UPDATE — what §6.4 asks for minus its retry safety.
Measured against it:
- **safe pass**: `Deliverer.deliver` on a fresh job — per-job lock, reconcile (no sent rows yet), and
  per row: re-read, `sending` marker, POST, single mark write;
- **verify pass**: the same job again — every row marked sent is checked at the provider (§8.3)
  and nothing is sent;
- **recovery pass**: every row left in `sending` after a crash — each is found by token lookup and
  backfilled (§8.2 row 1), no resend;
- **drain run**: as many recipients spread over jobs of 5 (`JOB_SIZE`), all worked by one in-process
  run of `review_notifications_job` (claims, the handler, finalization, the work row settled), with
  8 jobs in flight and with 1.
Rounds alternate the variants; the median of each is reported, with ratios to the baseline. A
scratch database of its own, so nothing it creates is left for a sensor.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid

import dagster as dg
import sqlalchemy as sa

from assets.review_notifications import api, pipeline, policy, repository
from assets.review_notifications.delivery import Deliverer
from bench._support import scratch_database
from orchestration.definitions import build_definitions
from redrive.db import engine_for
from redrive.reliability import Reliability
from redrive.schema import work_items
from redrive.settings import Settings
from resources.database import resolve_database_url
from resources.review_notifications import MailProvider, OutgoingMail

ROUNDS = 3
JOB_SIZE = 5  # recipients per job in the drain variants


def _job(engine: sa.Engine, tag: str, n: int) -> repository.Job:
    recipients = [f"reviewer{i}@example.com" for i in range(n)]
    return api.submit(engine, {"idempotency_key": f"bench-{tag}", "changelist_id": f"BENCH-{tag}",
                               "review_version": 1, "recipients": recipients, "summary": "bench"}).job


def _naive(engine: sa.Engine, mail: MailProvider, job: repository.Job, *, mark: bool = True) -> float:
    started = time.perf_counter()
    with engine.connect() as conn:
        rows = repository.deliveries_of(conn, job.id)
    subject, text = policy.render(job.changelist_id, job.review_version, job.summary)
    for row in rows:
        message_id = mail.send(OutgoingMail(to=row.recipient, subject=subject, text=text,
                                            idempotency_token=row.provider_token))
        if mark:
            with engine.begin() as conn:
                repository.mark_sent(conn, row.id, message_id, conn.execute(sa.select(sa.func.now())).scalar_one())
    return time.perf_counter() - started


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _drain(defs: dg.Definitions, instance: dg.DagsterInstance, engine: sa.Engine, tag: str, n: int,
           concurrency: int) -> float:
    """n recipients in jobs of JOB_SIZE, then one drain run over them; its wall time."""
    with engine.begin() as conn:  # jobs delivered by hand above are no work for the drain
        conn.execute(sa.update(work_items).where(work_items.c.pipeline == policy.PIPELINE).values(status="done"))
    for j in range(max(1, n // JOB_SIZE)):
        _job(engine, f"{tag}-{j}", JOB_SIZE)
    config = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}},
              "ops": {"send_notifications": {"config": {"concurrency": concurrency, "linger_seconds": 0.5}}}}
    job = defs.resolve_job_def(pipeline.JOB_NAME)
    started = time.perf_counter()
    result = job.execute_in_process(run_config=config, instance=instance, raise_on_error=False)
    seconds = time.perf_counter() - started
    counts = result.output_for_node("send_notifications") if result.success else {}
    if counts.get("jobs_succeeded") != max(1, n // JOB_SIZE):
        raise RuntimeError(f"drain run did not finish every job: {counts}")
    return seconds


def _rounds(engine: sa.Engine, mail: MailProvider, deliverer: Deliverer, defs: dg.Definitions,
            instance: dg.DagsterInstance, session: str, n: int, figures: dict[str, list[float]]) -> None:
    _naive(engine, mail, _job(engine, f"{session}-warm", 20))  # connections, caches
    _drain(defs, instance, engine, f"{session}-warm-drain", 2 * JOB_SIZE, 8)
    for r in range(ROUNDS):
        figures["baseline"].append(_naive(engine, mail, _job(engine, f"{session}-base-{r}", n)))
        job = _job(engine, f"{session}-safe-{r}", n)
        figures["safe"].append(_timed(lambda: deliverer.deliver(job)))
        figures["verify"].append(_timed(lambda: deliverer.deliver(job)))
        crashed = _job(engine, f"{session}-crash-{r}", n)
        _naive(engine, mail, crashed, mark=False)  # the provider accepted every one; no mark was written
        with engine.begin() as conn:
            conn.execute(sa.update(repository.review_deliveries)
                         .where(repository.review_deliveries.c.job_id == crashed.id)
                         .values(status="sending", attempts=1))
        backfilled: list[int] = []
        figures["recovery"].append(_timed(lambda: backfilled.append(deliverer.deliver(crashed).backfilled)))
        if backfilled != [n]:
            raise RuntimeError(f"recovery backfilled {backfilled} of {n}: it resent or missed rows")
        figures["drain_8"].append(_drain(defs, instance, engine, f"{session}-d8-{r}", n, 8))
        figures["drain_1"].append(_drain(defs, instance, engine, f"{session}-d1-{r}", n, 1))


def main(n: int | None = None) -> int:
    n = n or int(os.environ.get("BENCH_RN_RECIPIENTS", "500"))
    session = uuid.uuid4().hex[:6]
    with scratch_database(f"bench_rn_{session}") as url:
        return _measure(n, session, Settings(database_url=url, redrive_time_scale=0.001))


def _measure(n: int, session: str, settings: Settings) -> int:
    engine = engine_for(resolve_database_url(settings))
    runtime = Reliability(engine=engine)  # no alert channels: nothing here alerts
    defs = build_definitions(settings)
    figures: dict[str, list[float]] = {k: [] for k in ("baseline", "safe", "verify", "recovery", "drain_8",
                                                        "drain_1")}
    with MailProvider(settings.mail_url or "", "sandbox-token") as mail, dg.instance_for_test() as instance:
        _rounds(engine, mail, Deliverer(engine, mail, runtime), defs, instance, session, n, figures)
        runs = len(instance.get_runs())
    base = statistics.median(figures["baseline"])
    print(f"review_notifications: {n} recipients per variant, median of {ROUNDS} rounds")
    print(f"  {'variant':<44}{'s':>8}{'ms/recipient':>14}{'× baseline':>12}")
    labels = {"baseline": "baseline: send, then mark (naive)", "safe": "safe send-and-mark (first pass)",
              "verify": "verify pass (all sent, 0 sends)", "recovery": "recovery pass (lookup + backfill)",
              "drain_8": f"drain run, jobs of {JOB_SIZE}, 8 in flight",
              "drain_1": f"drain run, jobs of {JOB_SIZE}, 1 in flight"}
    for key, label in labels.items():
        t = statistics.median(figures[key])
        print(f"  {label:<44}{t:>8.2f}{1000 * t / n:>14.2f}{t / base:>12.2f}")
    print(f"  Dagster runs for {2 * ROUNDS + 1} drains of {n // JOB_SIZE} jobs each: {runs}")
    return 0


if __name__ == "__main__":
    from devstack.stack import local_stack

    with local_stack("bench"):
        sys.exit(main())
