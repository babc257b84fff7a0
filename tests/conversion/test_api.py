"""The HTTP API (003 §3.6): uploads checked by content, owner-scoped jobs and retry, one-line canonical errors."""

from __future__ import annotations

import http.server
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient
from werkzeug.http import parse_options_header

from assets.conversion import repository as repo
from assets.conversion.api import BANNER, create_app
from redrive.breaker import CircuitBreaker
from redrive.schema import dead_letters
from redrive.vocabularies import CONVERSION_PUBLIC_CODES
from tests.conversion.conftest import job, make_pdf


@pytest.fixture
def tokens(engine: sa.Engine) -> dict[str, str]:
    with engine.begin() as conn:
        return {who: repo.create_token(conn, who) for who in ("alice", "bob")}


@pytest.fixture
def client(engine, conv_settings, clock) -> TestClient:
    return TestClient(create_app(engine, conv_settings, clock), raise_server_exceptions=False)


def auth(tokens: dict[str, str], who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tokens[who]}"}


def assert_one_line_error(response, status: int, code: str, tmp_path=None) -> None:
    assert response.status_code == status
    body = response.json()
    assert set(body) == {"error", "message"} and body["error"] == code and code in CONVERSION_PUBLIC_CODES
    assert "\n" not in body["message"] and "Traceback" not in response.text
    if tmp_path is not None:
        assert str(tmp_path) not in response.text


def upload(client, tokens, who="alice", body: bytes | None = None, name="report.pdf"):
    return client.post("/api/jobs", content=make_pdf() if body is None else body,
                       headers={**auth(tokens, who), "Content-Type": "application/pdf", "X-Filename": name})


def test_upload_list_get_and_download_the_result(client, tokens, make_worker, engine) -> None:
    """A PDF upload is queued, listed for its owner only, converted by a worker and downloadable as XML."""
    created = upload(client, tokens, name="Q3%20report.pdf")
    assert created.status_code == 201
    job_id = created.json()["id"]
    assert created.json()["status"] == "queued" and created.json()["filename"] == "Q3 report.pdf"
    assert [j["id"] for j in client.get("/api/jobs", headers=auth(tokens, "alice")).json()["jobs"]] == [job_id]
    assert client.get("/api/jobs", headers=auth(tokens, "bob")).json()["jobs"] == []
    assert_one_line_error(client.get(f"/api/jobs/{job_id}/result", headers=auth(tokens, "alice")), 409, "NOT_READY")

    assert make_worker().step() == "processed"
    shown = client.get(f"/api/jobs/{job_id}", headers=auth(tokens, "alice")).json()
    assert shown["status"] == "succeeded" and shown["resultUrl"] == f"/api/jobs/{job_id}/result"
    xml = client.get(shown["resultUrl"], headers=auth(tokens, "alice"))
    assert xml.status_code == 200 and xml.headers["content-type"].startswith("application/xml")
    assert xml.content.startswith(b"<document") and b"Hello" in xml.content


def test_uploads_are_validated_by_content_not_by_name(client, tokens, conv_settings, tmp_path, engine) -> None:
    """A PNG called .pdf is NOT_PDF, a PDF called .txt is accepted, an oversized body is TOO_LARGE; nothing is stored."""
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 64
    assert_one_line_error(upload(client, tokens, body=png, name="scan.pdf"), 415, "NOT_PDF", tmp_path)
    assert_one_line_error(upload(client, tokens, body=b"", name="empty.pdf"), 415, "NOT_PDF", tmp_path)
    assert upload(client, tokens, name="notes.txt").status_code == 201
    small = TestClient(create_app(engine, conv_settings.model_copy(update={"upload_max_bytes": 100})),
                       raise_server_exceptions=False)
    assert_one_line_error(upload(small, tokens, body=make_pdf("x" * 200)), 413, "TOO_LARGE", tmp_path)
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(repo.conversion_jobs)).scalar() == 1
    assert len(list(conv_settings.uploads_dir.iterdir())) == 1


def test_without_a_valid_token_nothing_is_answered(client, tokens) -> None:
    """No token, a wrong scheme or an unknown token: 401 FORBIDDEN, same for every route."""
    for headers in ({}, {"Authorization": f"Basic {tokens['alice']}"}, {"Authorization": "Bearer nope"}):
        assert_one_line_error(client.get("/api/jobs", headers=headers), 401, "FORBIDDEN")
        assert_one_line_error(client.post("/api/jobs", content=make_pdf(), headers=headers), 401, "FORBIDDEN")


