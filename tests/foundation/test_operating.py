"""docs/operating.md holds: every command in its code blocks runs, as written, and prints what its `# expect:` says.

Each section of the page is one test. The stack is seeded through the real components (the pipelines' own
APIs and drains against the sandbox's faults, real worker and gateway calls), so that the section's action has
something to act on; then the section's `sh` blocks run line by line in bash, in order, with the page's shell
variables ($LETTER, $FILE_JOB, …) set to what the seeding made. A line's `# expect: a, b` lists fragments its
output must contain — the page's "before" and "after" — so a page that drifts from the commands fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from redrive.settings import PROJECT_ROOT

PAGE = PROJECT_ROOT / "docs" / "operating.md"
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Step:
    command: str  # the line as the page writes it (continuations joined), comment included
    expect: tuple[str, ...]


def sections(text: str) -> dict[str, list[Step]]:
    """`## title` → the steps of its ```sh blocks (```text blocks are synopses, not run)."""
    out: dict[str, list[Step]] = {}
    title = ""
    in_block = False
    pending = ""
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
        elif line.strip() == "```sh":
            in_block = True
        elif line.strip().startswith("```"):
            in_block = False
        elif in_block and line.strip():
            pending += line.rstrip().removesuffix("\\") + (" " if line.rstrip().endswith("\\") else "")
            if line.rstrip().endswith("\\"):
                continue
            command, _, comment = pending.partition("# expect:")
            expect = tuple(w.strip() for w in comment.split(",") if w.strip())
            out.setdefault(title, []).append(Step(pending.strip(), expect))
            pending = ""
    return out


STEPS = sections(PAGE.read_text())


def section(prefix: str) -> list[Step]:
    found = [steps for title, steps in STEPS.items() if title.startswith(prefix)]
    assert found, f"docs/operating.md has no section starting {prefix!r}"
    return found[0]


def run_steps(steps: list[Step], env: dict[str, str], cwd: Path = PROJECT_ROOT,
              inherit: bool = True) -> list[str]:
    """Run each line in bash as the page writes it (in `cwd`, with this process's environment under `env` unless
    `inherit` is false); check its expectations; return the outputs."""
    full = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", **env} if inherit else dict(env)
    outputs = []
    for step in steps:
        done = subprocess.run(["bash", "-c", step.command], env=full, capture_output=True, text=True, timeout=300,
                              cwd=cwd)
        printed = done.stdout + done.stderr
        assert done.returncode == 0, f"{step.command}\nexit {done.returncode}\n{printed[-2000:]}"
        assert "Traceback" not in done.stderr, (step.command, done.stderr[-2000:])  # (`dlq show` prints the stack)
        for fragment in step.expect:
            assert fragment in printed, f"{step.command}\nexpected {fragment!r} in:\n{printed[-2000:]}"
        outputs.append(printed)
    return outputs


def test_the_page_covers_every_action_the_seeds_name() -> None:
    """Each action of issue 16 §5 has its section, and each section something to run or a click to make."""
    for prefix in ("1. Rerun a failed partition", "2. Backfill a range", "3. Replay a dead letter",
                   "4. Bulk redrive", "5. Press Retry", "6. Read the breaker", "7. Triage a stuck document",
                   "8. Waive a recipient", "9. Force N2"):
        steps = section(prefix)
        assert steps and all(s.command.split()[0] in {"redrive", "dagster", "curl"} for s in steps), prefix


def test_every_redrive_command_of_the_page_exists() -> None:
    """Every `redrive …` line names a command `redrive --help` lists (checked without a database)."""
    from click.testing import CliRunner

    from orchestration.cli import app

    runner = CliRunner()
    for steps in STEPS.values():
        for step in steps:
            words = step.command.split()
            if words[0] != "redrive":
                continue
            path = [w for w in words[1:3] if re.fullmatch(r"[a-z][a-z0-9-]*", w)]
            result = runner.invoke(app, [*path, "--help"])
            assert result.exit_code == 0, (step.command, result.output)


# ------------------------------------------------------------------------------------------ seeding


@pytest.fixture
def page_env(db_url: str, project_tmp: Path) -> dict[str, str]:
    return {"DATABASE_URL": db_url, "DAGSTER_HOME": str(project_tmp)}


def test_before_you_start(page_env: dict[str, str]) -> None:
    run_steps(section("Before you start"), page_env)


def test_replay_a_dead_letter_from_its_failed_stage(defs, engine: sa.Engine, sandbox,
                                                    page_env: dict[str, str]) -> None:
    """A criticizer request whose `llm` stage met a revoked key (401) after `fetch` finished."""
    request, = criticizer_dead_letters(defs, engine, sandbox, 1)
    letter = letter_of(engine, "criticizer", request)
    run_steps(section("3. Replay a dead letter"), {**page_env, "LETTER": str(letter), "REQUEST": request})
    with engine.connect() as conn:
        stage, due = conn.execute(sa.text("SELECT status, due_at <= now() FROM work_items WHERE pipeline = "
                                          "'criticizer' AND entity_ref = :r"), {"r": request}).one()
    assert (stage, due) == ("due", True)  # the replay made the request's work row due: the next drain runs it


def test_bulk_redrive(defs, engine: sa.Engine, sandbox, page_env: dict[str, str]) -> None:
    requests = criticizer_dead_letters(defs, engine, sandbox, 3)
    outputs = run_steps(section("4. Bulk redrive"), page_env)
    assert "requested 3 replays, refused 0" in outputs[1]
    assert all(r in outputs[2] for r in requests)


def test_waive_a_recipient(engine: sa.Engine, settings, sandbox, page_env: dict[str, str]) -> None:
    """A review job one of whose two reviewers the provider refuses for good (INVALID_RECIPIENT)."""
    from assets.review_notifications import api, repository
    from resources.review_notifications import MailProvider
    from tests.review_notifications.conftest import drain_now

    api.submit(engine, {"idempotency_key": "req-ops-1", "changelist_id": "CL-4711", "review_version": 3,
                        "recipients": ["ana@example.com", "gone@invalid.example"], "summary": "LGTM"})
    with MailProvider(f"{os.environ['SANDBOX_URL']}/mail/v1", "sandbox-token") as mail:
        drain_now(runtime_of(engine, settings), mail)
    with engine.connect() as conn:
        job = repository.job_by_key(conn, "CL-4711:v3")
        failed = [d for d in repository.deliveries_of(conn, job.id) if d.status == "failed"]
    assert len(failed) == 1
    run_steps(section("8. Waive a recipient"),
              {**page_env, "CHANGELIST": "CL-4711:v3", "DELIVERY": str(failed[0].id)})


def test_force_n2(engine: sa.Engine, settings, sandbox, page_env: dict[str, str]) -> None:
    """A file job whose N1 went out while the case API kept failing: its artifacts wait for a retry."""
    file_job = evidence_job_waiting_for_retry(engine, settings, sandbox)
    run_steps(section("9. Force N2"), {**page_env, "FILE_JOB": file_job})
    with engine.connect() as conn:
        due = conn.execute(sa.text("SELECT count(*) FROM work_items WHERE pipeline = 'evidence' AND group_key = :j "
                                   "AND status = 'due' AND due_at <= now()"), {"j": file_job}).scalar_one()
    assert due >= 1  # the closed rows fall due: the next drain run dead-letters them and sends N2


def test_triage_a_stuck_document(engine: sa.Engine, stack, page_env: dict[str, str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A document whose worker died mid-delivery: `in-progress` since long before the stuck threshold."""
    import uuid
    from datetime import timedelta

    from assets.matching import ingestion, repository
    from assets.matching.pipeline import matching_resource
    from assets.matching.settings import MatchingSettings
    from redrive.clock import SystemClock
    from redrive.settings import Settings

    names = {"MATCHING_QUEUE_NAME": f"ops-{uuid.uuid4().hex[:8]}", "MATCHING_DLQ_NAME": f"ops-dlq-{uuid.uuid4().hex[:8]}"}
    for k, v in names.items():
        monkeypatch.setenv(k, v)
    queue = matching_resource(Settings(database_url=page_env["DATABASE_URL"]), MatchingSettings()).queue()
    ingestion.ingest(engine, queue, [{"id": "doc-ops-1", "tenant": "acme", "doc_type": "invoice",
                                      "counterparty": "ACME GmbH", "references": ["INV-1"], "amount": "10.00",
                                      "currency": "EUR", "document_date": "2026-11-01", "text": "services"}])
    with engine.begin() as conn:  # the crashed worker's last act: the delivery started, an hour ago
        assert repository.mark_in_progress(conn, "doc-ops-1", SystemClock().now() - timedelta(hours=1))
    run_steps(section("7. Triage a stuck document"), {**page_env, **names, "DOCUMENT": "doc-ops-1"})
    bodies = [m.body for m in queue.receive(10, 0)]
    assert [b for b in bodies if '"doc-ops-1"' in b] and len(bodies) == 2  # the ingest's message and the requeue's


