"""The PDF-to-XML gateway (the sandbox's /pdf/v1 locally) and the conversion pipeline's knobs, as resources.

The gateway answers raw PDF in, XML out. A non-2xx answer raises ``httpx.HTTPStatusError`` and a slow
one ``httpx.TimeoutException``: the core's classifier names both, 003's vocabulary renames them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import httpx
from dagster import ConfigurableResource
from pydantic import Field

from redrive.upstreams import guarded
from resources.http import client_pools

if TYPE_CHECKING:  # the resource carries the pipeline's knobs as plain fields; it never imports the pipeline
    from assets.conversion.settings import ConversionSettings


class Gateway(Protocol):
    """What the worker needs of a converter; the benchmark's instant gateway has the same shape."""

    def convert(self, pdf: bytes) -> bytes: ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...


def endpoint(base_url: str, name: str) -> httpx.URL:
    """``name`` under GATEWAY_URL's path, keeping its query: ``https://gw/pdf/v1?key=k`` + ``convert`` is
    ``https://gw/pdf/v1/convert?key=k`` (string concatenation put the path inside the query)."""
    base = httpx.URL(base_url)
    return base.copy_with(path=base.path.rstrip("/") + "/" + name.lstrip("/"))


class HttpGateway:
    """Pooled HTTP clients per worker (`client_pools`); every call bounded by GATEWAY_TIMEOUT_MS.

    ``in_flight`` is how many calls the worker makes at once (WORKER_CONCURRENCY): the pools keep that
    many connections alive, plus one for the health probe. httpx keeps 20 by default, so at 32 in flight
    12 connections were closed after every call and opened again for the next (issue 14).
    """

    def __init__(self, base_url: str, timeout_seconds: float, *, in_flight: int = 1,
                 health_timeout_seconds: float = 5.0) -> None:
        self.base_url = base_url
        self._convert, self._health = endpoint(base_url, "convert"), endpoint(base_url, "health")
        self.timeout_seconds = timeout_seconds
        self._health_timeout = min(health_timeout_seconds, timeout_seconds)
        self._http = client_pools(in_flight, timeout=timeout_seconds)

    def convert(self, pdf: bytes) -> bytes:
        response = guarded("pdf_gateway", lambda: self._http.next().post(
            self._convert, content=pdf, headers={"Content-Type": "application/pdf", "Accept": "application/xml"}))
        response.raise_for_status()
        return response.content

    def healthy(self) -> bool:
        """003 §3.3's health probe: a 2xx from /health within a few seconds."""
        try:
            response = self._http.next().get(self._health, timeout=self._health_timeout)
        except httpx.HTTPError:
            return False
        return response.is_success

    def close(self) -> None:
        self._http.close()


class ConversionResource(ConfigurableResource):
    """The conversion pipeline's configuration as the code location resolved it (003 §7 knobs)."""

    gateway_url: str = Field(description="GATEWAY_URL (unset: PDF_GATEWAY_URL or the sandbox's /pdf/v1)")
    gateway_timeout_ms: float = 30000
    retry_max_attempts: int = 3
    retry_base_delay_ms: float = 5000
    retry_jitter_max_ms: float = 5000
    worker_lease_ttl_sec: float = 90
    worker_lease_extend_sec: float = 30
    worker_concurrency: int = 4
    worker_runs: int = 1
    worker_idle_sleep_sec: float = 1.5
    worker_idle_exit_sec: float = 10
    worker_max_run_sec: float = 600
    worker_shutdown_grace_sec: float = 30
    circuit_window: int = 20
    circuit_fail_threshold: float = 0.5
    circuit_min_calls: int | None = None
    circuit_cooldown_ms: float = 30000
    uploads_dir: str = ""
    results_dir: str = ""

    @classmethod
    def from_settings(cls, settings: ConversionSettings, gateway_url: str) -> ConversionResource:
        values = settings.model_dump(include=set(cls.model_fields) - {"gateway_url", "uploads_dir", "results_dir"})
        return cls(gateway_url=gateway_url, uploads_dir=str(settings.uploads_dir),
                   results_dir=str(settings.results_dir), **values)

    def values(self) -> dict[str, object]:
        """The knobs as configured, for `assets.conversion.settings.settings_of` to validate."""
        return {**{k: getattr(self, k) for k in type(self).model_fields}, "gateway_url": self.gateway_url}

    def gateway(self, timeout_ms: float | None = None) -> HttpGateway:
        return HttpGateway(self.gateway_url, (timeout_ms or self.gateway_timeout_ms) / 1000,
                           in_flight=self.worker_concurrency)
