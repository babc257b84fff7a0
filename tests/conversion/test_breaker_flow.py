"""003 §3.3 end to end: forced gateway faults open the breaker, the queue is held, the sandbox's recovery closes it."""

from __future__ import annotations

import sqlalchemy as sa

from assets.conversion import repository as repo
from redrive.breaker import CircuitBreaker
from redrive.schema import alerts, dead_letters


def counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return repo.status_counts(conn)


def test_breaker_opens_holds_the_queue_and_resumes_when_the_gateway_recovers(
        engine, sandbox, submit, make_worker, clock, conv_settings) -> None:
    """10 failing calls (>= 50 %) open it for every worker; nothing is dispatched; a healthy probe resumes all jobs."""
    ids = []
    for _ in range(15):
        ids.append(submit())
        clock.advance(0.001)
    sandbox.random_faults("pdf.convert", seed=1, rates={"503": 1.0})
    sandbox.random_faults("pdf.health", seed=1, rates={"503": 1.0})
    two_in_flight = conv_settings.model_copy(update={"worker_concurrency": 2})
    a, b = make_worker(worker_id="a", settings=two_in_flight), make_worker(worker_id="b", settings=two_in_flight)

    for i in range(5):  # two jobs in flight per turn: ten calls
        assert (a if i % 2 else b).step() == "processed"
    assert CircuitBreaker(engine, "pdf-gateway", conv_settings.breaker_policy(), clock).state().is_open
    calls = len(sandbox.requests("pdf.convert"))
    assert calls == 10
    with engine.connect() as conn:
        opened = conn.execute(sa.select(alerts).where(alerts.c.kind == "breaker_open")).all()
    assert len(opened) == 1 and sandbox.count("slack.message") == 1

    # held: both workers dispatch nothing, due jobs stay queued, no attempt is spent
    for _ in range(3):
        assert a.step() == "held" and b.step() == "held"
    assert len(sandbox.requests("pdf.convert")) == calls
    assert counts(engine) == {"queued": 15}

    clock.advance(1.0)  # CIRCUIT_COOLDOWN_MS=1000: one probe, the gateway is still down
    assert a.step() == "held" and b.step() == "held"
    assert len(sandbox.requests("pdf.health")) == 1

    sandbox.stop_random_faults("pdf.convert")
    sandbox.stop_random_faults("pdf.health")  # the sandbox recovers
    clock.advance(1.0)
    for _ in range(200):
        if counts(engine) == {"succeeded": 15}:
            break
        a.step(), b.step()
        clock.advance(20)  # the 10 retries were scheduled 5–10 s out
    assert counts(engine) == {"succeeded": 15}
    assert len(sandbox.requests("pdf.health")) == 2  # one failed probe, one that closed it
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar() == 0
        attempts = dict(conn.execute(sa.select(repo.conversion_jobs.c.attempt_count, sa.func.count())
                                     .group_by(repo.conversion_jobs.c.attempt_count)).all())
    assert attempts == {2: 10, 1: 5}  # only the 10 calls before it opened cost an attempt
    state = CircuitBreaker(engine, "pdf-gateway", conv_settings.breaker_policy(), clock).state()
    assert not state.is_open and state.open_seconds_total >= 2.0


def test_4xx_answers_never_open_the_breaker(engine, sandbox, submit, make_worker, clock) -> None:
    """Twenty 400s fail twenty jobs as GW_4XX, but the gateway is healthy: the breaker stays closed."""
    for _ in range(20):
        submit()
    sandbox.random_faults("pdf.convert", seed=2, rates={"400": 1.0})
    worker = make_worker()
    turns = 0
    while worker.step() == "processed":
        turns += 1
    assert turns == 5  # WORKER_CONCURRENCY=4 jobs per turn
    assert counts(engine) == {"failed": 20}
    assert worker.breaker.allows()
