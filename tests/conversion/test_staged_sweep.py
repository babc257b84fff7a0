"""Issue 13 §9: staged result files a killed worker left behind are removed; a live lease's file is kept."""

from __future__ import annotations

from datetime import timedelta

from assets.conversion import repository as repo


def test_orphaned_staged_results_are_swept_and_a_held_leases_file_is_kept(engine, files, submit, make_worker,
                                                                          clock) -> None:
    """A worker killed between staging and publishing leaves `.<job>.xml.e<epoch>.<pid>.tmp`. Once the job's
    lease moved on (reclaimed: a new epoch) that file can never be published, so the sweep deletes it; the
    file of a lease still held under its epoch may still complete and stays."""
    killed, held = submit(), submit()
    with engine.begin() as conn:
        leases = {lease.job_id: lease for lease in repo.claim_many(conn, "dead-worker", clock.now(), 90,
                                                                   "pdf-gateway", 2)}
    orphan = files.stage_result(killed, leases[killed].epoch, b"<xml/>")
    alive = files.stage_result(held, leases[held].epoch, b"<xml/>")
    clock.advance(91)  # the dead worker's leases expire; another worker reclaims `killed` (epoch + 1)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE conversion_jobs SET status = 'queued', lease_expires_at = NULL WHERE id = %s",
                             (killed,))
        [again] = repo.claim_many(conn, "live-worker", clock.now() + timedelta(seconds=1), 90, "pdf-gateway", 1)
    assert again.job_id == killed and again.epoch == leases[killed].epoch + 1

    swept = make_worker().sweep_staged()
    assert swept == 1
    assert not orphan.tmp.exists() and alive.tmp.exists()
    assert make_worker().sweep_staged() == 0  # nothing left to sweep
