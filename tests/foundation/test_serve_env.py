"""Issue 27 §3: `make serve` tells an operator every endpoint, writes them where runbooks and `redrive` find them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from devstack import serve_env
from devstack.__main__ import endpoint_lines
from devstack.topology import Topology


def test_the_env_file_round_trips_and_is_shell_sourceable(tmp_path: Path) -> None:
    """What is written parses back, and `sh` sourcing it sees the same values (quoting included)."""
    values = {"DAGSTER_UI_URL": "http://127.0.0.1:4321", "DATABASE_URL": "postgresql://u:p@/redrive?host=/tmp/a b"}
    path = tmp_path / "serve.env"
    serve_env.write(path, values, pid=os.getpid())
    assert serve_env.parse(path.read_text()) == {serve_env.PID_KEY: str(os.getpid()), **values}
    shown = subprocess.run(["sh", "-c", f'set -a; . "{path}"; set +a; printf "%s|%s" "$DAGSTER_UI_URL" "$DATABASE_URL"'],
                           capture_output=True, text=True, check=True).stdout
    assert shown == f"{values['DAGSTER_UI_URL']}|{values['DATABASE_URL']}"
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_file_of_a_serve_that_is_gone_is_not_running(tmp_path: Path) -> None:
    """The serve process named in the file must be alive; `remove` leaves another serve's file alone."""
    path = tmp_path / "serve.env"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    serve_env.write(path, {"DATABASE_URL": "postgresql://x"}, pid=dead.pid)
    assert serve_env.running(path) is None
    serve_env.remove(path)
    assert path.exists()  # not this process's file
    serve_env.write(path, {"DATABASE_URL": "postgresql://x"})
    assert serve_env.running(path)["DATABASE_URL"] == "postgresql://x"
    serve_env.remove(path)
    assert not path.exists() and serve_env.running(path) is None


def test_every_endpoint_is_printed_and_the_ui_url_is_the_webservers(tmp_path: Path) -> None:
    """The services get DAGSTER_UI_URL = this topology's webserver (alert links), and the printout names the UI,
    conversion, metrics, sandbox, S3 and database endpoints and the env file."""
    topology = Topology(home=tmp_path / "home", env={"DATABASE_URL": "postgresql://db", "SANDBOX_URL": "http://sb",
                                                     "AWS_ENDPOINT_URL": "http://s3", "DAGSTER_PG_URL": "postgresql://d"})
    topology.values = {"host": "127.0.0.1", "webserver_port": "3111", "api_port": "3112", "metrics_port": "3113",
                       "console_port": "3114"}
    assert topology._child_env()["DAGSTER_UI_URL"] == "http://127.0.0.1:3111"
    endpoints = topology.endpoints()
    assert endpoints == {"DAGSTER_UI_URL": "http://127.0.0.1:3111", "CONVERSION_API": "http://127.0.0.1:3112",
                         "METRICS_URL": "http://127.0.0.1:3113/metrics", "DLQ_CONSOLE_URL": "http://127.0.0.1:3114",
                         "SANDBOX_URL": "http://sb",
                         "AWS_ENDPOINT_URL": "http://s3", "DATABASE_URL": "postgresql://db",
                         "DAGSTER_PG_URL": "postgresql://d", "DAGSTER_HOME": str(tmp_path / "home")}
    text = endpoint_lines(endpoints, tmp_path / "serve.env", tmp_path / "logs")
    for key, _ in serve_env.ENDPOINTS:
        assert f"{key}" in text and endpoints[key] in text
    assert f". {tmp_path / 'serve.env'}" in text
    proxied = Topology(home=tmp_path / "home", env={"DAGSTER_UI_URL": "https://dagster.example.com"})
    proxied.values = topology.values
    assert proxied._child_env()["DAGSTER_UI_URL"] == "https://dagster.example.com"  # a caller's own URL wins


def test_redrive_uses_the_running_serves_database_without_starting_one(tmp_path: Path, db_url: str,
                                                                      engine) -> None:
    """No DATABASE_URL: `redrive dlq list` reads the running serve's env file and answers from its database,
    starting no embedded server (no pg folder appears in the data dir)."""
    from datetime import UTC, datetime

    from redrive import deadletters
    from redrive.failures import Code, Failure

    with engine.begin() as conn:
        deadletters.record(conn, deadletters.FinalFailure(pipeline="criticizer", stage="llm", entity_ref="served-1",
                                                          failure=Failure.of(Code.AUTH_DENIED), attempts=1,
                                                          at=datetime.now(UTC)))
    serve_env.write(tmp_path / serve_env.FILE_NAME, {"DATABASE_URL": db_url})
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"REDRIVE_DATA_DIR": str(tmp_path)}
    exe = Path(sys.executable).parent / "redrive"
    done = subprocess.run([str(exe), "dlq", "list"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "served-1" in done.stdout
    assert not (tmp_path / "pg").exists()
