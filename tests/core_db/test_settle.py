"""The core settlement of a failed entity (`redrive.settle`), on real PostgreSQL: a retry writes the
pipeline's due time; a final failure writes the pipeline's state, the dead letter and its alert in one
transaction, so a crash inside leaves none of them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from redrive.backoff import FixedSchedule, FullJitter
from redrive.clock import FrozenClock
from redrive.failures import Code, Failure
from redrive.reliability import Reliability
from redrive.settle import Budget, Verdict, settle

START = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
BUDGET = Budget(max_attempts=3, backoff=FixedSchedule((30.0, 120.0)))
SECRET = "sk-live-4f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c"


@pytest.fixture
def rt(engine: sa.Engine) -> Reliability:
    """A runtime on the test's database, with a pipeline's own state table (one row per entity)."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE demo_jobs (id text PRIMARY KEY, status text NOT NULL, "
                             "due_at timestamptz, error text)"))
        conn.execute(sa.text("INSERT INTO demo_jobs VALUES ('job-1', 'running', NULL, NULL)"))
    return Reliability(engine=engine, clock=FrozenClock(START), time_scale=0.5)


def job(engine: sa.Engine) -> tuple[str, datetime | None, str | None]:
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text("SELECT status, due_at, error FROM demo_jobs WHERE id = 'job-1'")).one())


