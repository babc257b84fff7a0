"""The conversion HTTP API and its page (003 §3.6), on Starlette (already the stack's ASGI framework).

    POST /api/jobs                 raw PDF body (X-Filename header for its name) → 201 job
    GET  /api/jobs                 my jobs, newest first, and the server's time (`now`) for "next retry in …"
    GET  /api/jobs/{id}            one of my jobs
    GET  /api/jobs/{id}/result     the XML result
    POST /api/jobs/{id}/retry      003 §3.6 manual retry: only `failed` jobs whose PDF is still stored
    GET  /api/status               breaker state and the banner to show
    GET  /                         the page: my jobs, Retry buttons, the "Converter busy" banner
    GET  /metrics                  Prometheus (003 §3.7)

Authentication is a per-user API token (``Authorization: Bearer …``); only its SHA-256 is stored.
Every error is one line ``{"error": CODE, "message": …}`` with CODE one of 003's ten canonical codes:
never a stack trace, a server path or a hint that another user's job exists — a job that is not
yours answers exactly like one that does not exist (404).

Run it: ``python -m assets.conversion.api serve``; make a token: ``python -m assets.conversion.api token OWNER``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, unquote

import sqlalchemy as sa
import typer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from assets.conversion import policy
from assets.conversion import repository as repo
from assets.conversion.files import FileStore
from assets.conversion.metrics import registry_for
from assets.conversion.settings import BREAKER, PIPELINE, ConversionSettings
from redrive import breaker, deadletters
from redrive.clock import Clock, SystemClock
from redrive.vocabularies import CONVERSION_PUBLIC_CODES

log = logging.getLogger("redrive.conversion.api")

BANNER = "Converter busy — jobs will resume automatically."
PAGE = Path(__file__).with_name("page.html")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def error(status: int, code: str, message: str) -> JSONResponse:
    assert code in CONVERSION_PUBLIC_CODES, code
    return JSONResponse({"error": code, "message": message}, status_code=status)


NOT_FOUND = ApiError(404, "FORBIDDEN", "job not found")


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def job_json(job: repo.Job, files: FileStore) -> dict[str, Any]:
    """What the API shows of a job: camelCase like 003's Prisma client, no server paths."""
    return {
        "id": job.id,
        "filename": job.filename,
        "status": job.status,
        "attemptCount": job.attempt_count,
        "lastAttemptAt": _iso(job.last_attempt_at),
        "retryAfter": _iso(job.retry_after),
        "queuedAt": _iso(job.queued_at),
        "startedAt": _iso(job.started_at),
        "completedAt": _iso(job.completed_at),
        "createdAt": _iso(job.created_at),
        "updatedAt": _iso(job.updated_at),
        "errorCode": policy.public(job.error_code),
        "errorMessage": job.error_message,
        "deadLetter": job.dead_letter,
        "sourcePresent": files.source_present(job.source_location),
        "resultUrl": f"/api/jobs/{job.id}/result" if job.status == "succeeded" else None,
    }


async def read_body(request: Request, limit: int, *, idle: float, total: float) -> bytes:
    """The request body, at most `limit` bytes (413 TOO_LARGE), each chunk arriving within `idle` seconds and
    the whole within `total` (408): a body that stops arriving must not hold a connection and its buffer.
    Raises `ClientDisconnect` when the client goes away mid-body."""
    body = bytearray()
    stream = request.stream()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), timeout=max(0.0, min(idle, deadline - loop.time())))
            except StopAsyncIteration:
                return bytes(body)
            body.extend(chunk)
            if len(body) > limit:
                raise ApiError(413, "TOO_LARGE", f"the PDF is larger than {limit} bytes")
    except TimeoutError:
        raise ApiError(408, "IO_ERROR", "the upload stopped arriving; send it again") from None


def filename_of(request: Request) -> str | None:
    """The upload's name: ``X-Filename`` percent-encoded UTF-8 (what ``encodeURIComponent`` gives; a header
    value is ASCII), else ``?filename=``. A raw UTF-8 header, which Starlette reads as Latin-1, is decoded too."""
    raw = request.headers.get("x-filename")
    if raw:
        try:
            raw = raw.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            pass  # not raw UTF-8: keep what was sent
        return unquote(raw, errors="replace")
    return request.query_params.get("filename")