def failed_job(engine, client, tokens, sandbox, make_worker, who="alice") -> str:
    job_id = upload(client, tokens, who).json()["id"]
    sandbox.script("pdf.convert", {"status": 400})
    assert make_worker().step() == "processed"
    assert job(engine, job_id).status == "failed"
    return job_id


def test_owner_retry_requeues_and_the_next_success_closes_the_dead_letter(client, tokens, engine, sandbox,
                                                                          make_worker) -> None:
    """003 §3.6: the owner's retry resets the error, zeroes attemptCount, bumps queuedAt; success resolves the dead letter."""
    job_id = failed_job(engine, client, tokens, sandbox, make_worker)
    before = job(engine, job_id)
    response = client.post(f"/api/jobs/{job_id}/retry", headers=auth(tokens, "alice"))
    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["attemptCount"], body["errorCode"], body["deadLetter"]) == ("queued", 0, None, False)
    after = job(engine, job_id)
    assert after.queued_at >= before.queued_at and after.retry_after is None
    assert_one_line_error(client.post(f"/api/jobs/{job_id}/retry", headers=auth(tokens, "alice")), 409, "NOT_READY")

    assert make_worker().step() == "processed"
    assert job(engine, job_id).status == "succeeded"
    with engine.connect() as conn:
        letter = conn.execute(sa.select(dead_letters)).one()
    assert letter.status == "resolved" and letter.entity_ref == job_id
    # the record says what happened: the owner's Retry, then the work completed; no replay was asked for
    assert [(n["kind"], n["by"]) for n in letter.notes] == [
        ("dead_lettered", "redrive"), ("owner_retry", "owner:alice"), ("work_completed", "redrive")]


def test_another_users_job_answers_exactly_like_a_missing_one(client, tokens, engine, sandbox, make_worker) -> None:
    """Bob's retry, read and download of Alice's job get the same 404 as an id that never existed; the job is untouched."""
    job_id = failed_job(engine, client, tokens, sandbox, make_worker)
    missing = "00000000-0000-4000-8000-000000000000"
    for path in ("/api/jobs/{}/retry", "/api/jobs/{}", "/api/jobs/{}/result"):
        method = client.post if path.endswith("retry") else client.get
        theirs = method(path.format(job_id), headers=auth(tokens, "bob"))
        nobody = method(path.format(missing), headers=auth(tokens, "bob"))
        junk = method(path.format("not-an-id"), headers=auth(tokens, "bob"))
        assert_one_line_error(theirs, 404, "FORBIDDEN")
        assert theirs.content == nobody.content == junk.content
    assert job(engine, job_id).status == "failed"


def test_retry_with_the_source_deleted_is_a_clear_error_and_changes_nothing(client, tokens, engine, sandbox,
                                                                             make_worker, files, tmp_path) -> None:
    """The PDF is gone: 410 EXPIRED saying to upload again; the job stays failed with its error."""
    job_id = failed_job(engine, client, tokens, sandbox, make_worker)
    files.delete_source(job(engine, job_id).source_location)
    response = client.post(f"/api/jobs/{job_id}/retry", headers=auth(tokens, "alice"))
    assert_one_line_error(response, 410, "EXPIRED", tmp_path)
    assert "upload it again" in response.json()["message"]
    still = job(engine, job_id)
    assert (still.status, still.error_code) == ("failed", "GW_4XX")
    listed = client.get("/api/jobs", headers=auth(tokens, "alice")).json()["jobs"][0]
    assert listed["sourcePresent"] is False


def test_status_shows_the_banner_while_the_breaker_is_open(client, tokens, engine, conv_settings, clock) -> None:
    """The page's banner text comes from /api/status while the breaker holds the queue, and goes when it closes."""
    assert client.get("/api/status", headers=auth(tokens, "alice")).json() == {"breaker": "closed", "banner": None}
    breaker = CircuitBreaker(engine, "pdf-gateway", conv_settings.breaker_policy(), clock)
    for _ in range(10):
        breaker.record(ok=False)
    assert client.get("/api/status", headers=auth(tokens, "alice")).json() == {"breaker": "open", "banner": BANNER}


