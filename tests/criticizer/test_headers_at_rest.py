"""Issue 13 item 14: a webhook header from the environment is stored encrypted, and still reaches the webhook."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import sqlalchemy as sa
from cryptography.fernet import Fernet
from typer.testing import CliRunner

from assets.criticizer.cli import app
from assets.criticizer.repository import criticizer_requests, get, open_headers
from tests.criticizer.conftest import sandbox_url

SECRET = "Bearer hook-canary-3f9c21d0e7"


class Receiver(BaseHTTPRequestHandler):
    """The requester's webhook: a real HTTP server that keeps what it was sent."""

    received: list[dict[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", "0")))
        type(self).received.append({k.lower(): v for k, v in self.headers.items()})
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[str]:
    Receiver.received = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    server.shutdown()
    server.server_close()
    thread.join()


def test_header_from_env_is_sealed_at_rest_and_delivered(db_url, engine, sandbox, instance, cdefs, webhook,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`submit --header-from-env`: no row of the database holds the value; the webhook receives it."""
    monkeypatch.setenv("CRITICIZER_ARTIFACT_URL_PREFIXES", sandbox_url("/store/"))
    sandbox.put_store("reviews/sealed.py", b"def f():\n    return 1\n", "text/x-python")
    sandbox.set_default("llm", content=json.dumps({"verdict": "approve", "score": 9, "summary": "fine",
                                                   "findings": []}))
    out = CliRunner().invoke(app, ["submit", "--artifact-url", sandbox_url("/store/reviews/sealed.py"),
                                   "--rubric", "Any bugs?", "--webhook-url", webhook,
                                   "--header-from-env", "Authorization=HOOK_AUTH", "--request-id", "sealed"],
                             env={"DATABASE_URL": db_url, "HOOK_AUTH": SECRET}, catch_exceptions=False)
    assert out.exit_code == 0, out.output

    with engine.connect() as conn:
        stored = conn.execute(sa.select(sa.cast(criticizer_requests.c.webhook_headers, sa.Text))).scalar_one()
        whole_row = conn.execute(sa.text("SELECT row_to_json(r)::text FROM criticizer_requests r")).scalar_one()
    assert "Authorization" in stored
    assert "hook-canary" not in whole_row  # neither the header column nor any other one

    result = cdefs.resolve_job_def("criticizer_job").execute_in_process(instance=instance, raise_on_error=False)
    assert result.success and result.output_for_node("criticizer_drain")["done"] == 1
    assert [r["authorization"] for r in Receiver.received] == [SECRET]


def test_headers_sealed_under_another_key_are_a_config_error(engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deploy with the wrong REDRIVE_SECRETS_KEY cannot read them: a runtime/config bug, not a silent send."""
    from assets.criticizer import api

    monkeypatch.setenv("REDRIVE_SECRETS_KEY", Fernet.generate_key().decode())
    api.submit(engine, {"artifact_url": "http://store.test/a", "rubric": "?", "webhook_url": "http://hooks.test/a",
                        "webhook_headers": {"X-Api-Key": "k-1"}, "request_id": "rotated"},
               allowed_artifact_prefixes=())
    with engine.connect() as conn:
        row = get(conn, "rotated")
    assert row.delivery_headers() == {"X-Api-Key": "k-1"}
    monkeypatch.setenv("REDRIVE_SECRETS_KEY", Fernet.generate_key().decode())
    with pytest.raises(RuntimeError, match="REDRIVE_SECRETS_KEY"):
        open_headers(row.webhook_headers)
