"""The evidence pipeline's work against the outside world: ingest a file job from S3, attach a row's
evidence through the case API (004 §4, Option A), and send N1/N2 (§5). Dagster-free; ops call it.

Per-artifact failures are data, not exceptions: each is classified by the core (`EVIDENCE`
vocabulary), decided by the core's budget with `EVIDENCE_BACKOFF`, and written to the artifact.
A row is one entity of the core's work queue (grouped by file job) and `row_handler` is how the
core's drain works it: a row with retries left falls due again at its next `next_retry_at` (its
retry event written in that transaction), so a 60-minute wait never holds a run; a row that ends
with failures an operator can act on is dead-lettered by the drain, like any drained entity.
"""

from __future__ import annotations

import logging
import posixpath
import tempfile
import zipfile
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO, Any
from uuid import UUID

import botocore.exceptions

from assets.evidence import contracts, policy, service
from assets.evidence import repository as repo
from assets.evidence.settings import EvidenceOptions
from redrive.drain import Attempt, Handler
from redrive.failures import Code, Failure, PermanentError, classify_exception
from redrive.reliability import Reliability
from redrive.sanitize import sanitize_text
from redrive.vocabularies import EVIDENCE
from redrive.upstream_policy import RetryDeferred
from resources.evidence import CaseApiClient, MailClient

log = logging.getLogger(__name__)

UPLOAD_THREADS = 8
UPLOAD_BUFFER_BYTES = 64 * 1024 * 1024  # evidence bytes held for uploads in flight, at most (+ one file)
SPOOL_IN_MEMORY_BYTES = 8 * 1024 * 1024  # a file job's ZIP is kept in memory up to this, on disk beyond
OUTCOME_BATCH = 20  # outcomes per transaction; the claims make a lost batch cost lookups, not duplicates
CONTENT_TYPES = {"pdf": "application/pdf", "png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg",
                 "gif": "image/gif", "txt": "text/plain", "csv": "text/csv", "html": "text/html"}


class WorkerHooks:
    """Test seam of the attach worker. `after_case_api` runs after the case API answered for an
    artifact and before its outcome is written: raising there is "the case API accepted it, then
    our database write failed"."""

    def after_case_api(self, artifact_id: UUID, outcome: policy.AttemptOutcome) -> None:
        return None


# -------------------------------------------------------------------------------------------- attach


@dataclass
class RowResult:
    file_job_id: UUID
    row_id: UUID
    event_id: UUID | None
    results: list[contracts.EvidenceArtifactResult] = field(default_factory=list)
    status: str = ""
    settled: bool = False
    summary: repo.RowSummary | None = None
    notifications: list[str] = field(default_factory=list)
    skipped: str | None = None

    def metadata(self) -> dict[str, Any]:
        return {
            "file_job_id": str(self.file_job_id), "row_id": str(self.row_id),
            "event_id": str(self.event_id) if self.event_id else "-",
            "attempted": len(self.results),
            "attached": sum(1 for r in self.results if r.status == policy.ATTACHED),
            "recovered_by_lookup": sum(1 for r in self.results if r.recovered_by_lookup),
            "failed_retryable": sum(1 for r in self.results if r.status == policy.FAILED and not r.final),
            "failed_final": sum(1 for r in self.results if r.status == policy.FAILED and r.final),
            "row_evidence_status": self.status, "row_settled": self.settled,
            "notifications_requested": ",".join(self.notifications) or "-",
            "skipped": self.skipped or "-",
        }


