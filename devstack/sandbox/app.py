"""The sandbox: one local HTTP server standing in for the providers our pipelines call.

It speaks each provider's wire format, records every side effect, and injects
faults on demand, so tests and operators can rehearse "rate limited", "timed
out", "accepted but the response was lost" against real sockets.

Service routes (ROUTE NAME in brackets, used by the fault admin):

    [llm]          POST /llm/v1/chat/completions           OpenAI chat completions; Bearer required
    [case.attach]  POST /case/v1/cases/{case_id}/evidence  Idempotency-Key required; Bearer required
    [case.lookup]  GET  /case/v1/attachments?idempotency_key=K
    [mail.send]    POST /mail/v1/messages                  idempotent per idempotency_token
    [mail.lookup]  GET  /mail/v1/messages?idempotency_token=T
                   GET  /mail/v1/messages/{message_id}
    [pdf.convert]  POST /pdf/v1/convert                    raw PDF in, XML out
    [pdf.health]   GET  /pdf/v1/health
    [slack]        POST /slack/webhook/{path}              incoming webhook, answers text "ok"
                   POST /slack/api/chat.postMessage        Web API (JSON or form-encoded), token required
                   POST /slack/api/{method}                any other method: {"ok": false, "error": "unknown_method"}
    [store]        GET  /store/{path}                      objects put by the admin
    [webhook]      POST /webhook/{path}                    a requester's webhook that honours Idempotency-Key

Admin routes (no auth):

    GET    /_admin/health                       {"status": "ok"}
    POST   /_admin/reset                        forget everything
    GET    /_admin/faults                       pending steps and random faults per route
    DELETE /_admin/faults                       clear all scripts and random faults
    POST   /_admin/faults/{route}               {"steps": [STEP, ...]} appended to the route's script
    POST   /_admin/faults/{route}/random        {"seed", "rates", "retry_after"?, "timeout_seconds"?}
    DELETE /_admin/faults/{route}/random
    POST   /_admin/routes/{route}/default       {"content": "..."} (llm) or {"json": {...}} (any JSON route);
                                                {"content": "...", "when": "text"}: llm, prompts containing text
    POST   /_admin/routes/{route}/profile       latency and provider limits (see profiles.py):
                                                {"latency": {"seconds": s} | {"p50": s, "p99": s}, "seed": n,
                                                 "max_concurrent": n, "rate_per_second": r, "retry_after": s}
    DELETE /_admin/routes/{route}/profile
    GET    /_admin/meters                       per route: peak concurrency, peak requests in any 1 s window,
                                                the same for what was offered, and how many were refused (429),
                                                by which limit and how many within 1 s after a stall of the
                                                sandbox's own event loop ("loop": its stalls, its GC pauses)
    DELETE /_admin/meters                       forget the counters (profiles stay)
    GET    /_admin/effects?kind=K               {"effects": [{"seq", "kind", "at", ...data}]}
    GET    /_admin/effects/count?kind=K         {"count": n}
    DELETE /_admin/effects
    GET    /_admin/requests?route=R             {"requests": [{"seq", "route", "step", "status", ...}]}
    DELETE /_admin/requests
    PUT    /_admin/store/{path}                 raw body; Content-Type kept
    POST   /_admin/cases/missing                {"case_ids": [...]} answer 404 CASE_NOT_FOUND from now on

Fault steps (each request on a route consumes the next one, before any other check):

    {"status": 429, "headers": {...}, "json": {...}, "error_code": "..."}  that answer, no side effect
    {"kind": "ok"}                          behave normally
    {"kind": "timeout", "seconds": 5}       hold the request open, then 504
    {"kind": "malformed"}                   200, JSON content type, body that does not parse
    {"kind": "schema_invalid"}              200, parses, wrong shape (llm: valid envelope, content
                                            {"unexpected": "shape"}; pdf.convert: <unexpected/> XML)
    {"kind": "effect_then_error", "status": 500}
                                            do the real work (effect recorded), then answer the error;
                                            if the request itself was invalid its own 4xx is returned
    {"kind": "content", "content": "..."}   llm only: succeed with this content
    {"kind": "delay", "seconds": 2}         wait, then behave normally
    {"kind": "reset"}                       send headers and a few body bytes, then close the socket
                                            (uvicorn gives an app no way to drop a connection before
                                            the headers, so clients see RemoteProtocolError mid-body)

A route's profile is applied before its script: a request over the route's limits is answered 429 with
Retry-After and consumes no step; an admitted one waits the route's latency (not on `timeout` steps).

Only normal answers, `content`, `delay` and `effect_then_error` perform side effects. The request log
keeps header names only and no bodies; the effect log keeps ids and digests, never tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route as HttpRoute
from starlette.types import Receive, Scope, Send

from devstack.sandbox.effects import Clock, utc_now
from devstack.sandbox.faults import (
    STEP_KINDS,
    ContentStep,
    DelayStep,
    EffectThenErrorStep,
    FaultScriptError,
    MalformedStep,
    OkStep,
    RandomFaults,
    ResetStep,
    Route,
    SchemaInvalidStep,
    ScriptRequest,
    StatusStep,
    Step,
    TimeoutStep,
    UnknownRoute,
    parse_route,
)
from devstack.sandbox.profiles import RouteProfile
from devstack.sandbox.state import CaseNotFound, IdempotencyConflict, MailMessage, RouteDefault, SandboxState
from devstack.sandbox.wire import (
    PDF_MAGIC,
    SCHEMA_INVALID_JSON,
    SCHEMA_INVALID_LLM_CONTENT,
    SCHEMA_INVALID_XML,
    EvidenceRequest,
    MailRequest,
    completion,
    fault_error_body,
    is_deliverable,
    malformed_body,
    messages_digest,
    openai_error,
    pdf_to_xml,
    service_error,
)

log = logging.getLogger("devstack.sandbox")

Handler = Callable[[Request, SandboxState, Step], Awaitable[Response]]

_NOT_JSON = object()


def _state(request: Request) -> SandboxState:
    state: SandboxState = request.app.state.sandbox
    return state


def bearer_token(request: Request) -> str | None:
    """The token of `Authorization: Bearer <token>`, or None when absent or empty."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return _NOT_JSON


