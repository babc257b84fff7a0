"""Review notifications demo, as drain runs: lost responses and outages retried (the job's row falling due
again within one run), an invalid recipient dead-lettered and waived, a row "marked sent" that the
provider never saw reconciled with one Slack alert, and versions v3 → v3 (no-op), v3 → v4 (everyone
again), v4 → v3 (refused). One email per recipient per version.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from assets.review_notifications import api, policy, repository
from redrive import deadletters
from redrive.schema import alerts

SENSOR = f"{policy.PIPELINE}_due_work"
REVIEWERS = ["ana@example.com", "bo@example.com", "cy@example.com"]
UNDELIVERABLE = "dd@invalid.example"  # the sandbox's provider answers 422 INVALID_RECIPIENT for this domain
THROUGH_DAEMON = True  # under `make demo` the daemon's ticks of SENSOR start the drain runs


def _settle(ctx: Any, job_key: str) -> None:
    """The due-work sensor's drain runs work the job until its row is done (a retry: the row due again)."""
    ctx.settle(SENSOR, policy.PIPELINE, [job_key])


def _mine(ctx: Any, changelist: str, version: int, recipients: list[str]) -> list[int]:
    """How many emails the provider accepted for each (recipient, version) of this changelist."""
    tokens = [e["idempotency_token"] for e in ctx.sandbox.effects("mail.send")]
    return [tokens.count(policy.provider_token(changelist, r, version)) for r in recipients]


def run_demo(ctx):  # -> orchestration.demo.DemoReport
    from orchestration.demo import DemoReport

    report = DemoReport(policy.PIPELINE)
    engine: sa.Engine = ctx.engine
    cl, cl_b = f"CL-{ctx.session}", f"CL-{ctx.session}-b"

    ctx.tick(SENSOR)  # jobs a crashed earlier demo left due run now

    # 1. v3 of a changelist: the provider is flaky (503, 429, then accepts but loses its answer),
    #    and one address is undeliverable.
    #    The faults are scripted for this changelist's mails (its id is in their subject) before the
    #    job exists: a drain the daemon starts at once, or an alert mail, meets none of them.
    mark = max((r["seq"] for r in ctx.sandbox.requests("mail.send")), default=0)
    ctx.sandbox.script("mail.send", {"status": 503}, {"status": 429, "headers": {"Retry-After": "1"}},
                       {"kind": "effect_then_error", "status": 500}, match=cl)
    v3 = api.submit(engine, {"idempotency_key": f"{ctx.session}-1", "changelist_id": cl, "review_version": 3,
                             "recipients": [*REVIEWERS, UNDELIVERABLE], "summary": "LGTM, two nits."})
    _settle(ctx, v3.job.key)
    transient = [r for r in ctx.sandbox.requests("mail.send")
                 if r["seq"] > mark and r["status"] is not None and (r["status"] == 429 or r["status"] >= 500)]
    assert len(transient) == 3 and _mine(ctx, cl, 3, REVIEWERS) == [1, 1, 1]
    report.retried += len(transient)  # each one made the job's row due again; the lingering run took it up
    with engine.connect() as conn:
        invalid = next(d for d in repository.deliveries_of(conn, v3.job.id) if d.recipient == UNDELIVERABLE)
        letter = deadletters.active_for(conn, policy.PIPELINE, policy.delivery_ref(v3.job.key, invalid.id))
        assert repository.job_by_key(conn, v3.job.key).status == policy.RETRYABLE_FAILED
    assert letter is not None and letter.error_class == "INVALID_RECIPIENT", "invalid recipient not dead-lettered"
    report.dead_lettered += 1
    report.notes.append(f"{v3.job.key}: 503, 429 and a lost 500 each made the job's row due again "
                        f"({len(transient)} retries, no RetryRequested, no timer); the lost "
                        "response found by token lookup (backfilled, not resent)")
    report.notes.append(f"{letter.entity_ref}: INVALID_RECIPIENT → dead letter {letter.id} + alert; "
                        "job waits (retryable_failed)")

    # 2. The operator drops the undeliverable recipient: the job succeeds.
    delivery_id = invalid.id
    job = api.waive(engine, delivery_id, note="DEMO-2: address no longer exists", operator="demo")
    assert job.status == policy.SUCCEEDED
    report.done += 1
    report.notes.append(f"{v3.job.key}: recipient waived (`cli waive {delivery_id}`), dead letter resolved → "
                        "succeeded")

    # 3. v3 → v3 is a no-op with the prior result; v3 → v4 mails every reviewer again; v4 → v3 is refused.
    noop = api.submit(engine, {"idempotency_key": f"{ctx.session}-2", "changelist_id": cl, "review_version": 3,
                               "recipients": REVIEWERS})
    assert noop.mode is policy.Mode.NOOP and noop.job.result is not None
    v4 = api.submit(engine, {"idempotency_key": f"{ctx.session}-3", "changelist_id": cl, "review_version": 4,
                             "recipients": REVIEWERS, "summary": "Re-reviewed after the fix."})
    assert v4.mode is policy.Mode.VERSIONED_RERUN
    _settle(ctx, v4.job.key)
    try:
        api.submit(engine, {"idempotency_key": f"{ctx.session}-4", "changelist_id": cl, "review_version": 3,
                            "recipients": REVIEWERS})
        raise AssertionError("v4 → v3 was not refused")
    except policy.VersionRegression as refused:
        refusal = str(refused).split(":")[0]
    assert _mine(ctx, cl, 3, REVIEWERS) == [1, 1, 1] and _mine(ctx, cl, 4, REVIEWERS) == [1, 1, 1]
    report.done += 1
    report.notes.append(f"{cl}: v3 → v3 no-op (prior result returned), v3 → v4 sent to all 3 again under new "
                        f"keys, v4 → v3 refused ({refusal}); one email per recipient per version")

    # 4. A row "marked sent" that the provider never saw (a send-after-mark bug): reconciled before any send.
    b = api.submit(engine, {"idempotency_key": f"{ctx.session}-5", "changelist_id": cl_b, "review_version": 1,
                            "recipients": REVIEWERS[:2]})
    table = repository.review_deliveries
    with engine.begin() as conn:
        victim = repository.deliveries_of(conn, b.job.id)[1]
        conn.execute(sa.update(table).where(table.c.id == victim.id)
                     .values(status="sent", notified_at=sa.func.now(), notification_id="msg_never_sent"))
    _settle(ctx, b.job.key)
    with engine.connect() as conn:
        alerted = conn.execute(sa.select(sa.func.count()).select_from(alerts)
                               .where(alerts.c.kind == "ordering_violation",
                                      alerts.c.entity_ref == policy.delivery_ref(b.job.key, victim.id))).scalar()
    assert alerted == 1 and _mine(ctx, cl_b, 1, REVIEWERS[:2]) == [1, 1]
    report.done += 1
    report.notes.append(f"{policy.delivery_ref(b.job.key, victim.id)}: marked sent, provider had nothing → "
                        "ORDERING_CONTRACT_VIOLATED alert (Slack), markers cleared, sent once")
    return report
