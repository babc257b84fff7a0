"""The conversion pipeline's knobs (003 §7), read from the environment when definitions or a process start.

Names are 003's own (``RETRY_MAX_ATTEMPTS``, ``WORKER_LEASE_TTL_SEC``, …); the few we added say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from assets.conversion.files import FileStore
from redrive.backoff import ExponentialPlusJitter
from redrive.breaker import BreakerPolicy
from redrive.settings import PROJECT_ROOT, Settings

PIPELINE = "conversion"
BREAKER = "pdf-gateway"


class ConversionSettings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", case_sensitive=False)

    # --- 003 §3.2 retry policy ------------------------------------------------------------
    retry_max_attempts: int = Field(default=3, ge=1, description="RETRY_MAX_ATTEMPTS, first attempt included.")
    retry_base_delay_ms: float = Field(default=5000, ge=0, description="RETRY_BASE_DELAY_MS: 5000 ms · 2^k …")
    retry_jitter_max_ms: float = Field(default=5000, ge=0, description="RETRY_JITTER_MAX_MS: … + random(0–this).")

    # --- 003 §3.4/§3.5 worker -----------------------------------------------------------------
    worker_lease_ttl_sec: float = Field(default=90, gt=0, description="WORKER_LEASE_TTL_SEC: a claim's lease.")
    worker_lease_extend_sec: float = Field(
        default=30, gt=0, description="(ours) WORKER_LEASE_EXTEND_SEC: extend the lease this often on long jobs.")
    worker_concurrency: int = Field(
        default=4, ge=1, le=256,
        description="WORKER_CONCURRENCY: jobs in flight per worker, Dagster run or plain process (each with its "
                    "own lease).")
    worker_runs: int = Field(
        default=1, ge=1, le=64,
        description="(ours) WORKER_RUNS: conversion worker runs Dagster keeps at once (the sensor's cap and the "
                    "instance's tag limit); jobs in flight under Dagster = WORKER_RUNS × WORKER_CONCURRENCY.")
    worker_db_backoff_max_sec: float = Field(
        default=30, gt=0, description="(ours) WORKER_DB_BACKOFF_MAX_SEC: cap of the wait between turns while the "
                                      "database is unreachable; the worker waits out any outage.")
    worker_health_file: Path | None = Field(
        default=None, description="(ours) WORKER_HEALTH_FILE: the worker writes its health here as JSON "
                                  "(for a process supervisor's probe); unset: logs only.")
    worker_idle_sleep_sec: float = Field(default=1.5, ge=0, description="(ours) sleep when nothing is due (003: ~1–2 s).")
    worker_idle_exit_sec: float = Field(
        default=10, ge=0, description="(ours) a Dagster worker run ends after this long with nothing to claim.")
    worker_max_run_sec: float = Field(default=600, gt=0, description="(ours) a Dagster worker run stops claiming after this.")
    worker_shutdown_grace_sec: float = Field(
        default=30, ge=0, description="(ours) on SIGTERM, how long the in-flight job may still finish before it is requeued.")
    gateway_timeout_ms: float = Field(default=30000, gt=0, description="GATEWAY_TIMEOUT_MS per conversion call.")
    gateway_url: str | None = Field(default=None, description="GATEWAY_URL; unset: the sandbox's /pdf/v1.")

    # --- 003 §3.3 circuit breaker ---------------------------------------------------------------
    circuit_window: int = Field(default=20, ge=1, description="CIRCUIT_WINDOW: gateway calls in the window.")
    circuit_fail_threshold: float = Field(default=0.5, gt=0, le=1, description="CIRCUIT_FAIL_THRESHOLD: share that opens.")
    circuit_min_calls: int | None = Field(
        default=None, ge=1, description="(ours) CIRCUIT_MIN_CALLS: calls needed before it may open; unset: half the window.")
    circuit_cooldown_ms: float = Field(default=30000, ge=0, description="CIRCUIT_COOLDOWN_MS between health probes.")

    # --- files and the API ------------------------------------------------------------------------
    uploads_dir: Path = Field(default=PROJECT_ROOT / ".data" / "conversion" / "uploads", description="UPLOADS_DIR")
    results_dir: Path = Field(default=PROJECT_ROOT / ".data" / "conversion" / "results", description="RESULTS_DIR")
    results_sync: Literal["turn", "file"] = Field(
        default="turn",
        description="(ours) RESULTS_SYNC: how a result is made durable before its job is written succeeded. "
                    "turn: one syncfs(2) of RESULTS_DIR's file system per worker turn, for every result the turn "
                    "completes (Linux 5.8+; elsewhere it falls back to file); file: an fsync per result. turn "
                    "flushes whatever else is waiting on that file system too: give RESULTS_DIR a volume of its "
                    "own, or choose file.")
    upload_max_bytes: int = Field(default=20 * 1024 * 1024, ge=1, description="(ours) UPLOAD_MAX_BYTES: above, TOO_LARGE.")
    upload_idle_timeout_sec: float = Field(
        default=30, gt=0, description="(ours) UPLOAD_IDLE_TIMEOUT_SEC: an upload body silent this long is 408 IO_ERROR.")
    upload_body_timeout_sec: float = Field(
        default=300, gt=0, description="(ours) UPLOAD_BODY_TIMEOUT_SEC: a whole upload body must arrive within this.")
    conversion_api_host: str = Field(default="127.0.0.1", description="(ours) where `serve` listens.")
    conversion_api_port: int = Field(default=8090, description="(ours) where `serve` listens.")

    @model_validator(mode="after")
    def _extend_inside_lease(self) -> ConversionSettings:
        if self.worker_lease_extend_sec >= self.worker_lease_ttl_sec:
            # a lease extended less often than it expires is lost on every long job
            self.worker_lease_extend_sec = self.worker_lease_ttl_sec / 3
        return self

    def backoff(self) -> ExponentialPlusJitter:
        """003 §3.2 on the core's policy: ``base · 2^k + uniform(0, jitter)`` (k = 1-based attempt − 1)."""
        return ExponentialPlusJitter(base=self.retry_base_delay_ms / 1000, jitter=self.retry_jitter_max_ms / 1000)

    def breaker_policy(self, time_scale: float = 1.0) -> BreakerPolicy:
        """003 §3.3 from the knobs; the cooldown is a wait, so the core's time scale shrinks it like a backoff."""
        return BreakerPolicy(
            window=self.circuit_window,
            failure_threshold=self.circuit_fail_threshold,
            min_calls=min(self.circuit_window, self.circuit_min_calls or max(1, self.circuit_window // 2)),
            cooldown=self.circuit_cooldown_ms / 1000 * time_scale,
        )

    def gateway_base_url(self, core: Settings) -> str:
        """GATEWAY_URL, else the core's PDF gateway (PDF_GATEWAY_URL or the sandbox)."""
        return self.gateway_url or core.pdf_url or "http://127.0.0.1:9/pdf/v1"  # joined by resources.conversion.endpoint


def file_store(settings: ConversionSettings) -> FileStore:
    """The worker's folders, with RESULTS_SYNC (the API only reads and writes sources: the default is enough)."""
    return FileStore(settings.uploads_dir, settings.results_dir, settings.results_sync)


def settings_of(resource: Any) -> ConversionSettings:
    """The knobs a `resources.conversion.ConversionResource` was configured with, validated."""
    return ConversionSettings.model_validate(resource.values())