def test_a_database_outage_is_a_one_line_io_error(conv_settings, tokens, db_url, tmp_path) -> None:
    """When PostgreSQL is unreachable the user gets IO_ERROR in one line: no stack trace, no DSN, no path."""
    nowhere = sa.engine.make_url(db_url).set(host="127.0.0.1", port=1, query={})  # nothing listens on port 1
    broken = sa.create_engine(nowhere, pool_pre_ping=False)
    client = TestClient(create_app(broken, conv_settings), raise_server_exceptions=False)
    response = client.get("/api/jobs", headers={"Authorization": f"Bearer {tokens['alice']}"})
    assert_one_line_error(response, 503, "IO_ERROR", tmp_path)
    assert "postgres" not in response.text.lower() and ".s.PGSQL" not in response.text


def test_metrics_expose_the_counters_and_gauges_of_003(client, tokens, engine, sandbox, make_worker, clock) -> None:
    """/metrics counts jobs created/completed/failed by code, retries, queue depth, gateway p95 and breaker time."""
    upload(client, tokens)
    upload(client, tokens)
    sandbox.script("pdf.convert", {"status": 502}, {"status": 400})
    worker = make_worker()
    worker.step(), worker.step()  # first: 502 → retry; second: 400 → failed GW_4XX
    upload(client, tokens)
    worker.step()  # the third job: ok
    text = client.get("/metrics").text
    assert "redrive_conversion_jobs_created_total 3.0" in text
    assert "redrive_conversion_jobs_completed_total 1.0" in text
    assert 'redrive_conversion_jobs_failed_total{code="GW_4XX"} 1.0' in text
    assert 'redrive_conversion_retries_scheduled_total{code="GW_5XX"} 1.0' in text
    assert 'redrive_conversion_queue_depth{state="scheduled"} 1.0' in text
    assert 'redrive_circuit_breaker_open{breaker="pdf-gateway"} 0.0' in text
    assert "redrive_conversion_gateway_latency_p95_seconds" in text
    # /metrics needs no token: Prometheus scrapes it from inside the network


# ------------------------------------------------------------------- bounded input (issue 13 item 9)


def raw_upload(base_url: str, token: str, *, declared: int, sent: bytes) -> socket.socket:
    """Open a real connection and send an upload's headers and only `sent` of its `declared` body bytes."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall((f"POST /api/jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n"
                  f"Content-Type: application/pdf\r\nX-Filename: stalled.pdf\r\nContent-Length: {declared}\r\n\r\n"
                  ).encode() + sent)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while chunk := sock.recv(65536):  # the server closes the connection after answering
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def test_a_body_that_stops_arriving_is_a_408_and_the_connection_is_closed(engine, conv_settings, tokens,
                                                                          serve_app) -> None:
    """Half a body, then silence: after UPLOAD_IDLE_TIMEOUT_SEC the server answers 408 IO_ERROR in one line and
    closes the connection (no job, no file) instead of holding it and its buffer forever."""
    knobs = conv_settings.model_copy(update={"upload_idle_timeout_sec": 0.3})
    url = serve_app(create_app(engine, knobs))
    sock = raw_upload(url, tokens["alice"], declared=4000, sent=make_pdf()[:200])
    try:
        status, headers, body = read_response(sock)  # a socket timeout (10 s) here means the server waited on
    finally:
        sock.close()
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(body) == {"error": "IO_ERROR", "message": "the upload stopped arriving; send it again"}
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(repo.conversion_jobs)).scalar() == 0
    assert list(conv_settings.uploads_dir.iterdir()) == []


def test_a_client_gone_mid_upload_is_one_log_line_without_a_traceback(engine, conv_settings, tokens, serve_app,
                                                                       caplog) -> None:
    """The client sends half its PDF and hangs up: one info line `upload_abandoned`, no ERROR record, no traceback
    (neither ours nor uvicorn's "Exception in ASGI application"), no job and no file."""
    caplog.set_level(logging.INFO)
    url = serve_app(create_app(engine, conv_settings))
    sock = raw_upload(url, tokens["alice"], declared=100_000, sent=make_pdf())
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()

    def settled() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "upload_abandoned" in r.getMessage() or r.levelno >= logging.ERROR]

    deadline = time.monotonic() + 10
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.02)  # waiting for the server thread to see the hang-up; nothing is timed
    [record] = settled()
    assert record.levelno == logging.INFO and record.exc_info is None, record.getMessage()
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(repo.conversion_jobs)).scalar() == 0
    assert list(conv_settings.uploads_dir.iterdir()) == []


