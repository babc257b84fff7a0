"""The dead-letter console (issue 27 §2): every pipeline's dead letters by root cause, in a browser.

`redrive console serve` (a service of the deployed topology). Operators sign in with an operator token
(`redrive console token NAME`; redrive.operators), never a conversion owner's. The page lists the open letters
grouped by root cause (pipeline, stage, error class, fingerprint of the sanitized message) with counts, first
and last seen and a sample; searches by entity or text; shows a letter's sanitized context, stack and notes with
links to its Dagster run; replays or resolves one letter or a whole group. A replay needs the same remediation
evidence and safety statement as `redrive dlq replay`, a group replay is paced like `replay-bulk`, and every
action is written to the letter's notes as `operator:<name>`. The reads and writes are the core's
(redrive.deadletter_reads, redrive.deadletters, redrive.bulk): nothing here decides anything.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

PAGE = Path(__file__).with_name("console.html")
STATUSES_OPEN = ("open", "escalated", "replaying")


class Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def create_app(engine: sa.Engine, *, ui_url: str, clock: Any = None, sleep: Any = None) -> Starlette:
    import time

    from redrive import bulk, deadletter_reads as reads, deadletters, operators
    from redrive.clock import SystemClock

    clock = clock or SystemClock()
    sleep = sleep or time.sleep

    def operator_of(request: Request) -> str:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Refused(401, "sign in with an operator token (redrive console token NAME)")
        with engine.connect() as conn:
            name = operators.operator_for(conn, token.strip())
        if name is None:
            raise Refused(401, "unknown or revoked operator token")
        return name

    def run_url(run_id: str | None) -> str | None:
        return f"{ui_url.rstrip('/')}/runs/{run_id}" if run_id else None

    def letter_json(letter: Any) -> dict[str, Any]:
        out = letter.as_json()
        out["run_url"] = run_url(letter.run_id)
        partition = (letter.sanitized_context or {}).get("partition") if letter.sanitized_context else None
        out["partition"] = partition
        return out

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, json.JSONDecodeError):
            raise Refused(400, "send a JSON object") from None
        if not isinstance(body, dict):
            raise Refused(400, "send a JSON object")
        return body

    def flt(request: Request, **extra: Any) -> Any:
        q = request.query_params
        return reads.Filter(pipeline=q.get("pipeline") or None, statuses=STATUSES_OPEN, limit=int(q.get("limit", 200)),
                            entity=q.get("entity") or None, search=q.get("search") or None,
                            fingerprint=q.get("group") or None, **extra)

    async def page(request: Request) -> Response:
        return FileResponse(PAGE, media_type="text/html")

    async def groups(request: Request) -> Response:
        operator_of(request)
        with engine.connect() as conn:
            found = reads.groups(conn.connection.cursor(), flt(request))
        return JSONResponse([g.as_json() for g in found])

    async def letters(request: Request) -> Response:
        operator_of(request)
        with engine.connect() as conn:
            found = deadletters.list_(conn, flt(request))
        return JSONResponse([letter_json(x) for x in found])

    async def letter(request: Request) -> Response:
        operator_of(request)
        with engine.connect() as conn:
            found = deadletters.get(conn, int(request.path_params["id"]))
        if found is None:
            raise Refused(404, "no such dead letter")
        return JSONResponse(letter_json(found))

    async def replay(request: Request) -> Response:
        who, body = operator_of(request), await body_of(request)
        try:
            with engine.begin() as conn:
                done = deadletters.request_replay(conn, int(request.path_params["id"]), evidence=body.get("note"),
                                                  confirm_safe=body.get("confirm_safe") is True, at=clock.now(),
                                                  operator=f"operator:{who}")
        except deadletters.ReplayRefused as refused:
            raise Refused(409, str(refused)) from None
        return JSONResponse(letter_json(done))

    async def resolve(request: Request) -> Response:
        who, body = operator_of(request), await body_of(request)
        try:
            with engine.begin() as conn:
                done = deadletters.resolve(conn, int(request.path_params["id"]), note=str(body.get("note") or ""),
                                           at=clock.now(), operator=f"operator:{who}")
        except deadletters.ReplayRefused as refused:
            raise Refused(409, str(refused)) from None
        return JSONResponse(letter_json(done))

    async def replay_group(request: Request) -> Response:
        """Every open letter of the group, paced at `rate` per second in the background (like replay-bulk); the
        gate is checked first, so a refused request changes nothing."""
        who, body = operator_of(request), await body_of(request)
        note, safe = str(body.get("note") or "").strip(), body.get("confirm_safe") is True
        if not note:
            raise Refused(409, "replay refused: record the remediation evidence first (ticket and what was fixed)")
        if not safe:
            raise Refused(409, "replay refused: confirm the replay is idempotent or safe for duplicate effects")
        group = reads.Filter(statuses=(reads.OPEN, reads.ESCALATED), fingerprint=request.path_params["fingerprint"],
                             limit=int(body.get("limit", 1000)))
        with engine.connect() as conn:
            count = len(deadletters.list_(conn, group))
        rate = float(body.get("rate", 1.0))
        threading.Thread(target=bulk.bulk_replay, daemon=True, name="console-group-replay", kwargs=dict(
            engine=engine, flt=group, evidence=note, confirm_safe=True, rate=rate, clock=clock, sleep=sleep,
            operator=f"operator:{who}")).start()
        return JSONResponse({"group": group.fingerprint, "requested": count, "rate": rate}, status_code=202)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def on_refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refused)
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    return Starlette(routes=[
        Route("/", page), Route("/healthz", healthz),
        Route("/api/groups", groups), Route("/api/letters", letters), Route("/api/letters/{id:int}", letter),
        Route("/api/letters/{id:int}/replay", replay, methods=["POST"]),
        Route("/api/letters/{id:int}/resolve", resolve, methods=["POST"]),
        Route("/api/groups/{fingerprint}/replay", replay_group, methods=["POST"]),
    ], exception_handlers={Refused: on_refused})
