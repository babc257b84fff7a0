"""Fixtures of the evidence pipeline's tests: its bucket in moto, runtimes on a frozen clock, a driver."""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime

import boto3
import sqlalchemy as sa
import pytest

from redrive.clock import FrozenClock
from redrive.reliability import Reliability
from resources.aws import ensure_bucket
from resources.factory import notifier_from
from tests.evidence.helpers import Driver

START = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)


@pytest.fixture
def s3(stack):
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
    return client


@pytest.fixture
def bucket(s3, settings) -> str:
    ensure_bucket(s3, settings.redrive_bucket)
    return settings.redrive_bucket


@pytest.fixture
def clock() -> FrozenClock:
    return FrozenClock(START)


@pytest.fixture
def runtime(engine, settings, clock) -> Reliability:
    """The core's runtime on this test's database, the sandbox's Slack and mail, and a frozen clock."""
    return Reliability(engine=engine, channels=notifier_from(settings).channels(), clock=clock, jitter_seed="t",
                       time_scale=1.0)


@pytest.fixture
def fast_settings(scaled_settings):
    """Backoff waits × 0: a retry is due at once, so a driver loop needs no clock and no sleep."""
    return scaled_settings.model_copy(update={"redrive_time_scale": 0.0})


@pytest.fixture
def inbox(monkeypatch) -> str:
    """An inbox prefix of this test's own (moto lives for the whole session)."""
    prefix = f"evidence/inbox/{uuid.uuid4().hex[:8]}/"
    monkeypatch.setenv("EVIDENCE_INBOX_PREFIX", prefix)
    return prefix


@pytest.fixture
def fast_defs(fast_settings, inbox):
    from orchestration.definitions import build_definitions

    return build_definitions(fast_settings)


@pytest.fixture
def driver(fast_defs, instance) -> Driver:
    return Driver(fast_defs, instance)


@pytest.fixture
def case_api(settings):
    from resources.evidence import CaseApiResource

    with CaseApiResource(base_url=settings.case_url, token="sandbox-token", timeout_seconds=5).session() as api:
        yield api


@pytest.fixture
def mail(settings):
    from resources.evidence import MerchantMailResource

    with MerchantMailResource(base_url=settings.mail_url, timeout_seconds=5).session() as client:
        yield client


@pytest.fixture
def seed_job(engine, clock):
    """Record an ingested file job straight from a generated ZIP (no S3 needed: the case API reads the key)."""
    from assets.evidence import policy
    from assets.evidence import repository as repo
    from tests.evidence.helpers import standard_job

    def seed(name: str = "w", *, rows: int = 1, per_row: int = 3, data: bytes | None = None):
        if data is None:
            data, _ = standard_job(name, rows, per_row)
        parsed = policy.parse_archive(data, file_types=frozenset({"pdf", "png", "txt"}),
                                      limits=policy.ArchiveLimits(max_file_bytes=10**7, max_archive_bytes=10**9))
        job_id = policy.file_job_id("bucket", f"inbox/{name}.zip", "etag")
        with engine.begin() as conn:
            job = repo.upsert_file_job(conn, job_id, bucket="bucket", key=f"inbox/{name}.zip", etag="etag",
                                       notify_to="merchant@example.com", now=clock.now())
            repo.record_ingest(conn, job, parsed, s3_uri=lambda aid, n: f"s3://bucket/files/{aid}/{n}", now=clock.now())
            events = conn.execute(sa.select(repo.evidence_outbox.c.event_id, repo.evidence_outbox.c.file_job_row_id)
                                  .where(repo.evidence_outbox.c.file_job_id == job_id)
                                  .order_by(repo.evidence_outbox.c.seq)).all()
        return job_id, [e.event_id for e in events], [e.file_job_row_id for e in events]

    return seed