def content_disposition(filename: str) -> str:
    """RFC 6266 for a download: ``filename*`` (RFC 8187/5987: UTF-8, percent-encoded), which browsers and
    curl -J use, and an ASCII ``filename`` for clients that know only that."""
    fallback = "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in filename)
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{quote(filename, safe='')}"


def create_app(engine: sa.Engine, settings: ConversionSettings, clock: Clock | None = None) -> Starlette:
    clock = clock or SystemClock()
    files = FileStore(settings.uploads_dir, settings.results_dir)
    metrics = registry_for(engine, clock)

    def owner_of(request: Request) -> str:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "FORBIDDEN", "missing or invalid API token")
        with engine.connect() as conn:
            owner = repo.owner_for(conn, token.strip())
        if owner is None:
            raise ApiError(401, "FORBIDDEN", "missing or invalid API token")
        return owner

    def job_id_of(request: Request) -> str:
        raw = request.path_params["job_id"]
        try:
            return str(uuid.UUID(raw))
        except ValueError:
            raise NOT_FOUND from None  # not an id: exactly like a job that does not exist

    async def page(request: Request) -> Response:
        return FileResponse(PAGE, media_type="text/html; charset=utf-8")

    async def status(request: Request) -> Response:
        owner_of(request)
        with engine.connect() as conn:
            state = breaker.get_state(conn, BREAKER)
        return JSONResponse({"breaker": state.state, "banner": BANNER if state.is_open else None})

    async def list_jobs(request: Request) -> Response:
        owner = owner_of(request)
        with engine.connect() as conn:
            jobs = repo.list_for(conn, owner)
        # the server's clock, so the page says "next retry in 1 min" by the same time the worker goes by
        return JSONResponse({"jobs": [job_json(j, files) for j in jobs], "now": clock.now().isoformat()})

    async def get_job(request: Request) -> Response:
        owner = owner_of(request)
        with engine.connect() as conn:
            job = repo.get(conn, job_id_of(request), owner)
        if job is None:
            raise NOT_FOUND
        return JSONResponse(job_json(job, files))

    async def upload(request: Request) -> Response:
        owner = owner_of(request)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > settings.upload_max_bytes:
            raise ApiError(413, "TOO_LARGE", f"the PDF is larger than {settings.upload_max_bytes} bytes")
        try:
            data = await read_body(request, settings.upload_max_bytes, idle=settings.upload_idle_timeout_sec,
                                   total=settings.upload_body_timeout_sec)
        except ClientDisconnect:
            # the client is gone: nobody reads an answer, and it is not our error (no traceback)
            log.info('{"event":"upload_abandoned","owner":"%s","reason":"client disconnected"}', owner)
            return Response(status_code=400)
        problem = policy.upload_error(data[: policy.PDF_HEADER_WINDOW], len(data), settings.upload_max_bytes)
        if problem == "TOO_LARGE":
            raise ApiError(413, "TOO_LARGE", f"the PDF is larger than {settings.upload_max_bytes} bytes")
        if problem == "NOT_PDF":
            raise ApiError(415, "NOT_PDF", "the upload is not a PDF document")
        name = policy.display_name(filename_of(request))
        job_id = str(uuid.uuid4())
        location = files.save_source(job_id, data)
        try:
            with engine.begin() as conn:
                job = repo.create(conn, repo.NewJob(job_id, owner, name, location, len(data),
                                                    hashlib.sha256(data).hexdigest()), clock.now())
        except BaseException:
            files.delete_source(location)  # no row, no orphan file
            raise
        log.info('{"event":"job_created","job_id":"%s","status":"queued","bytes":%d}', job.id, len(data))
        return JSONResponse(job_json(job, files), status_code=201)

    async def result(request: Request) -> Response:
        owner = owner_of(request)
        with engine.connect() as conn:
            job = repo.get(conn, job_id_of(request), owner)
        if job is None:
            raise NOT_FOUND
        if job.status != "succeeded" or job.result_location is None:
            raise ApiError(409, "NOT_READY", f"the result is not ready; the job is {job.status}")
        if not files.result_present(job.result_location):
            raise ApiError(410, "EXPIRED", "the result is no longer stored")
        stem = job.filename.rsplit(".", 1)[0] or "result"
        return FileResponse(files.result_path(job.result_location), media_type="application/xml",
                            headers={"Content-Disposition": content_disposition(f"{stem}.xml")})

    async def retry(request: Request) -> Response:
        owner = owner_of(request)
        job_id = job_id_of(request)
        with engine.begin() as conn:
            current = repo.get(conn, job_id, owner)
            present = current is not None and files.source_present(current.source_location)
            try:
                job = repo.manual_retry(conn, job_id, owner, clock.now(), present)
            except repo.RetryRefused as refused:
                raise ApiError(refused.status, refused.code, refused.message) from None
            # the job's dead letter (if any) says who retried it; its close then reads "work completed", not
            # "after replay" (issue 27)
            deadletters.note_active(conn, PIPELINE, job.id, kind="owner_retry", text="the owner pressed Retry",
                                    at=clock.now(), by=f"owner:{owner}")
        log.info('{"event":"job_manual_retry","job_id":"%s","status":"queued"}', job.id)
        return JSONResponse(job_json(job, files))

    async def metrics_endpoint(request: Request) -> Response:
        return Response(generate_latest(metrics), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        response = error(exc.status, exc.code, exc.message)
        if exc.status in (408, 413):  # the rest of the body is not read: this connection cannot serve another request
            response.headers["Connection"] = "close"
        return response

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return error(404, "FORBIDDEN", "not found")
        return error(exc.status_code, "UNKNOWN", "request not accepted")

    async def on_crash(request: Request, exc: Exception) -> Response:
        # one line for the user; the sanitized traceback goes to our log only
        log.error("conversion api: %s on %s", type(exc).__name__, request.url.path, exc_info=exc)
        if isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError | OSError):
            return error(503, "IO_ERROR", "storage is unavailable; try again shortly")
        return error(500, "UNKNOWN", "internal error")

    routes = [
        Route("/", page),
        Route("/healthz", healthz),
        Route("/metrics", metrics_endpoint),
        Route("/api/status", status),
        Route("/api/jobs", list_jobs, methods=["GET"]),
        Route("/api/jobs", upload, methods=["POST"]),
        Route("/api/jobs/{job_id}", get_job, methods=["GET"]),
        Route("/api/jobs/{job_id}/result", result, methods=["GET"]),
        Route("/api/jobs/{job_id}/retry", retry, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={ApiError: on_api_error, HTTPException: on_http_error,
                                                        Exception: on_crash})


# ------------------------------------------------------------------------------------------ commands

cli = typer.Typer(help="the conversion API: serve it, make API tokens", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)


def _engine() -> sa.Engine:
    from redrive.db import engine_for
    from resources.database import resolve_database_url
    from redrive.settings import Settings

    return engine_for(resolve_database_url(Settings()))


@cli.command("serve")
def serve(host: Annotated[str | None, typer.Option()] = None, port: Annotated[int | None, typer.Option()] = None) -> None:
    """Serve the API, the page and /metrics (CONVERSION_API_HOST, CONVERSION_API_PORT)."""
    import uvicorn

    from redrive import logs

    logs.configure()
    settings = ConversionSettings()
    uvicorn.run(create_app(_engine(), settings), host=host or settings.conversion_api_host,
                port=port or settings.conversion_api_port, log_level="warning")


@cli.command("token")
def token(owner: str, label: Annotated[str | None, typer.Option(help="what the token is for")] = None) -> None:
    """Create an API token for OWNER and print it (only its hash is stored: this is the one time it is shown)."""
    with _engine().begin() as conn:
        typer.echo(repo.create_token(conn, owner, label))


if __name__ == "__main__":
    cli()