class AttachWorker:
    """004 §4 with Option A: the event names every artifact of a row; under the row's lock the worker
    skips what is ATTACHED, looks up what has a recorded attempt, and attaches the rest."""

    def __init__(self, runtime: Reliability, case_api: CaseApiClient, *, max_attempts: int,
                 hooks: WorkerHooks | None = None, run_id: str | None = None) -> None:
        self.runtime = runtime
        self.case_api = case_api
        self.max_attempts = max_attempts
        self.hooks = hooks or WorkerHooks()
        self.run_id = run_id

    def process_event(self, event_id: UUID) -> RowResult:
        with self.runtime.engine.connect() as conn:
            event = repo.get_event(conn, event_id)
        if event is None or event.file_job_row_id is None:
            raise PermanentError(Failure.of(Code.INVARIANT_VIOLATION, message=f"no attach event {event_id}"))
        parsed = contracts.parse_event(event.payload)
        if not isinstance(parsed, contracts.EvidenceAttachRequested | contracts.EvidenceAttachRetry):
            raise PermanentError(Failure.of(Code.INVARIANT_VIOLATION, message=f"event {event_id} is not an attach event"))
        mode: policy.Mode = "retry" if isinstance(parsed, contracts.EvidenceAttachRetry) else "initial"
        if event.status == "CONSUMED":
            return RowResult(parsed.file_job_id, parsed.file_job_row_id, event_id, skipped="event already consumed")
        return self.process_row(parsed.file_job_id, parsed.file_job_row_id, mode=mode,
                                named={a.artifact_id for a in parsed.artifacts}, event_id=event_id)

    def process_row(self, job_id: UUID, row_id: UUID, *, mode: policy.Mode, named: set[UUID] | None = None,
                    event_id: UUID | None = None) -> RowResult:
        engine = self.runtime.engine
        result = RowResult(job_id, row_id, event_id)
        with engine.connect() as lock_conn, lock_conn.begin():
            if repo.lock_row(lock_conn, job_id, row_id) is None:
                raise PermanentError(Failure.of(Code.INVARIANT_VIOLATION, message=f"no row {row_id} in {job_id}"))
            artifacts = repo.row_artifacts(lock_conn, job_id, row_id)
            plan = policy.plan_attempts(artifacts, named=named if named is not None else {a.id for a in artifacts},
                                        mode=mode, now=self.runtime.now(), max_attempts=self.max_attempts)
            with engine.begin() as conn:  # committed before any call: the attempt is on record
                repo.claim_attempts(conn, plan, self.runtime.now())
            pending: list[policy.ArtifactWrite] = []
            for planned in plan:
                outcome = self._attempt(planned, last=mode == "replay" or planned.attempt >= self.max_attempts)
                self.hooks.after_case_api(planned.artifact.id, outcome)
                write, done = self._decide(planned, outcome, replay=mode == "replay")
                pending.append(write)
                result.results.append(done)
                if len(pending) >= OUTCOME_BATCH:
                    self._flush(pending)
            self._flush(pending)
            now = self.runtime.now()
            summary = repo.refresh_row(lock_conn, job_id, row_id, now)
            repo.consume_row_events(lock_conn, job_id, row_id, now)
            result.notifications = service.request_notifications(lock_conn, job_id, now)
        result.status, result.settled, result.summary = summary.status, summary.settled, summary
        return result

    def _attempt(self, planned: policy.PlannedAttempt, *, last: bool) -> policy.AttemptOutcome:
        a = planned.artifact
        try:
            if planned.lookup_first:  # the race 004 §4 misses: attached at the API, not on record here
                found = self.case_api.lookup(a.id)
                if found is not None:
                    return policy.AttemptOutcome(found.attachment_id, recovered_by_lookup=True)
            done = self.case_api.attach(a.case_id, a.id, filename=posixpath.basename(a.file_name),
                                        content_sha256=a.content_sha256 or "", s3_key=a.s3_key)
            return policy.AttemptOutcome(done.attachment_id)
        except RetryDeferred:
            raise  # the case API's retry budget held this retry back before sending: the drain defers the row
        except Exception as exc:  # noqa: BLE001 - every failure is classified into 004's codes
            failure = EVIDENCE.apply(classify_exception(exc, now=self.runtime.now()))
        if failure.retryable and last:
            # The last attempt ended in an unknown outcome (a 5xx, a timeout, a lost answer): before calling
            # it failed for good, ask whether it was attached after all, or N2 would report a file as failed
            # that the case holds.
            try:
                found = self.case_api.lookup(a.id)
            except Exception:  # noqa: BLE001 - the lookup is a courtesy; the failure stands
                found = None
            if found is not None:
                return policy.AttemptOutcome(found.attachment_id, recovered_by_lookup=True)
        return policy.AttemptOutcome(failure=failure)

    def _flush(self, pending: list[policy.ArtifactWrite]) -> None:
        """Write outcomes in small batches. Until written, each artifact's committed claim stands for its
        attempt: a crash here costs a lookup per artifact on the next run, never a second attachment."""
        if pending:
            with self.runtime.engine.begin() as conn:
                for write in pending:
                    if not repo.write_outcome(conn, write, write.decided_at):
                        log.warning("artifact %s: attempt %s was already recorded; outcome not written",
                                    write.artifact_id, write.attempt_count)
            pending.clear()

    def _decide(self, planned: policy.PlannedAttempt, outcome: policy.AttemptOutcome, *,
                replay: bool) -> tuple[policy.ArtifactWrite, contracts.EvidenceArtifactResult]:
        now = self.runtime.now()
        a = planned.artifact
        # Jitter per file job and attempt: a file job's failures of one pass fall due together, so each
        # retry round of a file job is one drain run, while file jobs still spread apart.
        rng = self.runtime.rng_for(f"evidence:{a.file_job_id}:{planned.attempt}")
        write = policy.decide_write(planned, outcome, now=now, rng=rng,
                                    time_scale=self.runtime.time_scale, max_attempts=self.max_attempts, replay=replay)
        return write, contracts.EvidenceArtifactResult(
            artifact_id=a.id, file_job_id=a.file_job_id, file_job_row_id=a.file_job_row_id, case_id=a.case_id,
            status=write.attachment_status, error_code=write.attachment_error_code, attempt=planned.attempt,
            final=write.final, recovered_by_lookup=outcome.recovered_by_lookup, occurred_at=now)


