"""`redrive rehearse`: something to act on for each runbook of docs/operating.md, on a running `make serve`.

A recipe seeds what its runbook section needs through the pipelines' own front doors (their submit APIs, the
conversion HTTP API, the matchmaking tables a producer fills) and arms its fault in the sandbox's scripting
(`/_admin/faults`), matched to the recipe's own entities so the rest of the stack keeps working. The deployed
topology then does the work — the daemon's sensors, drain runs, the conversion worker — and meets the fault as
it would in production. The command waits until the failure has happened and prints the shell variables the
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
from datetime import UTC, datetime
from typing import Any


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
    from devstack.dagster_api import DagsterApi
    from devstack.topology import LOCATION

    tz = MatchmakingSettings().timezones[0]
    partition = Partition.parse(datetime.now(UTC).date().isoformat(), tz)
    rows = synthetic.users(users, timezone=tz, tag=f"rehearse-{r.tag}", regions=2)
    with r.engine.begin() as conn:
        synthetic.insert(conn, rows)
        conn.execute(sa.text("UPDATE matchmaking_users SET age_min = 40, age_max = 30 WHERE id = :u"),
                     {"u": rows[0]["id"]})
    key = key_of(partition)
    if not r.env.get("DAGSTER_UI_URL"):
        raise RehearsalError("no DAGSTER_UI_URL: the partition's run is launched through the webserver")
    DagsterApi(r.env["DAGSTER_UI_URL"], LOCATION).launch(JOB, partition_key=str(key),
                                                         tags={"redrive/rehearsal": r.tag})
    ref = f"{partition.entity_ref}:{rows[0]['id']}"
    letter = r.wait(f"matchmaking user {ref} dead-lettered", lambda: r.letter("matchmaking", ref))
    return {"PARTITION": str(key), "LETTER": str(letter)}


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

    import boto3

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
    s3 = boto3.client("s3", endpoint_url=r.env.get("AWS_ENDPOINT_URL") or None,
                      region_name=r.env.get("AWS_REGION") or r.env.get("AWS_DEFAULT_REGION") or None,
                      aws_access_key_id=r.env.get("AWS_ACCESS_KEY_ID") or None,
                      aws_secret_access_key=r.env.get("AWS_SECRET_ACCESS_KEY") or None)
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
