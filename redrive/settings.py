"""One settings object for the whole code location, read from the environment.

Read when Definitions (or a command) are built, never at import time. Every
external endpoint is configuration, so production points at AWS, the real LLM,
case API and mail provider by values alone; locally `devstack` fills them in.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from redrive.upstream_policy import UPSTREAMS, UpstreamLimits

PROJECT_ROOT = Path(__file__).resolve().parents[1]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(extra="ignore", case_sensitive=False)

    # --- system of record -------------------------------------------------
    database_url: str | None = Field(
        default=None,
        description="PostgreSQL for redrive's own tables. Unset: an embedded PostgreSQL (pgserver) "
        "is started in REDRIVE_DATA_DIR/pg.",
    )
    dagster_pg_url: str | None = Field(
        default=None, description="PostgreSQL for Dagster's run/event/schedule storage."
    )
    redrive_data_dir: Path = Field(default=PROJECT_ROOT / ".data")

    # --- AWS (moto locally) -----------------------------------------------
    aws_endpoint_url: str | None = None
    aws_region: str = "us-east-1"
    redrive_bucket: str = "redrive-artifacts"

    # --- external HTTP services (the sandbox locally) -----------------------
    sandbox_url: str | None = None
    llm_base_url: str | None = None
    llm_api_key: str = "sandbox-key"
    llm_model: str = "gpt-4o-mini"
    case_api_url: str | None = None
    case_api_token: str = "sandbox-token"
    mail_api_url: str | None = None
    pdf_gateway_url: str | None = None
    artifact_store_url: str | None = None
    http_timeout_seconds: float = 10.0

    # --- alerts ---------------------------------------------------------------
    slack_webhook_url: str | None = None
    slack_bot_token: str | None = None
    slack_api_base_url: str | None = None
    slack_channel: str = "#redrive-alerts"
    alert_email_to: str | None = Field(default=None, description="Comma-separated addresses.")
    alert_email_from: str = "redrive@localhost"
    alert_burst_window_seconds: float = 300.0
    dagster_ui_url: str = "http://localhost:3000"
    mail_api_token: str = Field(default="sandbox-token", description="Bearer token of the mail provider (alerts).")
    # --- operator's checks (the `<pipeline>_backlog` asset checks) -------------------------------------
    dead_letter_max_age_hours: float = Field(
        default=24.0, gt=0, description="An unresolved dead letter older than this fails its pipeline's check.")
    due_work_max_wait_seconds: float = Field(
        default=900.0, gt=0, description="Due work waiting longer than this fails its pipeline's check (stuck).")
    pipeline_stall_seconds: float = Field(
        default=180.0, gt=0, description="Due work and no progress for this long: the pipeline is stalled (one alert, "
                                         "a failing `pipeline_progressing` check) until it moves again.")
    run_dead_after_seconds: float = Field(
        default=90.0, gt=0, description="A STARTED run with no heartbeat for this long is failed by the run watchdog "
                                        "(its worker beats every 10 s).")

    # --- retention (redrive.retention; docs/operating.md "Retention"): days after a row finished, 0 = for ever ---
    retention_finished_work_days: float = Field(
        default=7.0, description="Finished work: done work-queue rows, started timers, stage checkpoints, "
        "pipelines' finished entities (an entity with anything open is never touched).")
    retention_resolved_dead_letter_days: float = Field(
        default=90.0, description="Resolved dead letters, from their resolution (an unresolved one is kept for ever).")
    retention_alert_days: float = Field(default=90.0, description="Alerts and their deliveries, once none is pending.")
    retention_healthcheck_days: float = Field(default=30.0, description="The smoke job's traces.")
    retention_personal_data_days: float = Field(
        default=7.0, description="Personal fields (addresses, URLs, payloads) of records kept longer as idempotency "
        "keys or audit: cleared, the rest kept.")
    retention_idempotency_days: float = Field(
        default=90.0, description="Records kept as idempotency keys or audit (criticizer requests, review jobs, "
        "evidence file jobs, revoked API tokens), personal fields already cleared.")
    retention_conversion_files_days: float = Field(
        default=30.0, description="A conversion job's PDF and XML, from the job's end; afterwards its download and "
        "Retry answer 410 EXPIRED (003).")
    retention_conversion_job_days: float = Field(
        default=90.0, description="A conversion job's row and events, from the job's end (its files went first).")
    retention_matching_document_days: float = Field(
        default=365.0, description="Matched documents (the corpus new documents are matched against) and their "
        "matches, from their last change.")
    retention_batch_size: int = Field(default=1000, gt=0, description="Rows per pruner batch (one transaction).")
    retention_pause_seconds: float = Field(default=0.2, ge=0, description="Pause between two pruner batches.")
    retention_max_run_seconds: float = Field(default=900.0, gt=0, description="A pruner run stops after this; the "
                                             "next one goes on.")
    retention_dagster_run_days: float = Field(
        default=7.0, description="Dagster runs of drain and maintenance jobs that succeeded (or were canceled).")
    retention_dagster_failed_run_days: float = Field(
        default=30.0, description="Dagster runs of drain and maintenance jobs that failed.")

    # --- keys (redrive.keys; unset: generated once per install under REDRIVE_DATA_DIR/keys) ---------
    redrive_redaction_key: SecretStr | None = Field(
        default=None, description="HMAC key of redaction markers, so a redacted phone number cannot be guessed back."
    )
    redrive_secrets_key: SecretStr | None = Field(
        default=None, description="Fernet key(s), comma-separated newest first, for secrets stored in tables."
    )

    # --- retry timing ----------------------------------------------------------
    redrive_time_scale: float = Field(
        default=1.0,
        description="Multiplies every backoff wait; 0.001 turns a 30-minute backoff into 1.8 s.",
    )
    redrive_durable_wait_threshold_seconds: float = Field(
        default=300.0,
        description="Retry waits longer than this leave the run and become a durable timer in Postgres.",
    )

    # --- upstream limits, shared by every run and process (issue 26; docs/operating.md "Upstream limits") ---
    # JSON per upstream, e.g. REDRIVE_UPSTREAM_LLM='{"max_concurrent": 60, "rate_per_second": 45,
    # "retry_share": 0.1}'. Unset: calls to that upstream go straight out, as before.
    redrive_upstream_llm: UpstreamLimits | None = None
    redrive_upstream_artifact_store: UpstreamLimits | None = None
    redrive_upstream_case_api: UpstreamLimits | None = None
    redrive_upstream_mail: UpstreamLimits | None = None
    redrive_upstream_pdf_gateway: UpstreamLimits | None = None
    redrive_upstream_webhooks: UpstreamLimits | None = None
    redrive_upstream_slack: UpstreamLimits | None = None

    # --- drain runs per pipeline (issue 26 §2): JSON maps by pipeline name, e.g.
    # REDRIVE_DRAIN_IN_FLIGHT='{"criticizer": 64}' REDRIVE_DRAIN_RUNS='{"criticizer": 2}'
    redrive_drain_in_flight: dict[str, int] = Field(
        default_factory=dict, description="Entities one drain run works at once, per pipeline (default: the criticizer 64, others 8); "
        "a run config's `concurrency` wins.")
    redrive_drain_runs: dict[str, int] = Field(
        default_factory=dict, description="Drain runs of one pipeline at once, per pipeline (default 1); they "
        "share the queue (SKIP LOCKED, fenced leases). The run queue caps any pipeline at 8.")

    def drain_in_flight(self, pipeline: str, default: int = 8) -> int:
        return max(1, self.redrive_drain_in_flight.get(pipeline, default))

    def drain_runs(self, pipeline: str) -> int:
        return max(1, self.redrive_drain_runs.get(pipeline, 1))

    def upstream_limits(self) -> dict[str, UpstreamLimits]:
        """The configured upstreams' limits by name (`redrive.upstream_policy.UPSTREAMS`)."""
        found = {name: getattr(self, f"redrive_upstream_{name}") for name in UPSTREAMS}
        return {name: limits for name, limits in found.items() if limits is not None}

    def _sandbox(self, path: str) -> str | None:
        return f"{self.sandbox_url.rstrip('/')}{path}" if self.sandbox_url else None

    @property
    def llm_url(self) -> str | None:
        return self.llm_base_url or self._sandbox("/llm/v1")

    @property
    def case_url(self) -> str | None:
        return self.case_api_url or self._sandbox("/case/v1")

    @property
    def mail_url(self) -> str | None:
        return self.mail_api_url or self._sandbox("/mail/v1")

    @property
    def pdf_url(self) -> str | None:
        return self.pdf_gateway_url or self._sandbox("/pdf/v1")

    @property
    def store_url(self) -> str | None:
        return self.artifact_store_url or self._sandbox("/store")

    @property
    def slack_api_url(self) -> str | None:
        return self.slack_api_base_url or self._sandbox("/slack/api/")

    @property
    def alert_email_recipients(self) -> list[str]:
        return [a.strip() for a in (self.alert_email_to or "").split(",") if a.strip()]


@lru_cache(maxsize=1)
def cached_settings() -> Settings:
    """Settings for long-lived processes; tests build `Settings()` directly."""
    return Settings()
