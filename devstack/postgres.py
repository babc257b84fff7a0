"""The embedded PostgreSQL: pgserver's binaries in a data folder of the project's own.

pgserver starts PostgreSQL on a Unix socket inside the data folder (no TCP port,
so two checkouts never collide) and reuses an initialised folder on the next start.
We own stopping it: `stop()` runs `pg_ctl stop -m fast`, so nothing is left running
after `make demo` or `make test`, even when an earlier process died without cleanup.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class EmbeddedPostgres:
    """One server per data folder, shared by every process that `start`s it.

    Users are counted in a pid file under a lock: the last one to `stop` stops the
    server, and pids of processes that died without stopping are pruned, so two test
    sessions (or the demo and a CLI call) never pull the server from under each other.
    """

    data_dir: Path
    started_here: bool = False
    _server: object | None = None

    @property
    def _users_file(self) -> Path:
        return self.data_dir.parent / f".{self.data_dir.name}.users.json"

    def _update_users(self, change: int) -> list[int]:
        import fasteners
        import psutil

        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with fasteners.InterProcessLock(str(self._users_file) + ".lock"):
            users = json.loads(self._users_file.read_text()) if self._users_file.exists() else []
            users = [p for p in users if p != os.getpid() and psutil.pid_exists(p)]
            if change > 0:
                users.append(os.getpid())
            self._users_file.write_text(json.dumps(users))
            return users

    @property
    def pgdata(self) -> Path:
        return self.data_dir

    def start(self) -> str:
        """Start (or join) the server and return a psycopg2 URL to its `postgres` database."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs: XDG_RUNTIME_DIR unset on CI
            import pgserver
            from pgserver.utils import PostmasterInfo

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._update_users(+1)
        before = PostmasterInfo.read_from_pgdata(self.data_dir)
        already_running = before is not None and before.is_running()
        self._server = pgserver.get_server(self.data_dir, cleanup_mode=None)
        self.started_here = not already_running
        return self.url("postgres")

    def url(self, database: str) -> str:
        info = self._server.get_postmaster_info()  # type: ignore[union-attr]
        return f"postgresql+psycopg2://postgres@/{database}?host={info.socket_dir}"

    def stop(self) -> None:
        """Leave the server; the last user stops it (and clears pgserver's handle list)."""
        from pgserver import _commands
        from pgserver.utils import PostmasterInfo

        if self._update_users(-1):
            return  # another live process still uses it

        info = PostmasterInfo.read_from_pgdata(self.data_dir)
        if info is not None and info.is_running():
            user = getattr(self._server, "system_user", None) if self._server else None
            if user is None and os.geteuid() == 0:
                user = "pgserver"
            try:
                _commands.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.data_dir, user=user, timeout=30)
            except Exception:  # noqa: BLE001 - fall back to signalling the postmaster
                log.warning("pg_ctl stop failed; terminating postmaster %s", info.pid)
                with contextlib.suppress(Exception):
                    info.process.terminate()
                    info.process.wait(10)
        handles = self.data_dir / ".handle_pids.json"
        if handles.exists():
            handles.write_text(json.dumps([]))


def create_database(admin_url: str, name: str, template: str | None = None) -> None:
    """CREATE DATABASE if it does not exist (autocommit, as PostgreSQL requires)."""
    import sqlalchemy as sa

    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            exists = conn.execute(sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).scalar()
            if not exists:
                tmpl = f' TEMPLATE "{template}"' if template else ""
                conn.execute(sa.text(f'CREATE DATABASE "{name}"{tmpl}'))
    finally:
        engine.dispose()


def drop_database(admin_url: str, name: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


def with_database(url: str, database: str) -> str:
    """The same server URL pointing at another database."""
    from sqlalchemy.engine import make_url

    return make_url(url).set(database=database).render_as_string(hide_password=False)
