"""What retry-safe send-and-mark costs per recipient, against a naive "send, then mark" loop.

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
  backfilled (§8.2 row 1), no resend.
Rounds alternate the variants; the median of each is reported, with ratios to the baseline.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid

import sqlalchemy as sa

from assets.review_notifications import api, policy, repository
from assets.review_notifications.delivery import Deliverer
from redrive.db import engine_for
from resources.database import resolve_database_url
from redrive.reliability import Reliability
from redrive.settings import Settings
from resources.review_notifications import MailProvider, OutgoingMail

ROUNDS = 3


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


def _rounds(engine: sa.Engine, mail: MailProvider, deliverer: Deliverer, session: str, n: int,
            figures: dict[str, list[float]]) -> None:
    _naive(engine, mail, _job(engine, f"{session}-warm", 20))  # connections, caches
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


def main(n: int | None = None) -> int:
    n = n or int(os.environ.get("BENCH_RN_RECIPIENTS", "500"))
    settings = Settings()
    engine = engine_for(resolve_database_url(settings))
    session = uuid.uuid4().hex[:6]
    runtime = Reliability(engine=engine)  # no alert channels: nothing here alerts
    figures: dict[str, list[float]] = {"baseline": [], "safe": [], "verify": [], "recovery": []}
    try:
        with MailProvider(settings.mail_url or "", "sandbox-token") as mail:
            _rounds(engine, mail, Deliverer(engine, mail, runtime), session, n, figures)
    finally:
        with engine.begin() as conn:  # leave nothing for a sensor to pick up (jobs cascade to their rows)
            conn.execute(sa.delete(repository.review_jobs)
                         .where(repository.review_jobs.c.changelist_id.like(f"BENCH-{session}-%")))
    base = statistics.median(figures["baseline"])
    print(f"review_notifications: {n} recipients per job, median of {ROUNDS} rounds")
    print(f"  {'variant':<34}{'s/job':>8}{'ms/recipient':>14}{'× baseline':>12}")
    labels = {"baseline": "baseline: send, then mark (naive)", "safe": "safe send-and-mark (first pass)",
              "verify": "verify pass (all sent, 0 sends)", "recovery": "recovery pass (lookup + backfill)"}
    for key, label in labels.items():
        t = statistics.median(figures[key])
        print(f"  {label:<34}{t:>8.2f}{1000 * t / n:>14.2f}{t / base:>12.2f}")
    return 0


if __name__ == "__main__":
    from devstack.stack import local_stack

    with local_stack("bench"):
        sys.exit(main())