def _json_answer(state: SandboxState, route: Route, body: Any, status: int = 200, **headers: str) -> Response:
    """A success answer, unless an admin replaced this route's default JSON."""
    override = state.default_json(route)
    return JSONResponse(body if override is None else override, status_code=status, headers=headers or None)


class DroppedConnection(Response):
    """Starts an answer and returns without finishing it: uvicorn then closes the socket."""

    def __init__(self) -> None:
        super().__init__(status_code=200)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"1024")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"choi', "more_body": True})
        log.warning("reset step: dropping the connection mid-body on purpose")


# -- fault application ---------------------------------------------------------


def _fault_response(route: Route, status: int, headers: dict[str, str], body: Any, error_code: str | None) -> Response:
    content = fault_error_body(route, status, error_code) if body is None else body
    return JSONResponse(content, status_code=status, headers=headers or None)


async def _schema_invalid(route: Route, request: Request) -> Response:
    if route is Route.LLM:
        body = await _json_body(request)
        model = body.get("model") if isinstance(body, dict) else None
        return JSONResponse(
            completion(
                completion_id="chatcmpl-sandbox-schema-invalid",
                model=model if isinstance(model, str) else "sandbox",
                content=SCHEMA_INVALID_LLM_CONTENT,
                prompt_chars=0,
            )
        )
    if route is Route.PDF_CONVERT:
        return Response(SCHEMA_INVALID_XML, media_type="application/xml")
    return JSONResponse(SCHEMA_INVALID_JSON)


