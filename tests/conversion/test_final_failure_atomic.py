"""Issue 13 §3: a job's `failed` state, its dead letter and its alert are written in one transaction."""

from __future__ import annotations

import sqlalchemy as sa

from redrive.schema import alerts, dead_letters
from tests.conversion.test_worker import job


def test_a_crash_while_writing_the_dead_letter_leaves_no_failed_job_without_it(engine, sandbox, submit,
                                                                               make_worker, clock) -> None:
    """The dead-letter insert fails (as a crash between two commits would cut it): the job is not left
    `failed` without its letter; once the database accepts it, the reclaimed job ends failed with exactly
    one dead letter and one alert."""
    job_id = submit()
    with engine.begin() as conn:  # the next dead-letter insert fails inside the worker's transaction
        conn.execute(sa.text("""
            CREATE FUNCTION boom() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'injected crash before the dead letter'; END $$;
            CREATE TRIGGER boom BEFORE INSERT ON dead_letters FOR EACH ROW EXECUTE FUNCTION boom();"""))
    sandbox.script("pdf.convert", {"status": 400, "error_code": "INVALID_MAPPING"},
                   {"status": 400, "error_code": "INVALID_MAPPING"})
    worker = make_worker()
    try:
        worker.step()
    except Exception:  # noqa: BLE001 - the injected crash may surface; what matters is what was written
        pass
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(dead_letters)).scalar_one() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(alerts)).scalar_one() == 0
    assert job(engine, job_id).status != "failed"  # all or nothing: no `failed` without its letter

    with engine.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER boom ON dead_letters; DROP FUNCTION boom();"))
    clock.advance(600)  # the lease lapses; the job is reclaimed and fails again, this time for good
    for _ in range(5):
        if job(engine, job_id).status == "failed":
            break
        make_worker().step()
    done = job(engine, job_id)
    assert (done.status, done.error_code, done.dead_letter) == ("failed", "GW_4XX", True)
    with engine.connect() as conn:
        letters = conn.execute(sa.select(dead_letters.c.entity_ref)).scalars().all()
        alert_rows = conn.execute(sa.select(sa.func.count()).select_from(alerts)).scalar_one()
    assert letters == [job_id] and alert_rows == 1
