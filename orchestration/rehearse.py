"""`redrive rehearse`: something to act on for each runbook of docs/operating.md, on a running `make serve`.

A recipe seeds what its runbook section needs through the pipelines' own front doors (their submit APIs, the
conversion HTTP API, the matchmaking tables a producer fills) and arms its fault in the sandbox's scripting
(`/_admin/faults`), matched to the recipe's own entities so the rest of the stack keeps working. The deployed
topology then does the work — the daemon's sensors, drain runs, the conversion worker — and meets the fault as
it would in production; a fault that is no upstream's answer (a run worker dying mid-delivery) is dealt the way
production meets it (SIGKILL, as the OOM killer would). The command waits until the failure has happened and prints the shell variables the
section uses (`export LETTER=…`), so the runbook can be followed as written:

    redrive rehearse list
    eval "$(redrive rehearse llm-401)"      # then docs/operating.md §3 "Replay a dead letter", as written

Where the stack is: the environment (DATABASE_URL, SANDBOX_URL, CONVERSION_API, DAGSTER_UI_URL, AWS_ENDPOINT_URL),
else the running serve's `.data/serve.env`. Names are unique per call (a rehearsal tag), so it can be run again.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from devstack.dagster_api import DagsterApi
    from resources.matching import MatchingQueue


class RehearsalError(RuntimeError):
    """The stack is not there, or the failure did not happen in time; the message says which."""


@dataclass(frozen=True)
class Recipe:
    name: str
    sections: tuple[str, ...]  # the runbook sections of docs/operating.md it prepares
    fault: str  # what it arms, in the operator's words
    arm: Callable[[Rehearsal], dict[str, str]]


@dataclass
class Rehearsal:
    """One call's stack and tag; `wait` polls the database for what the stack does, up to `timeout`."""

    env: Mapping[str, str]
    tag: str
    timeout: float = 180.0

    def __post_init__(self) -> None:
        from devstack.sandbox import SandboxClient
        from redrive.db import engine_for

        missing = [k for k in ("DATABASE_URL", "SANDBOX_URL") if not self.env.get(k)]
        if missing:
            raise RehearsalError(f"no {', '.join(missing)}: start `make serve` (or export its .data/serve.env)")
        self.engine = engine_for(self.env["DATABASE_URL"])
        self.sandbox = SandboxClient(self.env["SANDBOX_URL"])

    def wait(self, what: str, probe: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            found = probe()
            if found:
                return found
            time.sleep(1.0)  # polling the running stack for the failure it was armed for
        raise RehearsalError(f"{what} did not happen within {self.timeout:.0f} s: is `make serve` running "
                             "(its daemon ticks the sensors)?")

    def read(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(conn, *args)` of a repository, on a connection of its own."""
        with self.engine.connect() as conn:
            return fn(conn, *args)

    def letter(self, pipeline: str, entity_ref: str) -> int | None:
        from redrive import deadletters

        found = self.read(deadletters.active_for, pipeline, entity_ref)
        return found.id if found else None


# ------------------------------------------------------------------------------------------------ recipes


def llm_401(r: Rehearsal, count: int = 3) -> dict[str, str]:
    """Criticizer requests whose `llm` stage meets a revoked key (401) after `fetch` succeeded: dead letters."""
    from assets.criticizer import api

    artifact = f"rehearse/{r.tag}/retry.py"
    r.sandbox.put_store(artifact, f"# rehearsal {r.tag}\ndef retry():\n    try: x()\n    except: pass\n".encode(),
                        "text/x-python")
    r.sandbox.script("llm", *[{"status": 401}] * count, match=f"rehearsal {r.tag}")
    requests = [api.submit(r.engine, {"request_id": f"rehearse-{r.tag}-{i}", "rubric": "Is the error handling sound?",
                                      "artifact_url": f"{r.env['SANDBOX_URL']}/store/{artifact}",
                                      "webhook_url": f"{r.env['SANDBOX_URL']}/webhook/rehearse-{r.tag}-{i}"},
                           allowed_artifact_prefixes=()).request_id for i in range(count)]
    letters = [r.wait(f"criticizer request {q} dead-lettered", lambda q=q: r.letter("criticizer", q))
               for q in requests]
    return {"REQUEST": requests[0], "LETTER": str(letters[0])}


def bad_profile(r: Rehearsal, users: int = 40) -> dict[str, str]:
    """40 matchmaking users of today's partition in the first timezone, one with an impossible age range, and the
    partition's run: 39 get offers, one is dead-lettered (DATA_INCONSISTENCY) and the partition is failed."""
    import sqlalchemy as sa

    from assets.matchmaking import synthetic
    from assets.matchmaking.pipeline import JOB, key_of
    from assets.matchmaking.policy import Partition
    from assets.matchmaking.settings import MatchmakingSettings

    tz = MatchmakingSettings().timezones[0]
    partition = Partition.parse(datetime.now(UTC).date().isoformat(), tz)
    rows = synthetic.users(users, timezone=tz, tag=f"rehearse-{r.tag}", regions=2)
    with r.engine.begin() as conn:
        synthetic.insert(conn, rows)
        conn.execute(sa.text("UPDATE matchmaking_users SET age_min = 40, age_max = 30 WHERE id = :u"),
                     {"u": rows[0]["id"]})
    key = key_of(partition)
    _dagster(r, "the partition's run").launch(JOB, partition_key=str(key), tags={"redrive/rehearsal": r.tag})
    ref = f"{partition.entity_ref}:{rows[0]['id']}"
    letter = r.wait(f"matchmaking user {ref} dead-lettered", lambda: r.letter("matchmaking", ref))
    return {"PARTITION": str(key), "LETTER": str(letter)}


def _dagster(r: Rehearsal, what: str) -> DagsterApi:
    """The deployment's webserver, which launches `what` as the UI's Launchpad would."""
    from devstack.dagster_api import DagsterApi
    from devstack.topology import LOCATION

    if not r.env.get("DAGSTER_UI_URL"):
        raise RehearsalError(f"no DAGSTER_UI_URL: {what} is launched through the webserver")
    return DagsterApi(r.env["DAGSTER_UI_URL"], LOCATION)


def _conversion_job(r: Rehearsal, token: str, text: str) -> str:
    import httpx

    from orchestration.demos.conversion import _pdf

    base = r.env.get("CONVERSION_API")
    if not base:
        raise RehearsalError("no CONVERSION_API: `make serve` serves it (see .data/serve.env)")
    created = httpx.post(f"{base}/api/jobs", content=_pdf(text), timeout=30,
                         headers={"authorization": f"Bearer {token}", "x-filename": f"{text}.pdf"})
    if created.status_code != 201:
        raise RehearsalError(f"the conversion API refused the rehearsal's PDF: {created.status_code}")
    return created.json()["id"]


def _token(r: Rehearsal) -> str:
    from assets.conversion import repository as repo

    with r.engine.begin() as conn:
        return repo.create_token(conn, "alice", label=f"rehearsal {r.tag}")


def gateway_reject(r: Rehearsal) -> dict[str, str]:
    """A conversion job the PDF gateway refuses (422): failed for good, its PDF kept, a Retry button."""
    token = _token(r)
    r.sandbox.script("pdf.convert", {"status": 422}, match=f"rehearsal-{r.tag}")
    job = _conversion_job(r, token, f"rehearsal-{r.tag}")
    from assets.conversion import repository as repo

    r.wait(f"conversion job {job} failed", lambda: r.read(repo.get, job).status == "failed")
    return {"TOKEN": token, "CONVERSION_JOB": job, "CONVERSION_API": r.env["CONVERSION_API"]}


def gateway_outage(r: Rehearsal, jobs: int = 12) -> dict[str, str]:
    """The PDF gateway is down for a while (503 to conversions and to the breaker's health probes): retries, then the
    breaker opens and stays open through ten probes (banner, /api/status)."""
    token = _token(r)
    r.sandbox.script("pdf.convert", *[{"status": 503}] * 40)
    r.sandbox.script("pdf.health", *[{"status": 503}] * 10)  # down for its probes too: open for ~10 cooldowns
    for i in range(jobs):
        _conversion_job(r, token, f"rehearsal-{r.tag}-{i}")
    from assets.conversion.settings import BREAKER
    from redrive import breaker

    r.wait(f"the {BREAKER} breaker opening", lambda: r.read(breaker.get_state, BREAKER).is_open)
    return {"TOKEN": token, "CONVERSION_API": r.env["CONVERSION_API"]}


def _aws(r: Rehearsal, service: str) -> Any:
    """A client of the stack's S3 or SQS (moto under `make serve`), with the stack's credentials."""
    import boto3

    return boto3.client(service, endpoint_url=r.env.get("AWS_ENDPOINT_URL") or None,
                        region_name=r.env.get("AWS_REGION") or r.env.get("AWS_DEFAULT_REGION") or None,
                        aws_access_key_id=r.env.get("AWS_ACCESS_KEY_ID") or None,
                        aws_secret_access_key=r.env.get("AWS_SECRET_ACCESS_KEY") or None)


def _matching_queue(r: Rehearsal) -> MatchingQueue:
    """The queue the code location drains (its MATCHING_* names), at the stack's SQS: ingestion's front door."""
    from assets.matching.pipeline import matching_resource
    from assets.matching.settings import MatchingSettings
    from redrive.settings import Settings
    from resources.matching import MatchingQueue

    found = matching_resource(Settings(aws_endpoint_url=r.env.get("AWS_ENDPOINT_URL") or None), MatchingSettings())
    return MatchingQueue(_aws(r, "sqs"), found.sqs(), found.queue_name, found.dlq_name,
                         found.visibility_timeout_seconds, found.max_receive_count)


def _matching_document(r: Rehearsal, kind: str, doc_type: str, references: list[str], text: str) -> dict[str, Any]:
    """One of the rehearsal's documents: its own tenant, so its only candidates are the rehearsal's others."""
    return {"id": f"rehearse-{r.tag}-{kind}", "tenant": f"rehearse-{r.tag}", "doc_type": doc_type,
            "counterparty": "ACME GmbH", "references": references, "amount": "1200.00", "currency": "EUR",
            "document_date": "2026-02-20", "text": text}


def _matching_status(r: Rehearsal, document_id: str) -> tuple[str | None, int]:
    """(matching_status, matching_attempts) of a document, as `redrive matching show` reads them."""
    from assets.matching import repository

    doc = r.read(repository.get, document_id) or {}
    return doc.get("matching_status"), int(doc.get("matching_attempts") or 0)


STUCK_DRAIN = {"visibility_scale": 0.001, "wait_seconds": 20}  # 5/30 min steps as 0.3/1.8 s; it waits for them


def stuck_document(r: Rehearsal, stuck_after: int = 60) -> dict[str, str]:
    """A matching invoice whose worker is SIGKILLed (as the OOM killer would) in the middle of its third and last
    delivery, so SQS moves its message to the DLQ and the document stays `in-progress`: the stuck case 000 leaves
    to the operator. Its purchase order is ingested first (the invoice's candidate: without one no LLM is asked);
    the LLM answers the invoice 503 through two deliveries (each waits out its visibility step, shrunk by the
    rehearsal's own drain run) and hangs on the third, which is when the run worker is killed. The threshold the
    operator's `redrive matching stuck` uses is printed (`MATCHING_STUCK_AFTER_SECONDS`): a minute, the queue's
    visibility timeout, instead of the deployed ten."""
    from assets.matching import ingestion
    from assets.matching.pipeline import matching_drain_job

    api, queue, job = _dagster(r, "the rehearsal's drain run"), _matching_queue(r), matching_drain_job.name
    r.wait("no matching drain run active (the rehearsal's own drain takes its documents)",
           lambda: not api.active_runs(job))
    run = api.launch(job, run_config={"ops": {"drain_matching_queue": {"config": STUCK_DRAIN}}},
                     tags={"redrive/rehearsal": r.tag})  # active: the queue sensor leaves the queue to it
    order = _matching_document(r, "po", "purchase_order", [f"PO-{r.tag}"], "40 steel beams")
    ingestion.ingest(r.engine, queue, [order])
    r.wait(f"purchase order {order['id']} matched", lambda: _matching_status(r, order["id"])[0] == "succeeded")
    marker = f"[rehearsal {r.tag} stuck]"  # in the invoice's text only, so in its prompts only
    r.sandbox.script("llm", *[{"status": 503}] * 6, {"kind": "delay", "seconds": 120}, match=marker)
    invoice = _matching_document(r, "inv", "invoice", [f"INV-{r.tag}", f"PO-{r.tag}"],
                                 f"invoice for 40 steel beams {marker}")
    ingestion.ingest(r.engine, queue, [invoice])
    r.wait(f"the third delivery of {invoice['id']} waiting on the LLM",
           lambda: _matching_status(r, invoice["id"]) == ("in-progress", 3)
           and marker not in r.sandbox.faults()["llm"]["matched"])
    _kill_run_worker(r, api, run)
    if _matching_status(r, invoice["id"]) != ("in-progress", 3):
        raise RehearsalError(f"{invoice['id']}'s third delivery ended before its worker was killed")
    r.wait("the matching queue settled (the killed run ended, its message moved to the DLQ)",
           lambda: _matching_settled(api, queue, job))
    r.wait(f"{invoice['id']} in-progress for {stuck_after} s", lambda: _stuck(r, invoice["id"], stuck_after))
    return {"DOCUMENT": invoice["id"], "MATCHING_STUCK_AFTER_SECONDS": str(stuck_after)}


def _kill_run_worker(r: Rehearsal, api: DagsterApi, run_id: str) -> None:
    """SIGKILL the process executing the run's steps, as the kernel's OOM killer would: no handler runs, the
    in-flight delivery records nothing. `make serve` runs its run workers on this machine."""
    import signal

    import psutil

    pid = r.wait(f"run {run_id} executing its steps", lambda: api.step_process(run_id))
    try:
        psutil.Process(pid).send_signal(signal.SIGKILL)
    except psutil.NoSuchProcess:
        raise RehearsalError(f"run {run_id}'s worker (pid {pid}) is not running on this machine: the rehearsal "
                             "kills it where `make serve` runs") from None


def _matching_settled(api: DagsterApi, queue: MatchingQueue, job: str) -> bool:
    """No drain run active and nothing in the queue: the killed delivery's message came back after its visibility
    timeout, and the receive that found it a third-time message moved it to the DLQ (the redrive policy)."""
    depth = queue.depth()
    return not api.active_runs(job) and depth.visible == 0 and depth.in_flight == 0


def _stuck(r: Rehearsal, document_id: str, seconds: float) -> bool:
    """What `redrive matching stuck` lists with that threshold."""
    from assets.matching import repository
    from redrive.clock import SystemClock

    cutoff = SystemClock().now() - timedelta(seconds=seconds)
    return any(d.id == document_id for d in r.read(repository.stuck_in_progress, cutoff))


def undeliverable_recipient(r: Rehearsal) -> dict[str, str]:
    """A review job one of whose two reviewers the mail provider refuses for good (an undeliverable domain)."""
    from assets.review_notifications import api, repository

    changelist = f"CL-R{r.tag}"
    api.submit(r.engine, {"idempotency_key": f"rehearse-{r.tag}", "changelist_id": changelist, "review_version": 3,
                          "recipients": ["ana@example.com", "gone@invalid.example"], "summary": "LGTM"})
    key = f"{changelist}:v3"

    def failed() -> int | None:
        with r.engine.connect() as conn:
            job = repository.job_by_key(conn, key)
            return next((d.id for d in repository.deliveries_of(conn, job.id) if d.status == "failed"), None)

    delivery = r.wait(f"a delivery of {key} failing for good", failed)
    return {"CHANGELIST": key, "DELIVERY": str(delivery)}


def evidence_zip(r: Rehearsal) -> dict[str, str]:
    """An evidence ZIP in the inbox (the bucket made if a fresh stack has none) with a row naming a file that is not
    in the ZIP (S3_NOT_FOUND) and a malformed row; the case API answers its attaches 503 for a while: the first
    pass sends N1 and the rows wait for their retry (004 §3), ready to force N2."""
    import csv
    import io
    import zipfile
    from uuid import UUID

    from assets.evidence import policy
    from assets.evidence import repository as repo
    from assets.evidence.settings import EvidenceSettings
    from redrive.settings import Settings
    from resources.aws import ensure_bucket

    cases = [str(uuid.uuid5(policy.NAMESPACE, f"rehearse-{r.tag}-case-{i}")) for i in range(2)]
    rows = [[cases[0], "case0/invoice.pdf;case0/not-in-the-zip.pdf"], [cases[1], "case1/receipt.pdf"],
            ["not-a-case-id", "x.pdf"]]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows([["case_id", "evidence_files"], *rows])
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("manifest.csv", text.getvalue())
        for name in ("case0/invoice.pdf", "case1/receipt.pdf"):
            zf.writestr(name, b"%PDF-1.4\n% rehearsal " + name.encode() + b"\n%%EOF\n")
    for case in cases:  # the case API is down for these cases: every attempt of the next while fails
        r.sandbox.script("case.attach", *[{"status": 503}] * 20, match=case)
    evidence = EvidenceSettings()
    bucket = evidence.bucket or Settings().redrive_bucket
    s3 = _aws(r, "s3")
    ensure_bucket(s3, bucket)
    key = f"{evidence.inbox_prefix}rehearse-{r.tag}.zip"
    s3.put_object(Bucket=bucket, Key=key, Body=buf.getvalue(), Metadata={"notify-to": f"merchant-{r.tag}@example.com"})
    etag = str(s3.head_object(Bucket=bucket, Key=key)["ETag"]).strip('"')
    job = policy.file_job_id(bucket, key, etag)

    def n1_sent() -> bool:
        found = r.read(repo.get_file_job, UUID(str(job)))
        return bool(found and found.n1_sent_at)

    r.wait(f"file job {job} ingested with N1 sent", n1_sent)
    return {"FILE_JOB": str(job)}


RECIPES: tuple[Recipe, ...] = (
    Recipe("bad-profile", ("1. Rerun a failed partition", "2. Backfill a range", "Matchmaking (001)"),
           "an impossible matchmaking profile in today's partition", bad_profile),
    Recipe("llm-401", ("3. Replay a dead letter from its failed stage", "4. Bulk redrive", "Criticizer (002 §8)"),
           "the LLM answers 401 (a revoked key) to three criticizer requests", llm_401),
    Recipe("gateway-reject", ("5. Press Retry", "Conversion (003)"),
           "the PDF gateway refuses one job (422)", gateway_reject),
    Recipe("gateway-outage", ("6. Read the breaker",), "the PDF gateway answers 503 until the breaker opens",
           gateway_outage),
    Recipe("stuck-document", ("7. Triage a stuck document", "Matching (seed 000)"),
           "a matching run worker SIGKILLed mid-delivery on a document's last delivery", stuck_document),
    Recipe("undeliverable-recipient", ("8. Waive a recipient", "Review notifications (002 §6)"),
           "the mail provider refuses one reviewer for good", undeliverable_recipient),
    Recipe("evidence-zip", ("9. Force N2", "Evidence attach (004)"),
           "an evidence ZIP with a missing file and a malformed row while the case API answers 503", evidence_zip),
)


def recipe(name: str) -> Recipe:
    for r in RECIPES:
        if r.name == name:
            return r
    raise RehearsalError(f"no recipe {name!r}; known: {', '.join(r.name for r in RECIPES)} (or `all`)")


def stack_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The running stack: the environment first, then the running serve's .data/serve.env."""
    from devstack import serve_env

    environ = os.environ if environ is None else environ
    return {**(serve_env.running() or {}), **{k: v for k, v in environ.items() if v}}


def exports(values: Mapping[str, str]) -> str:
    """Pure: `export NAME=value` lines a shell can `eval`."""
    import shlex

    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in values.items())


def arm(names: list[str], env: Mapping[str, str], timeout: float = 180.0) -> dict[str, str]:
    """Run the named recipes (all of them for `all`) on the stack; the shell variables they produce."""
    chosen = list(RECIPES) if names == ["all"] else [recipe(n) for n in names]
    rehearsal = Rehearsal(env=env, tag=uuid.uuid4().hex[:6], timeout=timeout)
    out: dict[str, str] = {}
    for r in chosen:
        out.update(r.arm(rehearsal))
    return out
