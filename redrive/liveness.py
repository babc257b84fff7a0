"""Liveness of run workers: a heartbeat from every run, a watchdog's verdict, and a fence (issue 25).

A run worker that dies while PostgreSQL is away, or whose backend is terminated as it reports,
cannot tell Dagster it failed; Dagster's DefaultRunLauncher cannot check a STARTED run's process,
so such a run would stay STARTED for ever and the due-work sensor would wait on it. So:
- every run worker beats (`Heartbeat`: a daemon thread, apart from the work, so a run inside one
  long LLM call still beats) into `run_heartbeats`, keyed by its holder name `run:<run id>`, the
  same name the drain leases work rows under;
- the watchdog (`sensors.core.run_watchdog_sensor`) asks `silent_runs` which STARTED runs have not
  beaten for `dead_after` seconds, counted from the latest of their last beat, their start and the
  database's own start (a PostgreSQL restart silences every run for a while: living runs get a full
  window to beat again), marks each one dead (`declare_dead`, which gives its leased rows back, due
  now, in the same transaction) and fails it through Dagster's instance API;
- a dead holder never writes again: its beat is refused (`beat` returns False) and every claim,
  extension and settlement of the work queue checks `holder_alive` in its own transaction
  (`redrive.work`), so a slow run wrongly thought dead cannot settle an entity the next run took.
Policy (`is_silent`) is pure; the SQL is here; the thread and the sensor apply them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert

from redrive.schema import run_heartbeats

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10.0  # a run worker beats this often
DEAD_AFTER_SECONDS = 120.0  # and is dead after this much silence (12 missed beats)


def holder_of(run_id: str) -> str:
    """The name a run holds leases and beats under (the drain's lease owner)."""
    return f"run:{run_id}"


# --- policy ---------------------------------------------------------------------------------------

def is_silent(*, last_beat: datetime | None, started: datetime, database_up_since: datetime | None,
              now: datetime, dead_after: float) -> bool:
    """Pure: the run has had `dead_after` seconds in which it could have beaten, and did not.

    Silence counts from its last beat (its start, before the first), or from the database's start if later (a beat
    cannot land while the database is down; the window starts again when it is back). A database
    start time in the future (a test's clock runs behind the server's) is ignored.
    """
    since = last_beat if last_beat is not None else started  # a beat proves it started; before one, its start
    if database_up_since is not None and database_up_since <= now:
        since = max(since, database_up_since)
    return (now - since).total_seconds() > dead_after


# --- SQL ----------------------------------------------------------------------------------------

def beat(conn: sa.Connection, holder: str, run_id: str, *, now: datetime) -> bool:
    """Record that `holder` is alive now. False: it was declared dead, and must stop writing."""
    stmt = insert(run_heartbeats).values(holder=holder, run_id=run_id, started_at=now, beat_at=now)
    stmt = stmt.on_conflict_do_update(index_elements=["holder"], set_={"beat_at": now},
                                      where=run_heartbeats.c.dead_at.is_(None))
    return conn.execute(stmt.returning(run_heartbeats.c.holder)).first() is not None


def holder_alive(owner: sa.ColumnElement[str] | str) -> sa.ColumnElement[bool]:
    """SQL: `owner` (a lease owner column or name) has not been declared dead. A holder that never beat
    (a worker outside Dagster, a test) is alive."""
    return ~sa.exists().where(run_heartbeats.c.holder == owner, run_heartbeats.c.dead_at.is_not(None))


def is_dead(conn: sa.Connection, holder: str) -> bool:
    return conn.execute(sa.select(run_heartbeats.c.dead_at).where(run_heartbeats.c.holder == holder)).scalar() \
        is not None


def last_beats(conn: sa.Connection, run_ids: Iterable[str]) -> dict[str, tuple[datetime, datetime | None]]:
    """(last beat, dead at) of these runs, by run id; runs that never beat are absent."""
    ids = list(run_ids)
    if not ids:
        return {}
    rows = conn.execute(sa.select(run_heartbeats.c.run_id, run_heartbeats.c.beat_at, run_heartbeats.c.dead_at)
                        .where(run_heartbeats.c.holder.in_([holder_of(i) for i in ids])))
    return {r.run_id: (r.beat_at, r.dead_at) for r in rows}


def database_started(conn: sa.Connection) -> datetime:
    return conn.execute(sa.text("SELECT pg_postmaster_start_time()")).scalar_one()


def declare_dead(conn: sa.Connection, run_id: str, *, reason: str, now: datetime,
                 release: Callable[[sa.Connection, str, datetime], int]) -> int | None:
    """Mark the run dead (fencing every later write of it) and give its leased rows back, due now, in this
    transaction. The number of rows given back; None if it was already dead (another watchdog was first)."""
    holder = holder_of(run_id)
    stmt = insert(run_heartbeats).values(holder=holder, run_id=run_id, started_at=now, beat_at=now, dead_at=now,
                                         dead_reason=reason[:300])
    stmt = stmt.on_conflict_do_update(index_elements=["holder"], set_={"dead_at": now, "dead_reason": reason[:300]},
                                      where=run_heartbeats.c.dead_at.is_(None))
    if conn.execute(stmt.returning(run_heartbeats.c.holder)).first() is None:
        return None
    return release(conn, holder, now)


def prune(conn: sa.Connection, *, older_than: datetime, keep: Iterable[str] = ()) -> int:
    """Forget heartbeats of runs long over (bounded: the watchdog calls it each tick)."""
    keep_ids = [holder_of(i) for i in keep]
    q = sa.delete(run_heartbeats).where(run_heartbeats.c.beat_at < older_than)
    if keep_ids:
        q = q.where(run_heartbeats.c.holder.not_in(keep_ids))
    return conn.execute(q).rowcount


@dataclass(frozen=True)
class Silent:
    run_id: str
    last_beat: datetime | None
    silent_seconds: float


def silent_runs(conn: sa.Connection, started: Mapping[str, datetime], *, now: datetime,
                dead_after: float) -> list[Silent]:
    """Of these STARTED runs (run id → start time), those silent for longer than `dead_after`."""
    beats = last_beats(conn, started)
    up_since = database_started(conn)
    out = []
    for run_id, start in started.items():
        last, dead_at = beats.get(run_id, (None, None))
        if dead_at is not None or is_silent(last_beat=last, started=start, database_up_since=up_since, now=now,
                                            dead_after=dead_after):
            since = last if last is not None else start
            out.append(Silent(run_id, last, (now - since).total_seconds()))
    return out


# --- the run worker's side ------------------------------------------------------------------------

class Heartbeat:
    """A daemon thread beating for one run until stopped; `fenced` is set once the run was declared dead.

    One per run per process (`start_for_run`), however many resources ask for it.
    """

    def __init__(self, engine: sa.Engine, run_id: str, *, interval: float = HEARTBEAT_SECONDS,
                 now: Callable[[], datetime]) -> None:
        self.engine, self.run_id, self.interval, self.now = engine, run_id, interval, now
        self.holder = holder_of(run_id)
        self.fenced = threading.Event()
        self.on_fenced: list[Callable[[], None]] = []  # e.g. a worker's "stop claiming, finish or give back"
        self._stop = threading.Event()
        self._users = 0
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{run_id[:8]}", daemon=True)

    def beat_once(self) -> bool:
        try:
            with self.engine.begin() as conn:
                alive = beat(conn, self.holder, self.run_id, now=self.now())
        except Exception:  # noqa: BLE001 - a missed beat is what the watchdog's window allows for
            log.warning("run %s: heartbeat failed; retrying in %.0f s", self.run_id, self.interval)
            return True
        if not alive and not self.fenced.is_set():
            log.error("run %s was declared dead by the watchdog: it writes nothing more", self.run_id)
            for callback in self.on_fenced:
                try:
                    callback()
                except Exception:  # noqa: BLE001 - the fence holds whatever a callback does
                    log.warning("run %s: a fenced callback failed", self.run_id)
            self.fenced.set()  # after the callbacks: whoever sees it set knows they ran
        return alive

    def _loop(self) -> None:
        while self.beat_once() and not self._stop.wait(self.interval):
            pass

    def stop(self) -> None:
        self._stop.set()


_running: dict[str, Heartbeat] = {}
_lock = threading.Lock()


def start_for_run(engine: sa.Engine, run_id: str, *, interval: float = HEARTBEAT_SECONDS,
                  now: Callable[[], datetime]) -> Heartbeat:
    """The run's heartbeat in this process, started on first use; `stop_for_run` once per call."""
    with _lock:
        hb = _running.get(run_id)
        if hb is None:
            hb = _running[run_id] = Heartbeat(engine, run_id, interval=interval, now=now)
            hb._thread.start()
        hb._users += 1
        return hb


def stop_for_run(run_id: str) -> None:
    with _lock:
        hb = _running.get(run_id)
        if hb is None:
            return
        hb._users -= 1
        if hb._users <= 0:
            hb.stop()
            del _running[run_id]


def fenced(run_id: str | None) -> bool:
    """This process learnt that the run was declared dead (its next claim would be refused anyway)."""
    if run_id is None:
        return False
    with _lock:
        hb = _running.get(run_id)
    return hb is not None and hb.fenced.is_set()


def when_fenced(run_id: str | None, callback: Callable[[], None]) -> bool:
    """Call `callback` once if this process learns that the run was declared dead (a worker loop that is not the
    drain stops claiming; its writes are fenced by its own leases). False: no heartbeat runs here for it."""
    if run_id is None:
        return False
    with _lock:
        hb = _running.get(run_id)
        if hb is not None:
            hb.on_fenced.append(callback)
    return hb is not None


def stale_before(now: datetime, days: float = 1.0) -> datetime:
    return now - timedelta(days=days)