def test_press_retry(engine: sa.Engine, settings, sandbox, page_env: dict[str, str],
                     conversion_api: Callable[..., tuple[str, str]]) -> None:
    """A conversion job the gateway refused (4xx): failed for good, its PDF still stored."""
    base, job_id = conversion_api(faults=[{"status": 422}])
    run_steps(section("5. Press Retry"), {**page_env, "TOKEN": token_for(page_env), "CONVERSION_API": base,
                                          "CONVERSION_JOB": job_id})


def test_read_the_breaker(engine: sa.Engine, settings, sandbox, page_env: dict[str, str],
                          conversion_api: Callable[..., tuple[str, str]]) -> None:
    """The gateway answers 503 until the breaker opens."""
    base, _ = conversion_api(faults=[{"status": 503}] * 40, jobs=12)
    run_steps(section("6. Read the breaker"), {**page_env, "TOKEN": token_for(page_env), "CONVERSION_API": base})


def token_for(page_env: dict[str, str]) -> str:
    """A token for alice, made as the page says (`python -m assets.conversion.api token OWNER`)."""
    return subprocess.run([sys.executable, "-m", "assets.conversion.api", "token", "alice"], capture_output=True,
                          text=True, env={**os.environ, **page_env}, check=True, cwd=PROJECT_ROOT).stdout.strip()


