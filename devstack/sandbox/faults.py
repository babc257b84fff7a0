"""Fault scripts: what the next request on a route should suffer.

Each request on a route consumes the next scripted step; with no script pending
it draws from the route's seeded random faults, if any, and otherwise behaves
normally. This module only decides; `app.py` carries the decision out.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator


class Route(StrEnum):
    """The names an operator scripts; one name may cover several endpoints."""

    LLM = "llm"
    CASE_ATTACH = "case.attach"
    CASE_LOOKUP = "case.lookup"
    MAIL_SEND = "mail.send"
    MAIL_LOOKUP = "mail.lookup"
    PDF_CONVERT = "pdf.convert"
    PDF_HEALTH = "pdf.health"
    SLACK = "slack"
    STORE = "store"
    WEBHOOK = "webhook"


class UnknownRoute(LookupError):
    """An admin named a route the sandbox does not serve (usually a typo)."""

    def __init__(self, name: str) -> None:
        known = ", ".join(r.value for r in Route)
        super().__init__(f"unknown route {name!r}; known routes: {known}")


def parse_route(name: str) -> Route:
    """Route by name, failing loudly so a typo never scripts nothing."""
    try:
        return Route(name)
    except ValueError:
        raise UnknownRoute(name) from None


class _Step(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OkStep(_Step):
    """Behave normally; lets a script say "fail twice, then succeed"."""

    kind: Literal["ok"] = "ok"

    @property
    def label(self) -> str:
        return "ok"


class StatusStep(_Step):
    """Answer this status (default error body per route) without any side effect."""

    kind: Literal["status"] = "status"
    status: int = Field(ge=200, le=599)
    headers: dict[str, str] = Field(default_factory=dict)
    # Aliased because `json` shadows a BaseModel method; admins write "json".
    body: Any = Field(default=None, alias="json")
    error_code: str | None = None

    @property
    def label(self) -> str:
        return f"status:{self.status}"


class TimeoutStep(_Step):
    """Hold the request open, then answer 504: a shorter client timeout fires on the wire."""

    kind: Literal["timeout"]
    seconds: float = Field(default=5.0, ge=0, le=600)

    @property
    def label(self) -> str:
        return "timeout"


class MalformedStep(_Step):
    """200 with a JSON content type and a body that does not parse."""

    kind: Literal["malformed"]

    @property
    def label(self) -> str:
        return "malformed"


class SchemaInvalidStep(_Step):
    """200 with a body that parses but lacks what the client needs."""

    kind: Literal["schema_invalid"]

    @property
    def label(self) -> str:
        return "schema_invalid"


class EffectThenErrorStep(_Step):
    """Perform the side effect, then answer an error: "provider accepted, response lost"."""

    kind: Literal["effect_then_error"]
    status: int = Field(default=500, ge=400, le=599)
    headers: dict[str, str] = Field(default_factory=dict)
    error_code: str | None = None

    @property
    def label(self) -> str:
        return f"effect_then_error:{self.status}"


class ContentStep(_Step):
    """LLM only: succeed with this message content instead of the default."""

    kind: Literal["content"]
    content: str

    @property
    def label(self) -> str:
        return "content"


class DelayStep(_Step):
    """Wait this long, then behave normally: one slow answer among fast ones."""

    kind: Literal["delay"]
    seconds: float = Field(ge=0, le=600)

    @property
    def label(self) -> str:
        return "delay"


class ResetStep(_Step):
    """Start an answer and close the socket mid-body, as a reset proxy would."""

    kind: Literal["reset"]

    @property
    def label(self) -> str:
        return "reset"


STEP_KINDS = (
    "ok", "status", "timeout", "malformed", "schema_invalid", "effect_then_error", "content", "reset", "delay",
)


def _step_kind(raw: Any) -> str | None:
    # A bare {"status": 429} is the common case, so "kind" may be left out for it.
    if isinstance(raw, dict):
        kind = raw.get("kind")
        if kind is None and "status" in raw:
            return "status"
        return kind if isinstance(kind, str) else None
    return getattr(raw, "kind", None)


Step = Annotated[
    Annotated[OkStep, Tag("ok")]
    | Annotated[StatusStep, Tag("status")]
    | Annotated[TimeoutStep, Tag("timeout")]
    | Annotated[MalformedStep, Tag("malformed")]
    | Annotated[SchemaInvalidStep, Tag("schema_invalid")]
    | Annotated[EffectThenErrorStep, Tag("effect_then_error")]
    | Annotated[ContentStep, Tag("content")]
    | Annotated[ResetStep, Tag("reset")]
    | Annotated[DelayStep, Tag("delay")],
    Discriminator(
        _step_kind,
        custom_error_type="unknown_step_kind",
        custom_error_message=(
            "a step needs a 'status' or a 'kind' that is one of: " + ", ".join(STEP_KINDS)
        ),
    ),
]


class ScriptRequest(BaseModel):
    """Body of `POST /_admin/faults/{route}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: list[Step] = Field(min_length=1)
    # Only a request whose path, query or body contains this text takes these steps (an entity's id, a
    # webhook path): work running concurrently — pipelines ticked by the daemon, alert deliveries on the
    # same route — then meets the faults scripted for it, whatever order the requests arrive in.
    match: str | None = Field(default=None, min_length=1)


RANDOM_KINDS = ("timeout", "malformed", "schema_invalid", "reset", "effect_then_error")


class RandomFaults(BaseModel):
    """Body of `POST /_admin/faults/{route}/random`: seeded, so a failing run can be replayed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int
    rates: dict[str, float]
    retry_after: str | None = None
    timeout_seconds: float = Field(default=5.0, ge=0, le=600)

    @field_validator("rates")
    @classmethod
    def _known_outcomes(cls, rates: dict[str, float]) -> dict[str, float]:
        for outcome, rate in rates.items():
            if outcome not in RANDOM_KINDS and not _is_error_status(outcome):
                raise ValueError(
                    f"unknown outcome {outcome!r}: use an HTTP status 400-599 or one of {', '.join(RANDOM_KINDS)}"
                )
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"rate for {outcome!r} must be within [0, 1], got {rate}")
        if sum(rates.values()) > 1.0 + 1e-9:
            raise ValueError(f"rates add up to {sum(rates.values()):.3f}, more than 1")
        return rates

    def draw(self, rng: random.Random) -> Step:
        """Exactly one draw per request, so the sequence depends on the seed alone."""
        roll = rng.random()
        edge = 0.0
        # Sorted so the key order of the admin's JSON cannot change the sequence.
        for outcome in sorted(self.rates):
            edge += self.rates[outcome]
            if roll < edge:
                return self._step_for(outcome)
        return OkStep()

    def _step_for(self, outcome: str) -> Step:
        match outcome:
            case "timeout":
                return TimeoutStep(kind="timeout", seconds=self.timeout_seconds)
            case "malformed":
                return MalformedStep(kind="malformed")
            case "schema_invalid":
                return SchemaInvalidStep(kind="schema_invalid")
            case "reset":
                return ResetStep(kind="reset")
            case "effect_then_error":
                return EffectThenErrorStep(kind="effect_then_error")
        status = int(outcome)
        headers = {"Retry-After": self.retry_after} if self.retry_after and status in (429, 503) else {}
        return StatusStep(status=status, headers=headers)


def _is_error_status(outcome: str) -> bool:
    return outcome.isdigit() and 400 <= int(outcome) <= 599


class FaultScriptError(ValueError):
    """A script that parses but cannot apply to its route."""


@dataclass(frozen=True)
class PlannedStep:
    """The decision for one request, and where it came from (for the request log)."""

    step: Step
    source: Literal["script", "random", "normal"]

    @property
    def label(self) -> str:
        return self.step.label


class FaultBook:
    """Per-route scripts and random faults; one lock, so concurrent requests consume steps in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scripts: dict[Route, deque[Step]] = {}
        self._matched: dict[Route, dict[str, deque[Step]]] = {}
        self._random: dict[Route, tuple[RandomFaults, random.Random]] = {}

    def append(self, route: Route, steps: list[Step], match: str | None = None) -> int:
        """Queue steps behind any already pending (for requests containing `match`, if given); returns how many
        are pending in that queue now."""
        if route is not Route.LLM and any(isinstance(s, ContentStep) for s in steps):
            raise FaultScriptError(f"'content' steps only apply to route 'llm', not {route.value!r}")
        with self._lock:
            if match is None:
                queue = self._scripts.setdefault(route, deque())
            else:
                queue = self._matched.setdefault(route, {}).setdefault(match, deque())
            queue.extend(steps)
            return len(queue)

    def matches_pending(self, route: Route) -> bool:
        """Whether a request must be read (path and body) to choose its step."""
        with self._lock:
            return bool(self._matched.get(route))

    def start_random(self, route: Route, faults: RandomFaults) -> None:
        """Replace the route's random faults with a fresh generator from the seed."""
        with self._lock:
            self._random[route] = (faults, random.Random(faults.seed))

    def stop_random(self, route: Route) -> bool:
        with self._lock:
            return self._random.pop(route, None) is not None

    def next_step(self, route: Route, request_text: str = "") -> PlannedStep:
        """Steps scripted for text the request contains win (the oldest match first), then the route's
        script, then random faults, then normal behaviour."""
        with self._lock:
            matched = self._matched.get(route, {})
            for key, pending in list(matched.items()):
                if key in request_text:
                    step = pending.popleft()
                    if not pending:
                        del matched[key]
                    return PlannedStep(step, "script")
            queue = self._scripts.get(route)
            if queue:
                return PlannedStep(queue.popleft(), "script")
            if route in self._random:
                faults, rng = self._random[route]
                return PlannedStep(faults.draw(rng), "random")
        return PlannedStep(OkStep(), "normal")

    def clear(self) -> None:
        with self._lock:
            self._scripts.clear()
            self._matched.clear()
            self._random.clear()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """What is still pending per route, in the admin's own words."""
        with self._lock:
            return {
                route.value: {
                    "pending": [
                        s.model_dump(by_alias=True, exclude_none=True) for s in self._scripts.get(route, ())
                    ],
                    "matched": {
                        key: [s.model_dump(by_alias=True, exclude_none=True) for s in steps]
                        for key, steps in self._matched.get(route, {}).items()
                    },
                    "random": (
                        self._random[route][0].model_dump(exclude_none=True) if route in self._random else None
                    ),
                }
                for route in Route
            }
