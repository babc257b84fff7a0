"""The evidence tables: the migration matches the models, and 004's generated columns match the core's table."""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from assets.evidence import repository as repo
from redrive.db import VERSION_TABLE
from orchestration.registry import all_metadata
from redrive.vocabularies import EVIDENCE, EVIDENCE_CATEGORY_CODES, EVIDENCE_RETRYABLE_CATEGORIES, evidence_category

MINE = {"file_job", "file_job_row", "file_job_artifact", "evidence_outbox", "evidence_scheduler_ticks",
        "evidence_metrics", "evidence_alert_state"}


def _tables_in(diff: object) -> set[str]:
    found: set[str] = set()
    stack = [diff]
    while stack:
        item = stack.pop()
        if isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, sa.Table):
            found.add(item.name)
        elif isinstance(item, sa.Index | sa.Column | sa.Constraint) and getattr(item, "table", None) is not None:
            found.add(item.table.name)
        elif isinstance(item, str):
            found.add(item)
    return found


def test_evidence_migration_matches_models(engine: sa.Engine) -> None:
    """Migration 0201 creates exactly the evidence tables, columns and indexes the repository declares."""
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "version_table": VERSION_TABLE})
        diff = compare_metadata(ctx, all_metadata())
        indexes = {ix["name"]: ix for ix in sa.inspect(conn).get_indexes("file_job_artifact")}
    assert [d for d in diff if _tables_in(d) & MINE] == []
    assert {"idx_artifact_retry_scan", "idx_artifact_retry_cover", "idx_artifact_by_job_row"} <= set(indexes)
    assert indexes["idx_artifact_retry_cover"]["include_columns"] == [
        "id", "file_job_id", "file_job_row_id", "s3_key", "case_id", "retry_status", "attachment_status"]


def test_generated_error_category_matches_the_core_row_by_row(engine: sa.Engine) -> None:
    """For every code (004's, the vocabulary's, unknown and NULL) × retry_count, the SQL generated
    error_category/is_retryable equal `evidence_category` and the retryable categories in Python."""
    codes: list[str | None] = sorted({c for _, cs in EVIDENCE_CATEGORY_CODES for c in cs} | set(EVIDENCE.codes)
                                     | {"SOMETHING_ELSE", "429", "RETRY_FAILED"})
    codes.append(None)
    job, row = uuid.uuid4(), uuid.uuid4()
    with engine.begin() as conn:
        conn.execute(sa.insert(repo.file_job).values(id=job, source_bucket="b", source_key="k", source_etag="e",
                                                     notify_to="m@example.com"))
        conn.execute(sa.insert(repo.file_job_row).values(id=row, file_job_id=job, line_no=2, case_ref="c"))
        expected = {}
        for code in codes:
            for retry_count in (0, 1, 2):
                aid = uuid.uuid4()
                conn.execute(sa.insert(repo.file_job_artifact).values(
                    id=aid, file_job_id=job, file_job_row_id=row, case_id=uuid.uuid4(), file_name="f.pdf",
                    s3_key="s3://b/f", attachment_error_code=code, retry_count=retry_count))
                category = evidence_category(code)
                expected[aid] = (category, category in EVIDENCE_RETRYABLE_CATEGORIES and retry_count < 2)
        got = {r.id: (r.error_category, r.is_retryable) for r in conn.execute(
            sa.select(repo.file_job_artifact.c.id, repo.file_job_artifact.c.error_category,
                      repo.file_job_artifact.c.is_retryable))}
    assert len(got) == len(codes) * 3
    assert got == expected


def test_migration_0202_puts_recorded_rows_on_the_work_queue(admin_url: str) -> None:
    """Rows recorded before the drain get work items: in flight → due at their earliest retry, with an
    unresolved dead letter → dead, finished → done; rows without artifacts get none."""
    import os
    from datetime import UTC, datetime, timedelta

    from alembic import command

    from devstack.postgres import create_database, drop_database, with_database
    from redrive.db import alembic_config, engine_for

    name = f"redrive_m0202_{os.getpid()}"
    drop_database(admin_url, name)
    create_database(admin_url, name)
    url = with_database(admin_url, name)
    try:
        cfg = alembic_config(url)
        command.upgrade(cfg, "0004")
        command.upgrade(cfg, "0201")
        engine = engine_for(url)
        job, due_at = uuid.uuid4(), datetime(2026, 3, 2, 9, 5, tzinfo=UTC)
        rows = {kind: uuid.uuid4() for kind in ("open", "dead", "done", "empty")}
        with engine.begin() as conn:
            conn.execute(sa.insert(repo.file_job).values(id=job, source_bucket="b", source_key="k", source_etag="e",
                                                         notify_to="m@example.com"))
            for line, (kind, row) in enumerate(rows.items(), start=2):
                conn.execute(sa.insert(repo.file_job_row).values(id=row, file_job_id=job, line_no=line, case_ref=kind))

            def art(row, **values):
                conn.execute(sa.insert(repo.file_job_artifact).values(
                    id=uuid.uuid4(), file_job_id=job, file_job_row_id=row, case_id=uuid.uuid4(), file_name="f.pdf",
                    s3_key="s3://b/f", **values))
            art(rows["open"], attachment_status="FAILED", attachment_error_code="503", retry_status="RETRY_FAILED",
                next_retry_at=due_at, attempt_count=1)
            art(rows["open"], attachment_status="FAILED", attachment_error_code="503", retry_status="RETRY_FAILED",
                next_retry_at=due_at + timedelta(minutes=3), attempt_count=1)
            art(rows["dead"], attachment_status="FAILED", attachment_error_code="CASE_NOT_FOUND",
                retry_status="PERMANENT_FAILED", attempt_count=1)
            art(rows["done"], attachment_status="ATTACHED", attempt_count=1)
            conn.execute(sa.text(
                "INSERT INTO dead_letters (pipeline, stage, entity_ref, error_class, error_message, retryable, attempts, "
                "first_failure_at, last_failure_at, status) VALUES ('evidence', 'attach', :ref, 'CASE_NOT_FOUND', "
                "'gone', false, 1, now(), now(), 'open')"),
                {"ref": f"{job}/{rows['dead']}"})
        command.upgrade(cfg, "0202")
        with engine.connect() as conn:
            got = {r.entity_ref.split("/")[1]: (r.status, r.group_key, r.due_at) for r in conn.execute(
                sa.text("SELECT entity_ref, status, group_key, due_at FROM work_items WHERE pipeline = 'evidence'"))}
        assert {k: v[0] for k, v in got.items()} == {str(rows["open"]): "due", str(rows["dead"]): "dead",
                                                      str(rows["done"]): "done"}
        assert got[str(rows["open"])][1:] == (str(job), due_at)
        engine.dispose()
    finally:
        drop_database(admin_url, name)