def row_final_failure(summary: repo.RowSummary) -> Failure | None:
    """What a settled row's dead letter says, or None when the row needs no operator (all attached, or
    only DATA failures, which N2 reports to the merchant and no replay could fix)."""
    final = [f for f in summary.failed if f.final]
    code = policy.row_final_code([f.error_code for f in final])
    if code is None:
        return None
    top, count = code
    return Failure(
        code=top, retryable=False, retry_after=None,
        message=f"{len(final)} of {summary.counts.total} evidence files of case {summary.case_ref} failed for good "
                f"({top}×{count})",
        detail=sanitize_text("; ".join(f"{f.file_name}: {f.error_code}" for f in final))[:2000],
    )


def retried_class(result: RowResult) -> str | None:
    """The error class this pass's retryable artifact failures are counted under (the most frequent;
    None when the pass only waits for artifacts of earlier passes)."""
    codes = Counter(r.error_code or Code.UNKNOWN.value for r in result.results
                    if r.status == policy.FAILED and not r.final)
    return min(codes, key=lambda c: (-codes[c], c)) if codes else None


def row_handler(runtime: Reliability, case_api: CaseApiClient, *, max_attempts: int,
                hooks: WorkerHooks | None = None, run_id: str | None = None) -> Handler:
    """How the core's drain works one row (entity `<file job>/<row>`): attempt what is due, then settle.

    - retryable failures left: the row is due again at its earliest `next_retry_at`, and its
      EVIDENCE_ATTACH_RETRY event (004 §3) is written in the same transaction as that due time;
    - settled with final failures an operator can act on: raised as permanent, so the drain writes
      the dead letter, its alert and the work row's `dead` in one transaction;
    - settled otherwise: done (a replayed letter is closed).
    Whatever stops the whole row (the database, a bug) propagates and the drain retries the row under
    `ATTACH_POLICY`; claims and lookups make that safe after a partial pass.
    """
    attach = AttachWorker(runtime, case_api, max_attempts=max_attempts, hooks=hooks, run_id=run_id)

    def handle(attempt: Attempt) -> None:
        job_id, row_id = policy.split_row_entity(attempt.entity_ref)
        attempt.payload_ref = {"table": "file_job_row", "id": str(row_id), "file_job_id": str(job_id)}
        attempt.context = {"file_job_id": str(job_id), "row_id": str(row_id)}
        mode: policy.Mode = "replay" if attempt.replay_of is not None else "retry"
        # counted as it settles: a pass with artifacts failing retryably is a retry, not an ok attempt
        out = attempt.stage("attach", lambda: {"result": attach.process_row(job_id, row_id, mode=mode)},
                            checkpoint=False, observe=False)
        result: RowResult = out["result"]
        summary = result.summary
        assert summary is not None
        attempt.context.update(case_ref=summary.case_ref, evidence_status=summary.status)
        if not summary.settled:
            attempt.retry_error_class = retried_class(result)
            with runtime.engine.connect() as conn:
                due = repo.next_retry_at(conn, job_id, row_id)
            # nothing retryable dated (cannot happen by policy): look again in a minute rather than spin
            attempt.due_again_at = max(due, runtime.now()) if due is not None else \
                runtime.now() + timedelta(seconds=60 * runtime.time_scale)

            def schedule(conn: Any) -> None:
                repo.schedule_row_retry(conn, job_id, row_id, runtime.now())

            attempt.on_success.append(schedule)
            return
        failure = row_final_failure(summary)
        if failure is not None:
            attempt.context["failed"] = {str(f.artifact_id): f.error_code for f in summary.failed if f.final}
            raise PermanentError(failure)

    return handle