def letters_and_alerts(engine: sa.Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (conn.execute(sa.text("SELECT count(*) FROM dead_letters")).scalar_one(),
                conn.execute(sa.text("SELECT count(*) FROM alerts")).scalar_one())


def retry_write(conn: sa.Connection, verdict: Verdict) -> bool:
    conn.execute(sa.text("UPDATE demo_jobs SET status = 'queued', due_at = :due, error = :error WHERE id = 'job-1'"),
                 {"due": verdict.due_at, "error": verdict.error})
    return True


def fail_write(conn: sa.Connection, verdict: Verdict) -> bool:
    """The pipeline's `failed`, refused when the job is no longer running (fenced, or finished meanwhile)."""
    return conn.execute(sa.text("UPDATE demo_jobs SET status = 'failed', error = :error "
                                "WHERE id = 'job-1' AND status = 'running'"), {"error": verdict.error}).rowcount == 1


def run(rt: Reliability, failure: Failure, attempt: int, **kw):
    args = {"pipeline": "demo", "stage": "send", "entity_ref": "job-1", "failure": failure, "attempt": attempt,
            "budget": BUDGET, "on_retry": retry_write, "on_final": fail_write,
            "final": lambda v: v.final_failure(tenant="acme", context={"job": "job-1"}), **kw}
    return settle(rt, **args)


def test_a_retryable_failure_with_budget_left_writes_the_scaled_due_time_and_no_letter(rt, engine) -> None:
    """Attempt 2 of 3 failing on a 503: due 120 s × time scale 0.5 later, the error sanitized, no dead letter."""
    failure = Failure.of(Code.UPSTREAM_UNAVAILABLE, message=f"gateway said 503 for key {SECRET}")
    settled = run(rt, failure, 2)
    assert settled.outcome == "retried" and settled.recorded is None
    assert settled.verdict.wait == 60.0
    status, due_at, error = job(engine)
    assert status == "queued" and due_at == START + timedelta(seconds=60)
    assert SECRET not in error and error.startswith(failure.code)
    assert SECRET not in settled.verdict.public and "send attempt 2/3 of job-1" in settled.verdict.public
    assert letters_and_alerts(engine) == (0, 0)


@pytest.mark.parametrize(("code", "attempt", "reason"), [(Code.UPSTREAM_UNAVAILABLE, 3, "exhausted"),
                                                         (Code.BAD_REQUEST, 1, "permanent")])
def test_a_final_failure_writes_state_letter_and_alert_together(rt, engine, code, attempt, reason) -> None:
    """Out of budget, or permanent at once: the job `failed`, one dead letter with the pipeline's context, one alert."""
    settled = run(rt, Failure.of(code), attempt)
    assert settled.outcome == "dead_lettered" and settled.verdict.decision.reason == reason
    assert job(engine)[0] == "failed"
    assert letters_and_alerts(engine) == (1, 1)
    with engine.connect() as conn:
        letter = conn.execute(sa.text("SELECT id, entity_ref, stage, tenant, attempts FROM dead_letters")).one()
    assert letter == (settled.dead_letter_id, "job-1", "send", "acme", attempt)


@pytest.mark.parametrize("crash_in", ["state_write", "dead_letter_context"])
def test_a_crash_inside_the_final_transaction_leaves_neither(rt, engine, crash_in) -> None:
    """An exception after the pipeline's `failed` write (in it, or while the dead letter is built) rolls all back:
    the job is still running, no dead letter, no alert; settled again, all three are written once."""
    def crashing_write(conn: sa.Connection, verdict: Verdict) -> bool:
        fail_write(conn, verdict)
        raise ConnectionError("the process died mid-transaction")

    def crashing_final(verdict: Verdict):
        raise ConnectionError("the process died mid-transaction")

    crash = {"on_final": crashing_write} if crash_in == "state_write" else {"final": crashing_final}
    with pytest.raises(ConnectionError):
        run(rt, Failure.of(Code.BAD_REQUEST), 1, **crash)
    assert job(engine) == ("running", None, None)
    assert letters_and_alerts(engine) == (0, 0)
    assert run(rt, Failure.of(Code.BAD_REQUEST), 1).outcome == "dead_lettered"
    assert job(engine)[0] == "failed" and letters_and_alerts(engine) == (1, 1)


def test_a_refused_state_write_writes_no_dead_letter(rt, engine) -> None:
    """The entity finished meanwhile (or its lease was fenced): the pipeline refuses, so no letter, no alert."""
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE demo_jobs SET status = 'succeeded' WHERE id = 'job-1'"))
    settled = run(rt, Failure.of(Code.BAD_REQUEST), 1)
    assert settled.outcome == "refused" and settled.dead_letter_id is None
    assert job(engine)[0] == "succeeded" and letters_and_alerts(engine) == (0, 0)


def test_no_later_attempt_makes_a_retryable_failure_final(rt, engine) -> None:
    """A caller whose in-process retries are spent passes no retry write: a 503 on attempt 1 is dead-lettered."""
    settled = run(rt, Failure.of(Code.UPSTREAM_UNAVAILABLE), 1, on_retry=None)
    assert settled.outcome == "dead_lettered" and settled.verdict.decision.reason == "exhausted"
    assert job(engine)[0] == "failed" and letters_and_alerts(engine) == (1, 1)


def test_a_repeated_final_failure_is_one_letter_and_one_alert(rt, engine) -> None:
    """Settled twice (a re-executed run), the core's dedupe keeps one dead letter and one alert."""
    first = run(rt, Failure.of(Code.BAD_REQUEST), 1)
    again = run(rt, Failure.of(Code.BAD_REQUEST), 1, on_final=lambda conn, v: True)
    assert again.dead_letter_id == first.dead_letter_id and not again.recorded.created
    assert letters_and_alerts(engine) == (1, 1)


def test_jitter_is_drawn_per_entity_stage_and_attempt(rt, engine) -> None:
    """The same key draws the same delay (reproducible), another entity another one (spread)."""
    budget = Budget(max_attempts=5, backoff=FullJitter(initial=1.0, max_delay=600.0))
    waits = {ref: run(rt, Failure.of(Code.UPSTREAM_UNAVAILABLE), 4, budget=budget, entity_ref=ref,
                      on_retry=lambda conn, v: True).verdict.wait for ref in ("a", "b", "c", "a")}
    again = run(rt, Failure.of(Code.UPSTREAM_UNAVAILABLE), 4, budget=budget, entity_ref="a",
                on_retry=lambda conn, v: True).verdict.wait
    assert waits["a"] == again
    assert len(set(waits.values())) == 3


def test_a_final_transaction_that_fails_at_commit_leaves_no_dead_letter_either(rt, engine) -> None:
    """The dead letter and alert share the entity's transaction: when that transaction fails at COMMIT (here a
    deferred constraint the pipeline's write broke), no letter or alert survives it (issue 25: a letter written
    in a transaction of its own would)."""
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE demo_outbox (job text, CONSTRAINT uq_demo_outbox UNIQUE (job) "
                             "DEFERRABLE INITIALLY DEFERRED)"))

    def write_then_break_at_commit(conn: sa.Connection, verdict: Verdict) -> bool:
        conn.execute(sa.text("INSERT INTO demo_outbox VALUES ('job-1'), ('job-1')"))  # checked at COMMIT only
        return fail_write(conn, verdict)

    with pytest.raises(sa.exc.IntegrityError):
        run(rt, Failure.of(Code.BAD_REQUEST), 1, on_final=write_then_break_at_commit)
    assert job(engine) == ("running", None, None)
    assert letters_and_alerts(engine) == (0, 0)
