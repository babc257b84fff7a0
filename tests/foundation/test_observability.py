"""Issue 16 §3: a run of every pipeline logs JSON with its work's fields, and one endpoint serves every pipeline's series.

Every pipeline's demo drives its own work through the real components (PostgreSQL, moto, the sandbox's
injected faults, Dagster runs) with REDRIVE_LOG_FORMAT=json, as a deployed process has it; the log lines
are parsed, then `redrive metrics serve` — the command the deployment runs — is scraped over HTTP.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from devstack.process import free_port
from orchestration.demo import DAEMON_ENV, DemoContext, deployment_env
from orchestration.registry import PIPELINES
from redrive import logs, metrics
from redrive.db import engine_for
from redrive.settings import PROJECT_ROOT

NAMES = [p.name for p in PIPELINES]
DASHBOARD = PROJECT_ROOT / "docs" / "grafana" / "redrive.json"


@pytest.fixture
def json_logs(monkeypatch) -> Iterator[None]:
    """REDRIVE_LOG_FORMAT=json for the code location built in the test; the root logger restored afterwards."""
    monkeypatch.setenv(logs.FORMAT_ENV, "json")
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def scrape_endpoint(db_url: str, log: Path) -> str:
    """Start `redrive metrics serve` on the test's database, read /metrics once, stop it."""
    port = free_port()
    command = [str(Path(sys.executable).parent / "redrive"), "metrics", "serve", "--host", "127.0.0.1",
               "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=PROJECT_ROOT, env={**os.environ, "DATABASE_URL": db_url},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
                if reply.status_code == 200:
                    return reply.text
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)  # waiting for a process we started to listen; not a timing assertion
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.fixture
def deployed_instance() -> Iterator[dg.DagsterInstance]:
    """A throwaway instance with dagster.yaml.example's log handlers (the run lines a deployment ships)."""
    python_logs = yaml.safe_load((PROJECT_ROOT / "dagster.yaml.example").read_text())["python_logs"]
    overrides = {"python_logs": python_logs,
                 "compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager",
                                  "class": "NoOpComputeLogManager"}}
    with dg.instance_for_test(overrides=overrides) as inst:
        yield inst


