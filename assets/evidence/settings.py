"""The evidence pipeline's knobs (env vars prefixed EVIDENCE_), read when Definitions are built."""

from __future__ import annotations

from dagster import ConfigurableResource
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from assets.evidence.policy import ArchiveLimits, Thresholds

_LIMITS = ArchiveLimits()  # the one place the ingest limits' defaults are written


class EvidenceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EVIDENCE_", extra="ignore", case_sensitive=False)

    # --- where file jobs come from -------------------------------------------------------------
    bucket: str | None = Field(default=None, description="Bucket of the inbox and the extracted files; "
                               "unset: REDRIVE_BUCKET.")
    inbox_prefix: str = Field(default="evidence/inbox/", description="ZIP file jobs are picked up under this prefix.")
    files_prefix: str = Field(default="evidence/files/", description="Extracted evidence files are written here.")
    default_notify_to: str = Field(default="disputes@localhost",
                                   description="N1/N2 recipient when the ZIP has no x-amz-meta-notify-to.")
    allowed_file_types: str = Field(default="pdf,jpg,jpeg,png,gif,tif,tiff,txt,csv,eml,msg,doc,docx,xls,xlsx,html",
                                    description="Comma-separated extensions the case API accepts.")
    # --- bounded input: crossing any of these is INVALID_FORMAT for the file or the whole archive ----
    max_file_bytes: int = Field(default=_LIMITS.max_file_bytes, ge=1,
                                description="Evidence files larger than this (declared or actual) are INVALID_FORMAT.")
    max_archive_bytes: int = Field(default=_LIMITS.max_archive_bytes, ge=1,
                                   description="Uncompressed size above which an archive is refused (zip bombs).")
    max_zip_bytes: int = Field(default=1024 * 1024 * 1024, ge=1,
                               description="Compressed size above which an upload is refused unread "
                                           "(it is spooled to disk, not memory).")
    max_manifest_bytes: int = Field(default=_LIMITS.max_manifest_bytes, ge=1,
                                    description="manifest.csv larger than this (declared or actual) rejects the archive.")
    max_manifest_rows: int = Field(default=_LIMITS.max_manifest_rows, ge=1,
                                   description="More manifest rows than this reject the archive.")
    max_named_files: int = Field(default=_LIMITS.max_named_files, ge=1,
                                 description="More evidence files named in the manifest than this reject the archive.")
    max_members: int = Field(default=_LIMITS.max_members, ge=1,
                             description="More ZIP entries than this reject the archive before its directory is read.")

    # --- 004 §3 retry policy ------------------------------------------------------------------------
    max_attempts: int = Field(default=3, ge=1, description="Attempts per artifact, initial + retries (004: 3).")

    # --- 004 §3 scheduler -----------------------------------------------------------------------------
    scheduler_batch_rows: int = Field(default=200, ge=1, description="Rows requeued per scheduler tick at most.")
    scheduler_scan_artifacts: int = Field(default=1000, ge=1,
                                          description="Due artifacts read per tick to find those rows.")
    scheduler_interval_seconds: int = Field(default=60, ge=1)

    # --- outbox publisher -------------------------------------------------------------------------
    publisher_batch: int = Field(default=200, ge=1, description="Outbox events turned into runs per tick.")
    publisher_interval_seconds: int = Field(default=15, ge=1)
    republish_after_seconds: float = Field(default=1800.0,
                                           description="A published event not consumed by then is published again.")
    max_publish_attempts: int = Field(default=3, ge=1,
                                      description="Publications of one event before it is marked FAILED and alerted.")

    # --- 004 §5 notifications -------------------------------------------------------------------------
    n2_timeout_hours: float = Field(default=24.0, description="N2 is forced this long after N1 (not time-scaled).")
    n2_force_marks_permanent: bool = Field(default=True,
                                           description="A forced N2 marks the retryables still open PERMANENT_FAILED.")

    # --- 004 §6 monitoring --------------------------------------------------------------------------------
    monitor_cron: str = Field(default="*/5 * * * *")
    alert_permanent_rate: float = Field(default=0.10, description="Alert above this share of final failures in the window.")
    alert_permanent_window_seconds: float = Field(default=3600.0)
    alert_permanent_min_sample: int = Field(
        default=5, ge=1, description="No rate alert on fewer finished artifacts in the window: small, so a "
                                     "small merchant's 3 of 5 files failing for good alerts (004 §6 names no floor).")
    alert_queue_depth: int = Field(default=500, description="Alert when more artifacts wait for a retry …")
    alert_queue_depth_sustain_seconds: float = Field(default=600.0, description="… for this long.")
    alert_n2_avg_latency_seconds: float = Field(default=6 * 3600.0)
    alert_heartbeat_seconds: float = Field(default=900.0, description="Alert when the scheduler has not ticked for this long.")