def test_rerun_a_failed_partition(engine: sa.Engine, page_env: dict[str, str], stack, monkeypatch) -> None:
    """A matchmaking partition failed for one user with an impossible profile; the profile is fixed, then rerun."""
    partition = "2026-03-08|America/New_York"
    env = matchmaking_partition_with_a_failed_user(engine, page_env, partition, monkeypatch)
    with engine.begin() as conn:  # the fix: the profile the dead letter named
        conn.execute(sa.text("UPDATE matchmaking_users SET age_min = 18, age_max = 99 WHERE age_min > age_max"))
    run_steps(section("1. Rerun a failed partition"), {**env, "PARTITION": partition})


def test_backfill_a_range(engine: sa.Engine, page_env: dict[str, str], stack, monkeypatch) -> None:
    """`dagster job backfill` of two partitions starts a run for each, and each run materializes its partition."""
    import dagster as dg

    env = {**page_env, **matchmaking_env(monkeypatch)}
    home = Path(env["DAGSTER_HOME"])
    (home / "dagster.yaml").write_text(  # runs launched at once, in process (in production the daemon dequeues them)
        "telemetry:\n  enabled: false\n"
        "run_coordinator:\n  module: dagster._core.run_coordinator.default_run_coordinator\n"
        "  class: DefaultRunCoordinator\n"
        "run_launcher:\n  module: dagster._core.launcher.sync_in_memory_run_launcher\n  class: SyncInMemoryRunLauncher\n"
        "compute_logs:\n  module: dagster._core.storage.noop_compute_log_manager\n  class: NoOpComputeLogManager\n")
    run_steps(section("2. Backfill a range"), env)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = [r for r in instance.get_runs() if r.tags.get("dagster/backfill")]
        assert sorted(r.tags["dagster/partition"] for r in runs) == ["2026-03-08|Asia/Tokyo", "2026-03-09|Asia/Tokyo"]
        failed = {r.tags["dagster/partition"] + " " + str(r.status): [e.message for e in instance.all_logs(r.run_id)
                                                if e.is_dagster_event and e.dagster_event.is_failure][:3]
                  for r in runs if not r.is_success}
        assert failed == {}