async def _apply(route: Route, step: Step, request: Request, state: SandboxState, handler: Handler) -> Response:
    match step:
        case OkStep() | ContentStep():
            return await handler(request, state, step)
        case DelayStep():
            await asyncio.sleep(step.seconds)
            return await handler(request, state, step)
        case StatusStep():
            return _fault_response(route, step.status, step.headers, step.body, step.error_code)
        case TimeoutStep():
            await asyncio.sleep(step.seconds)
            return _fault_response(route, 504, {}, None, None)
        case MalformedStep():
            body, media_type = malformed_body(route)
            return Response(body, media_type=media_type)
        case SchemaInvalidStep():
            return await _schema_invalid(route, request)
        case EffectThenErrorStep():
            done = await handler(request, state, step)
            if not 200 <= done.status_code < 300:
                return done  # nothing happened, so there is no response to lose
            return _fault_response(route, step.status, step.headers, None, step.error_code)
        case ResetStep():
            return DroppedConnection()
    raise AssertionError(f"unhandled step {step!r}")


async def _request_text(request: Request, state: SandboxState, route: Route) -> str:
    """Path, query and body, for steps scripted with `match`; read only when such a step waits (starlette
    keeps the body, so the handler reads it again)."""
    if not state.faults.matches_pending(route):
        return ""
    body = await request.body()
    return f"{request.url.path}?{request.url.query}\n{body.decode('utf-8', errors='replace')}"