NAME = "Relevé 7 東京 Ωmega.pdf"  # letters of any script are kept (policy.display_name)


@pytest.mark.parametrize("header", [quote(NAME, safe=""), NAME.encode()], ids=["percent-encoded", "raw-utf8"])
def test_a_utf8_filename_goes_up_and_comes_back_down(client, tokens, make_worker, header) -> None:
    """Upload: X-Filename is percent-encoded UTF-8 (the page's encodeURIComponent; a raw UTF-8 header is read
    too). Download: RFC 6266 `filename*=UTF-8''…` that a standard parser decodes, with an ASCII fallback."""
    created = client.post("/api/jobs", content=make_pdf(), headers={
        **auth(tokens, "alice"), "Content-Type": "application/pdf", "X-Filename": header})
    assert created.status_code == 201 and created.json()["filename"] == NAME
    assert make_worker().step() == "processed"
    download = client.get(f"/api/jobs/{created.json()['id']}/result", headers=auth(tokens, "alice"))
    assert download.status_code == 200
    disposition = download.headers["content-disposition"]
    kind, params = parse_options_header(disposition)  # werkzeug's RFC 6266/2231 parser (moto's server brings it)
    assert (kind, params["filename"]) == ("attachment", "Relevé 7 東京 Ωmega.xml")  # filename* wins (RFC 6266 §4.3)
    assert disposition.isascii() and 'filename="Relev_ 7 __ _mega.xml"' in disposition


# ---------------------------------------------------------------------------------- GATEWAY_URL joins


class Recorder(http.server.BaseHTTPRequestHandler):
    """A gateway that answers everything with 200 and remembers the paths (with query) it was asked for."""

    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._answer()

    def _answer(self) -> None:
        type(self).seen.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "9")
        self.end_headers()
        self.wfile.write(b"<doc/>\n\n\n")

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def recorder() -> Iterator[str]:
    Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.mark.parametrize("suffix, convert, health", [
    ("/pdf/v1", "/pdf/v1/convert", "/pdf/v1/health"),
    ("/pdf/v1/?key=k%2F1&region=eu", "/pdf/v1/convert?key=k%2F1&region=eu", "/pdf/v1/health?key=k%2F1&region=eu"),
    ("?next=/", "/convert?next=/", "/health?next=/"),
], ids=["path", "path-and-query", "query-ending-in-slash"])
def test_gateway_url_with_a_path_or_query_is_joined_not_concatenated(recorder, conv_settings, suffix, convert,
                                                                     health) -> None:
    """GATEWAY_URL's path is kept and extended, its query string kept as the query, through the real HTTP client."""
    from redrive.settings import Settings
    from resources.conversion import HttpGateway

    knobs = conv_settings.model_copy(update={"gateway_url": recorder + suffix})
    gateway = HttpGateway(knobs.gateway_base_url(Settings()), 5)
    try:
        assert gateway.convert(make_pdf()) == b"<doc/>\n\n\n" and gateway.healthy()
    finally:
        gateway.close()
    assert Recorder.seen == [convert, health]


def test_a_workers_gateway_calls_at_once_are_spread_over_small_connection_pools(conv_settings, sandbox) -> None:
    """httpcore's pool walks all its connections twice a call, under its lock (encode/httpcore#1035): one
    pool of 70 connections spent 3 ms of CPU a call against 0.8 for eight pools. A worker's 32 calls at once
    are all converted, wait on the gateway together, and no pool holds more than about its share."""
    import math
    from concurrent.futures import ThreadPoolExecutor

    from redrive.settings import Settings
    from resources.conversion import HttpGateway
    from resources.http import POOLS

    calls = 32
    sandbox.set_profile("pdf.convert", latency=1.0)
    gateway = HttpGateway(conv_settings.gateway_base_url(Settings()), 30, in_flight=calls)
    try:
        with ThreadPoolExecutor(calls) as threads:
            answers = list(threads.map(lambda i: gateway.convert(make_pdf(f"page {i}")), range(calls)))
        held = [len(client._transport._pool.connections) for client in gateway._http.clients]  # type: ignore[attr-defined]
    finally:
        gateway.close()
    assert all(b"page" in answer for answer in answers) and len(answers) == calls
    assert sandbox.meters("pdf.convert")["peak_concurrency"] >= calls * 0.9
    assert len(held) == POOLS > 1 and sum(held) >= calls * 0.9
    assert max(held) <= math.ceil(calls / POOLS) + 2, held