# ------------------------------------------------------------------------------------ notifications


@dataclass(frozen=True)
class Sent:
    kind: str
    message_id: str
    already_sent: bool


class NotificationSender:
    """Send-then-mark (§5) under the file job's lock, with the notification's fixed idempotency token:
    a crash between send and mark resends the same stored message under the same token, which the
    provider answers with the first message instead of a second e-mail."""

    def __init__(self, runtime: Reliability, mail: MailClient, *, run_id: str | None = None) -> None:
        self.runtime = runtime
        self.mail = mail
        self.run_id = run_id

    def send_pending(self, job_id: UUID) -> list[Sent]:
        with self.runtime.engine.connect() as conn:
            events = [e for e in repo.notification_events(conn, job_id) if e.status != "CONSUMED"]
        return [s for e in events if (s := self.send(e.event_id)) is not None]

    def send(self, event_id: UUID) -> Sent | None:
        engine = self.runtime.engine
        with engine.connect() as conn, conn.begin():
            event = repo.get_event(conn, event_id)
            if event is None or event.status == "CONSUMED":
                return None
            note = contracts.parse_event(event.payload)
            if not isinstance(note, contracts.EvidenceNotificationRequested):
                raise PermanentError(Failure.of(Code.INVARIANT_VIOLATION, message=f"{event_id} is not a notification"))
            job = repo.get_file_job(conn, note.file_job_id, lock=True)
            assert job is not None
            already = (job.n1_sent_at if note.kind == "N1" else job.n2_sent_at) is not None
            message_id = job.n1_message_id if note.kind == "N1" else job.n2_message_id
            if not already:
                message_id = self.mail.send(to=note.to, subject=note.subject, text=note.text,
                                            token=note.idempotency_token)
                repo.mark_notification_sent(conn, job.id, note.kind, message_id, self.runtime.now())
            repo.mark_consumed(conn, event_id, self.runtime.now())
        return Sent(note.kind, message_id or "", already)


# -------------------------------------------------------------------------------------------- ingest


@dataclass(frozen=True)
class IngestResult:
    status: str
    counts: dict[str, int]
    errors: dict[str, int]
    notifications: list[str]