def scripted(route: Route, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a provider endpoint: apply the route's limits (a refused request consumes no step), consume the
    route's next step, log the request, wait the route's latency, apply the step."""

    async def endpoint(request: Request) -> Response:
        state = _state(request)
        meters = state.meters
        admission = meters.arrive(route)
        if not admission.admitted:
            try:
                seq = state.traffic.open(
                    route=route.value,
                    method=request.method,
                    path=request.url.path,
                    header_names=list(request.headers.keys()),
                    step=f"limited:{admission.reason}",
                    source="limit",
                )
                state.traffic.close(seq, 429)
                return _fault_response(route, 429, {"Retry-After": str(admission.retry_after)}, None, None)
            finally:
                meters.leave(route, admitted=False)
        try:
            planned = state.faults.next_step(route, await _request_text(request, state, route))
            seq = state.traffic.open(
                route=route.value,
                method=request.method,
                path=request.url.path,
                header_names=list(request.headers.keys()),
                step=planned.label,
                source=planned.source,
            )
            try:
                if admission.delay > 0 and not isinstance(planned.step, TimeoutStep):
                    await asyncio.sleep(admission.delay)
                response = await _apply(route, planned.step, request, state, handler)
            except asyncio.CancelledError:
                state.traffic.close(seq, None)  # server shutting down mid-request
                raise
            except Exception:
                state.traffic.close(seq, 500)
                raise
            state.traffic.close(seq, None if isinstance(response, DroppedConnection) else response.status_code)
            return response
        finally:
            meters.leave(route, admitted=True)

    return endpoint


# -- llm -------------------------------------------------------------------------


async def chat_completions(request: Request, state: SandboxState, step: Step) -> Response:
    if bearer_token(request) is None:
        return JSONResponse(
            openai_error(
                "Incorrect API key provided. Send 'Authorization: Bearer <key>'.",
                type_="invalid_request_error",
                code="invalid_api_key",
            ),
            status_code=401,
        )
    body = await _json_body(request)
    model = body.get("model") if isinstance(body, dict) else None
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model or not isinstance(messages, list) or not messages:
        return JSONResponse(
            openai_error(
                "The body must be a JSON object with a 'model' string and a non-empty 'messages' list.",
                type_="invalid_request_error",
                code=None,
                param="messages",
            ),
            status_code=400,
        )
    prompt = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    content = step.content if isinstance(step, ContentStep) else state.llm_content(prompt)
    completion_id = state.record_llm_call(model, messages_digest(messages))
    return _json_answer(
        state,
        Route.LLM,
        completion(
            completion_id=completion_id,
            model=model,
            content=content,
            prompt_chars=len(json.dumps(messages)),
        ),
    )


# -- case API --------------------------------------------------------------------


def _case_unauthorized(request: Request) -> Response | None:
    if bearer_token(request) is None:
        return JSONResponse(service_error("UNAUTHORIZED", "send 'Authorization: Bearer <token>'"), status_code=401)
    return None


async def attach_evidence(request: Request, state: SandboxState, step: Step) -> Response:
    if (denied := _case_unauthorized(request)) is not None:
        return denied
    key = request.headers.get("idempotency-key", "").strip()
    if not key:
        return JSONResponse(service_error("MISSING_IDEMPOTENCY_KEY"), status_code=400)
    body = await _json_body(request)
    try:
        evidence = EvidenceRequest.model_validate(body)
    except ValidationError as exc:
        return JSONResponse(service_error("VALIDATION_ERROR", _first_error(exc)), status_code=400)
    case_id = request.path_params["case_id"]
    try:
        attachment, replayed = state.attach_evidence(case_id, evidence, key)
    except CaseNotFound as exc:
        return JSONResponse(service_error("CASE_NOT_FOUND", str(exc)), status_code=404)
    except IdempotencyConflict as exc:
        return JSONResponse(service_error("IDEMPOTENCY_KEY_REUSED", str(exc)), status_code=409)
    if replayed:
        return _json_answer(state, Route.CASE_ATTACH, attachment.to_wire(), 200, **{"Idempotent-Replayed": "true"})
    return _json_answer(state, Route.CASE_ATTACH, attachment.to_wire(), 201)


async def lookup_attachment(request: Request, state: SandboxState, step: Step) -> Response:
    if (denied := _case_unauthorized(request)) is not None:
        return denied
    key = request.query_params.get("idempotency_key", "").strip()
    if not key:
        return JSONResponse(service_error("MISSING_IDEMPOTENCY_KEY"), status_code=400)
    attachment = state.find_attachment(key)
    if attachment is None:
        return JSONResponse(service_error("NOT_FOUND"), status_code=404)
    return _json_answer(state, Route.CASE_LOOKUP, attachment.to_wire())


# -- mail ------------------------------------------------------------------------


async def send_mail(request: Request, state: SandboxState, step: Step) -> Response:
    required = getattr(request.app.state, "mail_token", None)  # `--mail-token`: a provider that checks its key
    if required is not None and bearer_token(request) != required:
        return JSONResponse(service_error("UNAUTHORIZED", "unknown or missing API token"), status_code=401)
    try:
        mail = MailRequest.model_validate(await _json_body(request))
    except ValidationError as exc:
        return JSONResponse(service_error("VALIDATION_ERROR", _first_error(exc)), status_code=400)
    if not is_deliverable(mail.to):
        return JSONResponse(service_error("INVALID_RECIPIENT", f"cannot deliver to {mail.to!r}"), status_code=422)
    try:
        message, replayed = state.send_mail(mail)
    except IdempotencyConflict as exc:
        return JSONResponse(service_error("IDEMPOTENCY_TOKEN_REUSED", str(exc)), status_code=409)
    return _json_answer(state, Route.MAIL_SEND, message.accepted(), 200 if replayed else 202)


async def lookup_mail_by_token(request: Request, state: SandboxState, step: Step) -> Response:
    token = request.query_params.get("idempotency_token", "").strip()
    if not token:
        return JSONResponse(service_error("MISSING_IDEMPOTENCY_TOKEN"), status_code=400)
    return _mail_found(state, state.find_message(token=token))


async def lookup_mail_by_id(request: Request, state: SandboxState, step: Step) -> Response:
    return _mail_found(state, state.find_message(message_id=request.path_params["message_id"]))


def _mail_found(state: SandboxState, message: MailMessage | None) -> Response:
    if message is None:
        return JSONResponse(service_error("NOT_FOUND"), status_code=404)
    return _json_answer(state, Route.MAIL_LOOKUP, message.delivered())


# -- pdf gateway -----------------------------------------------------------------


async def convert_pdf(request: Request, state: SandboxState, step: Step) -> Response:
    pdf = await request.body()
    if not pdf.startswith(PDF_MAGIC):
        return JSONResponse(service_error("INVALID_PDF", "body does not start with %PDF-"), status_code=400)
    xml = pdf_to_xml(pdf)
    state.effects.record("pdf.convert", sha256=_sha256(pdf), bytes=len(pdf))
    return Response(xml, media_type="application/xml")


async def pdf_health(request: Request, state: SandboxState, step: Step) -> Response:
    return _json_answer(state, Route.PDF_HEALTH, {"status": "ok"})


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- slack -----------------------------------------------------------------------


async def slack_webhook(request: Request, state: SandboxState, step: Step) -> Response:
    # Real Slack answers webhook errors as plain text with HTTP 400.
    payload = await _json_body(request)
    if not isinstance(payload, dict):
        return PlainTextResponse("invalid_payload", status_code=400)
    if not any(payload.get(k) for k in ("text", "blocks", "attachments")):
        return PlainTextResponse("no_text", status_code=400)
    state.post_slack({"path": request.path_params["path"]}, payload)
    return PlainTextResponse("ok")


async def _slack_api_args(request: Request) -> dict[str, Any] | None:
    """slack_sdk sends JSON for chat.postMessage and form-encoded bodies for most other methods."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    raw = await request.body()
    if content_type == "application/json":
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        return body if isinstance(body, dict) else None
    if content_type in ("application/x-www-form-urlencoded", ""):
        args: dict[str, Any] = dict(parse_qsl(raw.decode("utf-8", "replace"), keep_blank_values=True))
        for field in ("blocks", "attachments"):
            if isinstance(args.get(field), str):
                try:
                    args[field] = json.loads(args[field])
                except json.JSONDecodeError:
                    pass
        return args
    return None  # multipart is not supported (no python-multipart in the venv)


async def slack_post_message(request: Request, state: SandboxState, step: Step) -> Response:
    # Slack's Web API answers HTTP 200 with {"ok": false, "error": ...} for caller errors.
    args = await _slack_api_args(request)
    if args is None:
        return JSONResponse({"ok": False, "error": "invalid_form_data"})
    token = bearer_token(request) or args.get("token")
    if not token:
        return JSONResponse({"ok": False, "error": "not_authed"})
    channel = args.get("channel")
    if not channel:
        return JSONResponse({"ok": False, "error": "channel_not_found"})
    if not any(args.get(k) for k in ("text", "blocks", "attachments")):
        return JSONResponse({"ok": False, "error": "no_text"})
    payload = {k: v for k, v in args.items() if k not in ("token", "channel")}
    ts = state.post_slack({"channel": channel}, payload)
    return _json_answer(
        state,
        Route.SLACK,
        {"ok": True, "channel": channel, "ts": ts, "message": {"type": "message", "text": args.get("text"), "ts": ts}},
    )


async def slack_unknown_method(request: Request, state: SandboxState, step: Step) -> Response:
    return JSONResponse({"ok": False, "error": "unknown_method"})


# -- a requester's webhook ---------------------------------------------------------


async def requester_webhook(request: Request, state: SandboxState, step: Step) -> Response:
    """A cooperative receiver (draft-ietf-httpapi-idempotency-key-header): the first post with a key is the
    effect and a repeat with the same key and payload answers the same result without a second one (the
    answer a client lost to an error is what its retry gets); the key reused for another payload is 422."""
    payload = await _json_body(request)
    if not isinstance(payload, dict):
        return JSONResponse(service_error("VALIDATION_ERROR", "the body must be a JSON object"), status_code=400)
    key = request.headers.get("idempotency-key", "").strip() or None
    try:
        delivery, replayed = state.deliver_webhook(request.path_params["path"], key, payload)
    except IdempotencyConflict as exc:
        return JSONResponse(service_error("IDEMPOTENCY_KEY_REUSED", str(exc)), status_code=422)
    answer = {"ok": True, "delivery_id": delivery.delivery_id}
    if replayed:
        return _json_answer(state, Route.WEBHOOK, answer, 200, **{"Idempotent-Replayed": "true"})
    return _json_answer(state, Route.WEBHOOK, answer, 200)


# -- store -----------------------------------------------------------------------


async def fetch_object(request: Request, state: SandboxState, step: Step) -> Response:
    found = state.fetch_object(request.path_params["path"])
    if found is None:
        return JSONResponse(service_error("NOT_FOUND"), status_code=404)
    return Response(found.body, media_type=found.content_type)


# -- admin -----------------------------------------------------------------------


class _AdminInputError(ValueError):
    def __init__(self, message: str, details: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.details = details or []


def _admin_error(status: int, code: str, message: str, details: list[dict[str, Any]] | None = None) -> Response:
    error: dict[str, Any] = {"code": code, "message": message}
    if details:
        error["details"] = details
    return JSONResponse({"error": error}, status_code=status)


def _first_error(exc: ValidationError) -> str:
    return _describe(exc.errors(include_url=False)[0])


def _describe(error: Any) -> str:
    loc = [str(part) for part in error["loc"]]
    if len(loc) >= 3 and loc[0] == "steps" and loc[2] in STEP_KINDS:
        # pydantic puts the union tag in the location; say "steps[1] (status step)" instead.
        loc = [f"steps[{loc[1]}] ({loc[2]} step)", *loc[3:]]
    elif len(loc) >= 2 and loc[0] == "steps":
        loc = [f"steps[{loc[1]}]", *loc[2:]]
    where = ".".join(loc) or "body"
    message = f"{where}: {error['msg']}"
    bad = error.get("input")
    if error["type"] == "unknown_step_kind" and isinstance(bad, dict) and "kind" in bad:
        message += f" (got kind {bad['kind']!r})"
    return message


M = TypeVar("M", bound=BaseModel)


async def _admin_model(request: Request, model: type[M]) -> M:
    body = await _json_body(request)
    if body is _NOT_JSON:
        raise _AdminInputError("body is not valid JSON")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False)
        details = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in errors]
        raise _AdminInputError("; ".join(_describe(e) for e in errors), details) from exc


