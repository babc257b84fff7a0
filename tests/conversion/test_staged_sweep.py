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


def test_results_are_staged_outside_the_published_folder_and_an_old_workers_leftover_is_swept(
        engine, files, submit, make_worker, clock) -> None:
    """Staged files live in RESULTS_DIR/.staging, so the sweep lists the results in flight, not every result
    ever published. A file an older worker staged in RESULTS_DIR itself is still swept, by a worker's first sweep."""
    job = submit()
    with engine.begin() as conn:
        [lease] = repo.claim_many(conn, "dead-worker", clock.now(), 90, "pdf-gateway", 1)
    staged = files.stage_result(job, lease.epoch, b"<xml/>")
    assert staged.tmp.parent == files.staging and staged.tmp.parent != staged.final.parent
    assert [p.name for p in files.results.iterdir()] == [files.staging.name]  # nothing half-written in view

    legacy = files.results / staged.tmp.name.replace(f".e{lease.epoch}.", f".e{lease.epoch - 1}.")
    legacy.write_bytes(b"<xml/>")  # an epoch that can never complete, where workers staged before
    published = files.results / "00000000-0000-0000-0000-000000000000.xml"
    published.write_bytes(b"<xml/>")
    worker = make_worker()
    assert worker.sweep_staged() == 1
    assert not legacy.exists() and staged.tmp.exists() and published.exists()
    legacy.write_bytes(b"<xml/>")
    assert worker.sweep_staged() == 0 and legacy.exists()  # the results folder is listed once per process