class EvidenceOptions(ConfigurableResource):
    """What the evidence ops need of the settings, as a resource (resolved when Definitions are built)."""

    bucket: str
    files_prefix: str = "evidence/files/"
    default_notify_to: str = "disputes@localhost"
    allowed_file_types: str = EvidenceSettings.model_fields["allowed_file_types"].default
    max_file_bytes: int = _LIMITS.max_file_bytes
    max_archive_bytes: int = _LIMITS.max_archive_bytes
    max_zip_bytes: int = EvidenceSettings.model_fields["max_zip_bytes"].default
    max_manifest_bytes: int = _LIMITS.max_manifest_bytes
    max_manifest_rows: int = _LIMITS.max_manifest_rows
    max_named_files: int = _LIMITS.max_named_files
    max_members: int = _LIMITS.max_members
    max_attempts: int = 3
    n2_timeout_hours: float = 24.0
    alert_permanent_rate: float = 0.10
    alert_permanent_window_seconds: float = 3600.0
    alert_permanent_min_sample: int = EvidenceSettings.model_fields["alert_permanent_min_sample"].default
    alert_queue_depth: int = 500
    alert_queue_depth_sustain_seconds: float = 600.0
    alert_n2_avg_latency_seconds: float = 6 * 3600.0
    alert_heartbeat_seconds: float = 900.0

    @classmethod
    def from_settings(cls, evidence: EvidenceSettings, bucket: str) -> EvidenceOptions:
        shared = set(cls.model_fields) - {"bucket"}
        return cls(bucket=evidence.bucket or bucket, **evidence.model_dump(include=shared))

    def alert_thresholds(self) -> Thresholds:
        """004 §6's alert rules as the monitor applies them."""
        return Thresholds(self.alert_permanent_rate, self.alert_permanent_min_sample, self.alert_queue_depth,
                          self.alert_queue_depth_sustain_seconds, self.alert_n2_avg_latency_seconds,
                          self.alert_heartbeat_seconds)

    def archive_limits(self) -> ArchiveLimits:
        return ArchiveLimits(max_file_bytes=self.max_file_bytes, max_archive_bytes=self.max_archive_bytes,
                             max_manifest_bytes=self.max_manifest_bytes, max_manifest_rows=self.max_manifest_rows,
                             max_named_files=self.max_named_files, max_members=self.max_members)

    def file_types(self) -> frozenset[str]:
        return frozenset(t.strip().lower().lstrip(".") for t in self.allowed_file_types.split(",") if t.strip())

    def s3_key(self, file_job_id: object, artifact_id: object, file_name: str) -> str:
        """Where an extracted evidence file lives: derived from ids, never from the clock."""
        base = file_name.rsplit("/", 1)[-1]
        return f"{self.files_prefix.rstrip('/')}/{file_job_id}/{artifact_id}/{base}"

    def s3_uri(self, file_job_id: object, artifact_id: object, file_name: str) -> str:
        return f"s3://{self.bucket}/{self.s3_key(file_job_id, artifact_id, file_name)}"