def admin(
    endpoint: Callable[[Request, SandboxState], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """Admin endpoints answer bad input with 422 and unknown route names with 404."""

    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request, _state(request))
        except _AdminInputError as exc:
            return _admin_error(422, "INVALID_ADMIN_INPUT", str(exc), exc.details)
        except FaultScriptError as exc:
            return _admin_error(422, "INVALID_ADMIN_INPUT", str(exc))
        except UnknownRoute as exc:
            return _admin_error(404, "UNKNOWN_ROUTE", str(exc))

    return wrapped


def _route_param(request: Request) -> Route:
    return parse_route(request.path_params["route"])


def _route_query(request: Request) -> Route | None:
    name = request.query_params.get("route")
    return None if name is None else parse_route(name)


class _DefaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    content: str | None = None
    body: Any = Field(default=None, alias="json")
    when: str | None = Field(default=None, min_length=1)


class _MissingCases(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    case_ids: list[str] = Field(min_length=1)


async def admin_health(request: Request, state: SandboxState) -> Response:
    return JSONResponse({"status": "ok"})


async def admin_reset(request: Request, state: SandboxState) -> Response:
    state.reset()
    return JSONResponse({"status": "reset"})


async def admin_show_faults(request: Request, state: SandboxState) -> Response:
    return JSONResponse({"routes": state.faults.snapshot()})


async def admin_clear_faults(request: Request, state: SandboxState) -> Response:
    state.faults.clear()
    return JSONResponse({"status": "cleared"})


async def admin_script(request: Request, state: SandboxState) -> Response:
    route = _route_param(request)
    script = await _admin_model(request, ScriptRequest)
    pending = state.faults.append(route, script.steps, script.match)
    return JSONResponse({"route": route.value, "pending": pending}, status_code=201)


async def admin_start_random(request: Request, state: SandboxState) -> Response:
    route = _route_param(request)
    faults = await _admin_model(request, RandomFaults)
    state.faults.start_random(route, faults)
    return JSONResponse({"route": route.value, "random": faults.model_dump(exclude_none=True)}, status_code=201)


async def admin_stop_random(request: Request, state: SandboxState) -> Response:
    route = _route_param(request)
    return JSONResponse({"route": route.value, "stopped": state.faults.stop_random(route)})


async def admin_set_default(request: Request, state: SandboxState) -> Response:
    route = _route_param(request)
    default = await _admin_model(request, _DefaultRequest)
    if (default.content is None) == (default.body is None):
        raise _AdminInputError("give exactly one of 'content' (llm only) or 'json'")
    if default.content is not None and route is not Route.LLM:
        raise _AdminInputError(f"'content' only applies to route 'llm'; use 'json' for {route.value!r}")
    if default.body is not None and route in (Route.PDF_CONVERT, Route.STORE):
        raise _AdminInputError(f"route {route.value!r} does not answer JSON; its default cannot be set")
    if default.when is not None:
        if default.content is None:
            raise _AdminInputError("'when' goes with 'content' (route 'llm')")
        state.set_llm_answer(default.when, default.content)
        return JSONResponse({"route": route.value, "status": "set", "when": default.when})
    state.set_default(route, RouteDefault(content=default.content, json=default.body))
    return JSONResponse({"route": route.value, "status": "set"})


async def admin_set_profile(request: Request, state: SandboxState) -> Response:
    route = _route_param(request)
    profile = await _admin_model(request, RouteProfile)
    state.meters.set_profile(route, profile)
    return JSONResponse({"route": route.value, "profile": profile.model_dump(exclude_none=True)}, status_code=201)


async def admin_clear_profile(request: Request, state: SandboxState) -> Response:
    route = _route_param(request)
    return JSONResponse({"route": route.value, "cleared": state.meters.clear_profile(route)})


async def admin_meters(request: Request, state: SandboxState) -> Response:
    return JSONResponse({"routes": state.meters.snapshot(), "loop": {"watching": state.watching,
                                                                     **state.meters.loop()}})


def timed_collections(state: SandboxState, clock: Callable[[], float] = time.perf_counter,
                      ) -> Callable[[str, dict[str, Any]], None]:
    """A `gc.callbacks` entry that times each collection: a long one is a stall of the sandbox's own making."""
    started = [0.0]

    def collected(phase: str, _: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = clock()
        else:
            state.meters.note_collection(clock() - started[0])

    return collected


async def watch_loop(state: SandboxState, period: float = 0.01, clock: Callable[[], float] | None = None,
                     sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
    """Record every time this event loop came back to us later than asked: the sandbox itself was held up."""
    now = clock or asyncio.get_running_loop().time
    state.watching = True
    while True:
        before = now()
        await sleep(period)
        state.meters.note_stall(now() - before - period)


async def admin_clear_meters(request: Request, state: SandboxState) -> Response:
    state.meters.reset_counters()
    return JSONResponse({"status": "cleared"})


async def admin_effects(request: Request, state: SandboxState) -> Response:
    kind = request.query_params.get("kind")
    return JSONResponse({"effects": [e.to_json() for e in state.effects.list(kind)]})


async def admin_effect_count(request: Request, state: SandboxState) -> Response:
    return JSONResponse({"count": state.effects.count(request.query_params.get("kind"))})


async def admin_clear_effects(request: Request, state: SandboxState) -> Response:
    state.effects.clear()
    return JSONResponse({"status": "cleared"})


async def admin_requests(request: Request, state: SandboxState) -> Response:
    route = _route_query(request)
    records = state.traffic.list(None if route is None else route.value)
    return JSONResponse({"requests": [r.to_json() for r in records]})


async def admin_clear_requests(request: Request, state: SandboxState) -> Response:
    state.traffic.clear()
    return JSONResponse({"status": "cleared"})


async def admin_put_object(request: Request, state: SandboxState) -> Response:
    path = request.path_params["path"]
    body = await request.body()
    content_type = request.headers.get("content-type", "application/octet-stream")
    state.put_object(path, body, content_type)
    return JSONResponse({"path": path, "bytes": len(body), "content_type": content_type}, status_code=201)


async def admin_mark_cases_missing(request: Request, state: SandboxState) -> Response:
    missing = await _admin_model(request, _MissingCases)
    state.mark_cases_missing(missing.case_ids)
    return JSONResponse({"missing": sorted(missing.case_ids)})


def create_app(*, clock: Clock = utc_now, mail_token: str | None = None) -> Starlette:
    """A sandbox with fresh state; `clock` stamps log entries (inject one in tests); with `mail_token`,
    mail sends with any other bearer token are refused with 401."""
    state = SandboxState(clock)
    routes = [
        # providers
        HttpRoute("/llm/v1/chat/completions", scripted(Route.LLM, chat_completions), methods=["POST"]),
        HttpRoute("/case/v1/cases/{case_id}/evidence", scripted(Route.CASE_ATTACH, attach_evidence), methods=["POST"]),
        HttpRoute("/case/v1/attachments", scripted(Route.CASE_LOOKUP, lookup_attachment), methods=["GET"]),
        HttpRoute("/mail/v1/messages", scripted(Route.MAIL_SEND, send_mail), methods=["POST"]),
        HttpRoute("/mail/v1/messages", scripted(Route.MAIL_LOOKUP, lookup_mail_by_token), methods=["GET"]),
        HttpRoute("/mail/v1/messages/{message_id}", scripted(Route.MAIL_LOOKUP, lookup_mail_by_id), methods=["GET"]),
        HttpRoute("/pdf/v1/convert", scripted(Route.PDF_CONVERT, convert_pdf), methods=["POST"]),
        HttpRoute("/pdf/v1/health", scripted(Route.PDF_HEALTH, pdf_health), methods=["GET"]),
        HttpRoute("/slack/webhook/{path:path}", scripted(Route.SLACK, slack_webhook), methods=["POST"]),
        HttpRoute("/slack/api/chat.postMessage", scripted(Route.SLACK, slack_post_message), methods=["POST"]),
        HttpRoute("/slack/api/{method}", scripted(Route.SLACK, slack_unknown_method), methods=["GET", "POST"]),
        HttpRoute("/store/{path:path}", scripted(Route.STORE, fetch_object), methods=["GET"]),
        HttpRoute("/webhook/{path:path}", scripted(Route.WEBHOOK, requester_webhook), methods=["POST"]),
        # admin
        HttpRoute("/_admin/health", admin(admin_health), methods=["GET"]),
        HttpRoute("/_admin/reset", admin(admin_reset), methods=["POST"]),
        HttpRoute("/_admin/faults", admin(admin_show_faults), methods=["GET"]),
        HttpRoute("/_admin/faults", admin(admin_clear_faults), methods=["DELETE"]),
        HttpRoute("/_admin/faults/{route}", admin(admin_script), methods=["POST"]),
        HttpRoute("/_admin/faults/{route}/random", admin(admin_start_random), methods=["POST"]),
        HttpRoute("/_admin/faults/{route}/random", admin(admin_stop_random), methods=["DELETE"]),
        HttpRoute("/_admin/routes/{route}/default", admin(admin_set_default), methods=["POST"]),
        HttpRoute("/_admin/routes/{route}/profile", admin(admin_set_profile), methods=["POST"]),
        HttpRoute("/_admin/routes/{route}/profile", admin(admin_clear_profile), methods=["DELETE"]),
        HttpRoute("/_admin/meters", admin(admin_meters), methods=["GET"]),
        HttpRoute("/_admin/meters", admin(admin_clear_meters), methods=["DELETE"]),
        HttpRoute("/_admin/effects", admin(admin_effects), methods=["GET"]),
        HttpRoute("/_admin/effects", admin(admin_clear_effects), methods=["DELETE"]),
        HttpRoute("/_admin/effects/count", admin(admin_effect_count), methods=["GET"]),
        HttpRoute("/_admin/requests", admin(admin_requests), methods=["GET"]),
        HttpRoute("/_admin/requests", admin(admin_clear_requests), methods=["DELETE"]),
        HttpRoute("/_admin/store/{path:path}", admin(admin_put_object), methods=["PUT"]),
        HttpRoute("/_admin/cases/missing", admin(admin_mark_cases_missing), methods=["POST"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        watcher = asyncio.create_task(watch_loop(state))
        collections = timed_collections(state)
        gc.callbacks.append(collections)
        try:
            yield
        finally:
            gc.callbacks.remove(collections)
            watcher.cancel()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.sandbox = state
    app.state.mail_token = mail_token
    return app