# ------------------------------------------------------------------------------------------ helpers


def runtime_of(engine: sa.Engine, settings: Any, time_scale: float = 0.001) -> Any:
    from redrive.reliability import Reliability
    from resources.factory import notifier_from

    return Reliability(engine=engine, channels=notifier_from(settings).channels(), time_scale=time_scale,
                       burst_window=0.0)


def letter_of(engine: sa.Engine, pipeline: str, entity: str) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT id FROM dead_letters WHERE pipeline = :p AND entity_ref = :e"),
                            {"p": pipeline, "e": entity}).scalar_one()


def criticizer_dead_letters(defs: Any, engine: sa.Engine, sandbox: Any, n: int) -> list[str]:
    """n requests submitted and drained against an LLM answering 401: each dead-lettered at `llm`, fetch done."""
    from assets.criticizer import api, pipeline
    from redrive.drain import Drain

    sandbox.put_store("reviews/ops.py", b"def retry():\n    try: x()\n    except: pass\n", "text/x-python")
    requests = []
    for i in range(n):
        requests.append(api.submit(engine, {
            "request_id": f"pr-42-rev-{i}", "artifact_url": f"{sandbox.base_url}/store/reviews/ops.py",
            "rubric": "Is the error handling sound?",
            "webhook_url": f"{sandbox.base_url}/slack/webhook/requester/ops-{i}"},
            allowed_artifact_prefixes=()).request_id)
    sandbox.script("llm", *[{"status": 401}] * n)
    runtime = defs.resources["reliability"].runtime()
    handle = pipeline.handler(runtime, defs.resources["criticizer_http"], defs.resources["llm"])
    Drain(reliability=runtime, pipeline="criticizer", policies=dict(pipeline.POLICIES), owner="ops-test",
          concurrency=4, batch_size=50, linger_seconds=0.0, max_seconds=120).run(handle)
    for request in requests:
        letter_of(engine, "criticizer", request)  # each has its letter
    return requests


def evidence_job_waiting_for_retry(engine: sa.Engine, settings: Any, sandbox: Any) -> str:
    """One file job of two rows ingested and drained once against a case API answering 503: every artifact had
    its first attempt, so N1 goes out, and each waits for its retry (004 §3)."""
    from assets.evidence import policy
    from assets.evidence import repository as repo
    from assets.evidence.pipeline import PIPELINE, ROW_POLICIES
    from assets.evidence.worker import NotificationSender, row_handler
    from redrive.clock import SystemClock
    from redrive.drain import Drain
    from resources.evidence import CaseApiResource, MerchantMailResource
    from tests.evidence.helpers import standard_job

    runtime = runtime_of(engine, settings, time_scale=1.0)  # retries 5 min away: none falls due within the drain
    data, _ = standard_job("ops", 2, 2)
    parsed = policy.parse_archive(data, file_types=frozenset({"pdf", "png", "txt"}),
                                  limits=policy.ArchiveLimits(max_file_bytes=10**7, max_archive_bytes=10**9))
    job_id = policy.file_job_id("bucket", "inbox/ops.zip", "etag")
    now = SystemClock().now()
    with engine.begin() as conn:
        job = repo.upsert_file_job(conn, job_id, bucket="bucket", key="inbox/ops.zip", etag="etag",
                                   notify_to="merchant@example.com", now=now)
        repo.record_ingest(conn, job, parsed, s3_uri=lambda aid, n: f"s3://bucket/files/{aid}/{n}", now=now)
    sandbox.script("case.attach", *[{"status": 503}] * 4)
    with CaseApiResource(base_url=settings.case_url, token="sandbox-token", timeout_seconds=5).session() as api:
        Drain(reliability=runtime, pipeline=PIPELINE, policies=ROW_POLICIES, owner="ops-test",
              linger_seconds=0).run(row_handler(runtime, api, max_attempts=3), group_key=str(job_id))
    with MerchantMailResource(base_url=settings.mail_url, timeout_seconds=5).session() as mail:
        assert [n.kind for n in NotificationSender(runtime, mail).send_pending(job_id)] == ["N1"]
    return str(job_id)