@pytest.mark.timeout(1800)
@pytest.mark.first_pass  # the log format and the series do not depend on the server: not in `make test-ci`
def test_every_pipeline_logs_json_with_its_fields_and_the_endpoint_serves_its_series(
        json_logs, deployed_instance, scaled_settings, sandbox, db_url, capsys, tmp_path, monkeypatch) -> None:
    """Each pipeline's lines parse as JSON and name pipeline, entity, stage, attempt, error class and run id;
    the one endpoint has each pipeline's done, failed and retried counts, latency histogram, dead letters and
    due work, and every series a Grafana panel queries."""
    from orchestration.definitions import build_definitions

    demos = [importlib.import_module(pipeline.demo) for pipeline in PIPELINES]
    for key, value in deployment_env(demos).items():  # what `make demo` configures the code location with
        if key not in DAEMON_ENV:
            monkeypatch.setenv(key, value)
    defs = build_definitions(scaled_settings)
    engine = engine_for(db_url)
    for pipeline in PIPELINES:
        importlib.import_module(pipeline.demo).run_demo(DemoContext(defs, deployed_instance, scaled_settings,
                                                                    sandbox, engine, "obs"))
    defs.resources["reliability"].runtime().try_dispatch()
    err = capsys.readouterr().err

    records = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    problems = []  # every pipeline's shortfalls at once: this test takes minutes to run
    for name in NAMES:
        lines = [r for r in records if r.get("pipeline") == name]
        if not lines:
            problems.append(f"{name}: no JSON log line names the pipeline")
        if not any({"entity", "stage", "run_id"} <= set(r) for r in lines):
            problems.append(f"{name}: no line with entity, stage and run_id")
        if not any({"entity", "stage", "attempt", "error_class"} <= set(r) for r in lines):
            problems.append(f"{name}: no line with entity, stage, attempt and error_class")
        if not all({"ts", "level", "logger", "message"} <= set(r) for r in lines):
            problems.append(f"{name}: a line without ts, level, logger or message")

    page = scrape_endpoint(db_url, tmp_path / "metrics.log")
    families = list(text_string_to_metric_families(page))
    samples = [s for f in families for s in f.samples]

    def total(name: str, pipeline: str, **labels: str) -> float:
        return sum(s.value for s in samples if s.name == name and s.labels.get("pipeline") == pipeline
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    for name in NAMES:
        checks = {
            "items done": total("redrive_items_done_total", name) > 0,
            "failed or retried": total("redrive_items_failed_total", name)
            + total("redrive_retries_scheduled_total", name) > 0,
            "latency observed": total("redrive_stage_latency_seconds_count", name) > 0,
            "+Inf bucket is the count": total("redrive_stage_latency_seconds_bucket", name, le="+Inf")
            == total("redrive_stage_latency_seconds_count", name),
            "due work series": any(s.name == "redrive_due_work" and s.labels["pipeline"] == name for s in samples),
            "dead letter age series": any(s.name == "redrive_dead_letter_oldest_open_seconds"
                                          and s.labels["pipeline"] == name for s in samples),
        }
        problems += [f"{name}: {what}" for what, ok in checks.items() if not ok]
    assert problems == []
    assert sum(s.value for s in samples if s.name == "redrive_alerts_sent_total") > 0
    assert any(s.name == "redrive_circuit_breaker_open" and s.labels["breaker"] == "pdf-gateway" for s in samples)
    assert any(s.name == "redrive_conversion_jobs_completed_total" for s in samples)  # conversion's own series stay

    served = {s.name for s in samples} | set(metrics.SERIES) & {  # series with no sample yet still have HELP/TYPE
        f"{f.name}{suffix}" for f in families for suffix in ("", "_total", "_bucket", "_sum", "_count")}
    assert set(metrics.SERIES) <= served
    assert dashboard_series() <= served


def dashboard_series() -> set[str]:
    """Every metric name a panel of docs/grafana/redrive.json queries (PromQL functions and labels aside)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    names = {m for e in exprs for m in re.findall(r"\b(redrive_[a-z0-9_]+)\b", e)}
    assert names and all(e for e in exprs)
    return names


def test_the_dashboard_queries_only_series_the_endpoint_serves() -> None:
    """A panel naming a series the endpoint does not serve (a typo, a renamed metric) fails here."""
    conversion_own = {"redrive_conversion_queue_depth"}
    assert dashboard_series() - conversion_own <= set(metrics.SERIES)
    dashboard = json.loads(DASHBOARD.read_text())
    assert all(p["targets"] and p["datasource"]["type"] == "prometheus" for p in dashboard["panels"])


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_a_run_writes_each_record_once_in_the_format_asked_for(fmt, deployed_instance, capsys, monkeypatch) -> None:
    """A run with no `loggers` in its run config (a sensor's, a backfill's, the launchpad's) under dagster.yaml's
    handler: JSON asked for, each record is one JSON line and no coloured text line beside it; text asked for,
    Dagster's console logger writes it and our handler stays silent."""
    monkeypatch.setenv(logs.FORMAT_ENV, fmt)
    logs.one_line_per_run_record()
    marker = f"one-line-{fmt}-marker"

    @dg.op
    def speaks(context) -> None:  # noqa: ANN001 (Dagster reads the annotation; this module has string annotations)
        context.log.info(marker)

    @dg.job
    def one_line() -> None:
        speaks()

    assert one_line.execute_in_process(instance=deployed_instance).success
    said = [line for line in capsys.readouterr().err.splitlines() if marker in line]
    assert len(said) == 1, said
    if fmt == "json":
        assert json.loads(said[0])["message"].endswith(marker)
    else:
        assert not said[0].startswith("{")


def test_a_sensors_lines_are_json_when_json_is_asked_for(capsys, monkeypatch) -> None:
    """`context.log` of a sensor (printed by the code server at each tick): one JSON line in JSON mode."""
    monkeypatch.setenv(logs.FORMAT_ENV, "json")
    logs.one_line_per_run_record()

    @dg.sensor(job_name="nothing")
    def speaks(context):  # noqa: ANN001 - Dagster reads the annotation; this module has string annotations
        context.log.info("sensor-json-marker")
        return dg.SkipReason("quiet")

    with dg.build_sensor_context() as context:
        speaks(context)
    said = [line for line in capsys.readouterr().err.splitlines() if "sensor-json-marker" in line]
    assert len(said) == 1 and json.loads(said[0])["message"].endswith("sensor-json-marker"), said
