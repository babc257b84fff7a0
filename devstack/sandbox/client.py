"""A small typed client for the sandbox's admin API, used by tests and the demo."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any

import httpx
from pydantic import BaseModel

# A step is the admin's JSON ({"status": 429}) or one of the step models from `faults`.
StepSpec = Mapping[str, Any] | BaseModel


# The sandbox (uvicorn) closes a connection idle for 5 s. A client that keeps one as long may send its next request
# just as the server closes it ("Server disconnected without sending a response"; a 4-process test saw it once):
# forget idle connections well before the server does.
SERVER_KEEP_ALIVE_SECONDS = 5.0
KEEPALIVE_EXPIRY_SECONDS = SERVER_KEEP_ALIVE_SECONDS / 5


class SandboxAdminError(RuntimeError):
    """The sandbox refused an admin call; the message carries its explanation."""


class SandboxClient:
    """Scripts faults and reads the effect and request logs of one running sandbox."""

    def __init__(self, base_url: str, timeout: float = 10) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout,
                                  limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS))

    def url(self, path: str) -> str:
        """Absolute URL of a sandbox path, for pointing a resource at it."""
        return f"{self.base_url}/{path.lstrip('/')}"

    def health(self) -> bool:
        try:
            response = self._http.get("/_admin/health")
        except httpx.TransportError:
            return False
        return response.status_code == 200 and response.json().get("status") == "ok"

    # -- faults ----------------------------------------------------------------

    def script(self, route: str, *steps: StepSpec, match: str | None = None) -> int:
        """Append steps to the route's script; returns how many are pending. With `match`, only requests whose
        path, query or body contain that text take them (and they go before the route's unmatched script)."""
        body: dict[str, Any] = {"steps": [_step_json(s) for s in steps], **_only(match=match)}
        return int(self._call("POST", f"/_admin/faults/{route}", json=body)["pending"])

    def random_faults(
        self,
        route: str,
        seed: int,
        rates: Mapping[str, float],
        retry_after: str | None = None,
        timeout_seconds: float | None = None,
    ) -> None:
        body: dict[str, Any] = {"seed": seed, "rates": dict(rates)}
        if retry_after is not None:
            body["retry_after"] = retry_after
        if timeout_seconds is not None:
            body["timeout_seconds"] = timeout_seconds
        self._call("POST", f"/_admin/faults/{route}/random", json=body)

    def stop_random_faults(self, route: str) -> None:
        self._call("DELETE", f"/_admin/faults/{route}/random")

    def faults(self) -> dict[str, Any]:
        """Pending steps and random faults per route."""
        routes: dict[str, Any] = self._call("GET", "/_admin/faults")["routes"]
        return routes

    def clear_faults(self) -> None:
        self._call("DELETE", "/_admin/faults")

    def set_default(self, route: str, content: str | None = None, json: Any = None, when: str | None = None) -> None:
        """Set what the route answers on success: `content` for the llm, `json` for any JSON route; with
        `when`, the llm answers `content` only to prompts that contain that text (one sandbox, several tasks)."""
        body: dict[str, Any] = {}
        if content is not None:
            body["content"] = content
        if when is not None:
            body["when"] = when
        if json is not None:
            body["json"] = json
        self._call("POST", f"/_admin/routes/{route}/default", json=body)

    # -- latency and provider limits ---------------------------------------------

    def set_profile(
        self,
        route: str,
        *,
        latency: float | None = None,
        p50: float | None = None,
        p99: float | None = None,
        max_concurrent: int | None = None,
        rate_per_second: float | None = None,
        retry_after: int | None = None,
        seed: int = 0,
    ) -> dict[str, Any]:
        """Make the route answer after `latency` seconds (or lognormal by `p50`/`p99`) and refuse with 429 +
        Retry-After beyond `max_concurrent` requests in flight or `rate_per_second` in any 1 s window."""
        body: dict[str, Any] = {"seed": seed, **_only(max_concurrent=max_concurrent, rate_per_second=rate_per_second,
                                                      retry_after=retry_after)}
        if latency is not None:
            body["latency"] = {"seconds": latency}
        elif p50 is not None or p99 is not None:
            body["latency"] = _only(p50=p50, p99=p99)
        profile: dict[str, Any] = self._call("POST", f"/_admin/routes/{route}/profile", json=body)["profile"]
        return profile

    def clear_profile(self, route: str) -> None:
        self._call("DELETE", f"/_admin/routes/{route}/profile")

    def meters(self, route: str | None = None) -> dict[str, Any]:
        """Per route: admitted, limited (429 by a limit), peak_concurrency, peak_rate_per_second and the
        offered_ peaks (refused requests counted too); one route's dict when `route` is given."""
        routes: dict[str, Any] = self._call("GET", "/_admin/meters")["routes"]
        return routes if route is None else routes[route]

    def loop(self) -> dict[str, Any]:
        """The sandbox's own event loop: watching, stalls (≥ 50 ms), stalls_over_100ms, longest_stall_ms. A route's
        `limited_after_a_stall` counts the refusals that came within a second after one."""
        loop: dict[str, Any] = self._call("GET", "/_admin/meters")["loop"]
        return loop

    def clear_meters(self) -> None:
        self._call("DELETE", "/_admin/meters")

    # -- logs ------------------------------------------------------------------

    def effects(self, kind: str | None = None) -> list[dict[str, Any]]:
        effects: list[dict[str, Any]] = self._call("GET", "/_admin/effects", params=_only(kind=kind))["effects"]
        return effects

    def count(self, kind: str | None = None) -> int:
        return int(self._call("GET", "/_admin/effects/count", params=_only(kind=kind))["count"])

    def clear_effects(self) -> None:
        self._call("DELETE", "/_admin/effects")

    def requests(self, route: str | None = None) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = self._call("GET", "/_admin/requests", params=_only(route=route))["requests"]
        return records

    # -- provider state --------------------------------------------------------

    def reset(self) -> None:
        """Forget faults, effects, requests, defaults, store and missing cases."""
        self._call("POST", "/_admin/reset")

    def put_store(self, path: str, body: bytes, content_type: str = "application/octet-stream") -> None:
        self._call("PUT", f"/_admin/store/{path.lstrip('/')}", content=body, headers={"Content-Type": content_type})

    def mark_cases_missing(self, *case_ids: str) -> None:
        self._call("POST", "/_admin/cases/missing", json={"case_ids": list(case_ids)})

    # -- plumbing --------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._http.request(method, path, **kwargs)
        try:
            response.raise_for_status()
        except httpx.HTTPStatusError as exc:
            raise SandboxAdminError(f"{method} {path} -> {response.status_code}: {response.text}") from exc
        return response.json()


def _step_json(step: StepSpec) -> dict[str, Any]:
    if isinstance(step, BaseModel):
        return step.model_dump(by_alias=True, exclude_none=True)
    return dict(step)


def _only(**params: Any) -> dict[str, Any]:
    return {k: v for k, v in params.items() if v is not None}