def ingest(runtime: Reliability, s3: Any, options: EvidenceOptions, job: repo.FileJob) -> IngestResult:
    """Read the file job's ZIP, extract its evidence to S3, and record rows, artifacts and their attach
    events in one transaction. An unreadable archive is the file job's error (N1/N2 tell the merchant),
    not a crash; S3 trouble other than a missing object is raised for the stage runner to retry.
    The ZIP is spooled to disk and read member by member, so memory does not grow with the archive."""
    if job.status != policy.RECEIVED:
        return IngestResult(job.status, {}, {}, [])
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES) as spool:
        try:
            obj = s3.get_object(Bucket=job.source_bucket, Key=job.source_key)
            etag = str(obj.get("ETag", "")).strip('"')
            if etag != job.source_etag.strip('"'):
                obj["Body"].close()
                raise policy.ArchiveRejected(policy.S3_NOT_FOUND, "the uploaded version was replaced by a newer upload")
            _download(obj, spool, options.max_zip_bytes)
            parsed = policy.parse_archive(spool, file_types=options.file_types(), limits=options.archive_limits())
        except policy.ArchiveRejected as rejected:
            return _reject(runtime, job, rejected.code, rejected.message)
        except botocore.exceptions.ClientError as exc:
            if (exc.response.get("Error") or {}).get("Code") not in ("NoSuchKey", "404", "NotFound"):
                raise
            return _reject(runtime, job, policy.S3_NOT_FOUND, "the uploaded archive is no longer in S3")
        _upload(s3, options, job, spool, parsed)
    with runtime.engine.begin() as conn:
        current = repo.get_file_job(conn, job.id, lock=True)
        if current is None or current.status != policy.RECEIVED:  # another run got here first
            return IngestResult(current.status if current else "missing", {}, {}, [])
        counts = repo.record_ingest(conn, current, parsed, now=runtime.now(),
                                    s3_uri=lambda aid, name: options.s3_uri(job.id, aid, name))
        notes = service.request_notifications(conn, job.id, runtime.now())
    return IngestResult(policy.INGESTED, counts, parsed.error_counts(), notes)


def _download(obj: dict[str, Any], spool: IO[bytes], limit: int) -> None:
    """Copy the object's body into `spool` in chunks, refusing it past `limit` bytes (declared or read)."""
    too_big = policy.ArchiveRejected(policy.INVALID_FORMAT, f"the uploaded archive is larger than {limit} bytes")
    body = obj["Body"]
    try:
        if int(obj.get("ContentLength") or 0) > limit:
            raise too_big
        size = 0
        while chunk := body.read(policy.READ_CHUNK):
            size += len(chunk)
            if size > limit:
                raise too_big
            spool.write(chunk)
    finally:
        body.close()
    spool.seek(0)


def _reject(runtime: Reliability, job: repo.FileJob, code: str, message: str) -> IngestResult:
    with runtime.engine.begin() as conn:
        repo.mark_ingest_failed(conn, job.id, code, message, runtime.now())
        notes = service.request_notifications(conn, job.id, runtime.now())
    log.warning("file job %s rejected: %s (%s)", job.id, code, message)
    return IngestResult(policy.INGEST_FAILED, {"rows": 0, "artifacts": 0}, {code: 1}, notes)


def _upload(s3: Any, options: EvidenceOptions, job: repo.FileJob, archive: IO[bytes],
            parsed: policy.ParsedArchive) -> None:
    """Put every valid file under its derived key; a re-run puts the same bytes at the same keys.
    At most UPLOAD_BUFFER_BYTES of files (and one more file) are held while uploads are in flight."""
    zf = zipfile.ZipFile(archive)
    members: dict[str | None, zipfile.ZipInfo] = {}
    for info in zf.infolist():
        if not info.is_dir():
            members.setdefault(policy.normalise_member(info.filename), info)  # first wins, as in parse_archive

    def put(key: str, body: bytes, content_type: str, sha: str) -> None:
        s3.put_object(Bucket=options.bucket, Key=key, Body=body, ContentType=content_type,
                      Metadata={"sha256": sha, "file-job-id": str(job.id)})

    in_flight: deque[tuple[Future[None], int]] = deque()
    held = 0
    with ThreadPoolExecutor(max_workers=UPLOAD_THREADS) as pool:
        for prow in parsed.rows:
            if not prow.ok:
                continue
            rid = policy.row_id(job.id, prow.line_no)
            for f in prow.files:
                if not f.ok:
                    continue
                while in_flight and (len(in_flight) >= 4 * UPLOAD_THREADS
                                     or held + (f.size or 0) > UPLOAD_BUFFER_BYTES):
                    done, size = in_flight.popleft()
                    done.result()  # the first S3 error is raised for the stage runner
                    held -= size
                aid = policy.artifact_id(rid, f.index, f.name)
                body = policy.read_member(zf, members[f.name], options.max_file_bytes)
                in_flight.append((pool.submit(put, options.s3_key(job.id, aid, f.name), body,
                                              CONTENT_TYPES.get(f.file_type or "", "application/octet-stream"),
                                              f.sha256 or ""), len(body)))
                held += len(body)
        while in_flight:
            in_flight.popleft()[0].result()
