"""Limits of one upstream and the retry budget's formula, as values (no I/O; `redrive.upstreams` applies them).

Kept apart from `redrive.upstreams` so `redrive.settings` can type one setting per upstream with it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["UPSTREAMS", "RetryDeferred", "UpstreamLimits", "retry_allowance"]

UPSTREAMS = ("llm", "artifact_store", "case_api", "mail", "pdf_gateway", "webhooks", "slack")
"""The upstreams our resources call, by the name their settings and metrics use."""


class UpstreamLimits(BaseModel):
    """One upstream's limits (a setting per upstream, e.g. `REDRIVE_UPSTREAM_LLM='{"max_concurrent": 64}'`).

    Size them under the provider's own limits (docs/operating.md, "Upstream limits"): the limiter
    counts grants, the provider counts arrivals, and the network between them shifts a few.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_concurrent: int | None = Field(default=None, ge=1, le=10_000)
    rate_per_second: float | None = Field(default=None, gt=0, le=100_000)
    rate_burst: int = Field(default=1, ge=1, le=10_000, description="Grants that may come at once; any window of "
                            "W seconds holds at most rate_per_second·W + rate_burst - 1.")
    lease_seconds: float = Field(default=120.0, gt=0, description="A dead holder's slot comes back after this; "
                                 "longer than the call's timeout.")
    retry_share: float | None = Field(default=None, ge=0, le=10, description="Retries may be this share of "
                                      "calls over the window (0.1 = 10 %); unset: no retry budget.")
    retry_floor_per_second: float = Field(default=1.0, ge=0)
    retry_window_seconds: int = Field(default=10, ge=1, le=3600)
    max_pause_seconds: float = Field(default=300.0, ge=0, description="A Retry-After longer than this is cut.")
    throttle_retries: int = Field(default=2, ge=0, le=10, description="A 429 is waited out (with every "
                                  "worker) and sent again this many times before it fails the attempt.")

    @property
    def active(self) -> bool:
        return self.max_concurrent is not None or self.rate_per_second is not None or self.retry_share is not None

def retry_allowance(calls: int, policy: UpstreamLimits) -> float:
    """How many retries the window allows: `retry_share` of its calls plus the floor for its length."""
    share = policy.retry_share or 0.0
    return share * calls + policy.retry_floor_per_second * policy.retry_window_seconds


class RetryDeferred(Exception):  # noqa: N818 - a decision, not an error: the retry waits, no attempt spent
    """The upstream's retry budget is spent: this retry is not sent; the entity is due again later."""

    def __init__(self, upstream: str, wait: float) -> None:
        super().__init__(f"retry budget of upstream {upstream!r} exhausted; retry deferred")
        self.upstream, self.wait = upstream, wait

    def due_after(self, rng: Any) -> float:
        """Pure: seconds until the held-back entity is due again, about one budget window, spread (×0.5–1.5)
        so the entities an exhausted budget holds back do not all come due in the same instant."""
        return self.wait * rng.uniform(0.5, 1.5)