def matchmaking_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Two timezones from March 2026, the env a `dagster` command of the page reads."""
    env = {"MATCHMAKING_TIMEZONES": "America/New_York,Asia/Tokyo", "MATCHMAKING_START_DATE": "2026-03-01",
           "REDRIVE_TIME_SCALE": "0.001"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def matchmaking_partition_with_a_failed_user(engine: sa.Engine, page_env: dict[str, str], partition: str,
                                             monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """40 users of the partition's timezone, one with an impossible age range, and one run of the partition:
    39 get offers, one is dead-lettered (DATA_INCONSISTENCY at `validate`) and the run ends failed."""
    import dagster as dg

    from assets.matchmaking import synthetic
    from orchestration.definitions import build_definitions
    from redrive.settings import Settings

    env = {**page_env, **matchmaking_env(monkeypatch)}
    rows = synthetic.users(40, timezone=partition.split("|")[1], tag="ops", regions=2)
    with engine.begin() as conn:
        synthetic.insert(conn, rows)
        conn.execute(sa.text("UPDATE matchmaking_users SET age_min = 40, age_max = 30 WHERE id = :u"),
                     {"u": rows[0]["id"]})
    defs = build_definitions(Settings(database_url=page_env["DATABASE_URL"], redrive_time_scale=0.001))
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def("matchmaking_job").execute_in_process(
            partition_key=partition, instance=instance, raise_on_error=False)
    assert not result.success
    return env


@pytest.fixture
def conversion_api(engine: sa.Engine, settings: Any, sandbox: Any,
                   project_tmp: Path) -> Iterator[Callable[..., tuple[str, str]]]:
    """Jobs queued as the API queues them, worked by a real worker against the sandbox's scripted gateway, and
    the API served on a real port (as `python -m assets.conversion.api serve` does)."""
    import hashlib
    import socket
    import threading
    import time
    import uuid

    import uvicorn

    from assets.conversion import repository as repo
    from assets.conversion.api import create_app
    from assets.conversion.files import FileStore
    from assets.conversion.settings import ConversionSettings
    from assets.conversion.worker import JsonLog, Shutdown, Worker
    from resources.conversion import HttpGateway
    from tests.conversion.conftest import make_pdf

    knobs = ConversionSettings(uploads_dir=project_tmp / "uploads", results_dir=project_tmp / "results",
                               gateway_url=f"{os.environ['SANDBOX_URL']}/pdf/v1", gateway_timeout_ms=3000,
                               circuit_cooldown_ms=600_000)
    files = FileStore(knobs.uploads_dir, knobs.results_dir)
    runtime = runtime_of(engine, settings, time_scale=1.0)  # a retry waits its 5-10 s; the breaker its cooldown
    servers: list[uvicorn.Server] = []

    def serve(*, faults: list[dict[str, Any]], jobs: int = 1) -> tuple[str, str]:
        ids = []
        for _ in range(jobs):
            body, job_id = make_pdf(f"job {uuid.uuid4().hex[:8]}"), str(uuid.uuid4())
            with engine.begin() as conn:
                repo.create(conn, repo.NewJob(job_id, "alice", "doc.pdf", files.save_source(job_id, body), len(body),
                                              hashlib.sha256(body).hexdigest()), runtime.now())
            ids.append(job_id)
        sandbox.script("pdf.convert", *faults)
        worker = Worker(runtime, HttpGateway(knobs.gateway_base_url(settings), 3.0), files, knobs,
                        worker_id="ops-test", shutdown=Shutdown(5), log=JsonLog("ops-test"))
        try:
            for _ in range(jobs):
                worker.step()
        finally:
            worker.gateway.close()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(create_app(engine, knobs), log_level="warning", log_config=None))
        threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        servers.append(server)
        deadline = time.monotonic() + 15
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return f"http://127.0.0.1:{sock.getsockname()[1]}", ids[0]

    yield serve
    for server in servers:
        server.should_exit = True
