"""docs/deploying.md, the Dockerfile and dagster.yaml.example say what `make serve` runs, and agree with each other.

The service commands live once, in devstack/topology.py; these tests fail when the page, the image or
the Helm values drift from them. (No container engine here: the Dockerfile is checked by reading it.)
"""

from __future__ import annotations

import json
import re
import tomllib

import yaml

from devstack.topology import DEPLOYED, SERVICES, deployed_commands
from redrive.settings import PROJECT_ROOT

DOC = (PROJECT_ROOT / "docs" / "deploying.md").read_text()
DOCKERFILE = (PROJECT_ROOT / "Dockerfile").read_text()
INSTANCE = yaml.safe_load((PROJECT_ROOT / "dagster.yaml.example").read_text())


def doc_yaml_blocks() -> list[dict]:
    return [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", DOC, re.S)]


def helm_values() -> dict:
    [values] = [b for b in doc_yaml_blocks() if "dagster-user-deployments" in b]
    return values


def dockerfile_instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    lines = [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_every_service_command_is_in_the_guide() -> None:
    """Each command `make serve` runs (and the migration) appears verbatim in docs/deploying.md."""
    commands = deployed_commands()
    assert set(commands) == {s.name for s in SERVICES} | {"migrate"}
    missing = {name: cmd for name, cmd in commands.items() if f"`{cmd}`" not in DOC}
    assert missing == {}


def test_helm_values_run_the_code_server_command_and_the_instance_settings() -> None:
    """The user-code deployment's gRPC args, port, tag limits and run retries are those of serve's instance."""
    values = helm_values()
    [deployment] = values["dagster-user-deployments"]["deployments"]
    code_server = next(s for s in SERVICES if s.name == "code-server").argv(DEPLOYED)
    args = deployment["dagsterApiGrpcArgs"]
    assert " ".join(args) in " ".join(code_server)  # the chart adds host and port itself
    assert str(deployment["port"]) == DEPLOYED["grpc_port"]
    assert deployment["envSecrets"]  # secrets through the environment
    queued = values["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]
    coordinator = INSTANCE["run_coordinator"]["config"]
    assert queued["tagConcurrencyLimits"] == coordinator["tag_concurrency_limits"]
    assert queued["maxConcurrentRuns"] == coordinator["max_concurrent_runs"]
    assert (queued["dequeueUseThreads"], queued["dequeueNumWorkers"]) == (
        coordinator["dequeue_use_threads"], coordinator["dequeue_num_workers"])
    retries = values["dagsterDaemon"]["runRetries"]
    assert (retries["enabled"], retries["maxRetries"], retries["retryOnAssetOrOpFailure"]) == (
        INSTANCE["run_retries"]["enabled"], INSTANCE["run_retries"]["max_retries"],
        INSTANCE["run_retries"]["retry_on_asset_or_op_failure"])
    monitoring = values["dagsterDaemon"]["runMonitoring"]
    assert (monitoring["enabled"], monitoring["startTimeoutSeconds"]) == (
        INSTANCE["run_monitoring"]["enabled"], INSTANCE["run_monitoring"]["start_timeout_seconds"])


def test_instance_is_production_shaped_and_never_reruns_op_failures() -> None:
    """PostgreSQL storage, queued runs limited per pipeline tag, run retries only for infrastructure failures."""
    import importlib

    from dagster._core.run_coordinator import QueuedRunCoordinator
    from dagster_postgres import DagsterPostgresStorage

    storage = INSTANCE["storage"]["custom"]
    assert issubclass(getattr(importlib.import_module(storage["module"]), storage["class"]), DagsterPostgresStorage)
    assert storage["config"]["postgres_url"] == {"env": "DAGSTER_PG_URL"}
    coordinator = INSTANCE["run_coordinator"]

    cls = getattr(importlib.import_module(coordinator["module"]), coordinator["class"])
    assert issubclass(cls, QueuedRunCoordinator)  # Dagster's queue (ours adds the pipeline tag to asset runs)
    assert {limit["key"] for limit in INSTANCE["run_coordinator"]["config"]["tag_concurrency_limits"]} == {
        "redrive/pipeline"}
    assert INSTANCE["run_retries"]["enabled"] is True
    assert INSTANCE["run_retries"]["retry_on_asset_or_op_failure"] is False
    [ecs] = [b for b in doc_yaml_blocks() if b.get("run_launcher", {}).get("class") == "EcsRunLauncher"]
    assert ecs["run_launcher"]["module"] == "dagster_aws.ecs"


def test_dockerfile_copies_what_exists_pins_dependencies_and_runs_as_non_root() -> None:
    """Every COPY source exists; pip installs under constraints.txt; the user is not root; CMD is the code server."""
    instructions = dockerfile_instructions()
    assert instructions[0] == ("FROM", "python:3.11-slim")
    copied = []
    for op, rest in instructions:
        if op == "COPY":
            *sources, _destination = rest.split()
            copied += [s for s in sources if not s.startswith("--")]
    assert copied and [s for s in copied if not (PROJECT_ROOT / s).exists()] == []
    runs = " ".join(rest for op, rest in instructions if op == "RUN")
    assert "pip install --constraint constraints.txt" in runs
    users = [rest for op, rest in instructions if op == "USER"]
    assert users and users[-1] not in {"root", "0"}
    assert [op for op, _ in instructions].index("USER") > max(i for i, (op, _) in enumerate(instructions) if op == "RUN")
    [cmd] = [rest for op, rest in instructions if op == "CMD"]
    assert json.loads(cmd) == next(s for s in SERVICES if s.name == "code-server").argv(DEPLOYED)
    # the image's packages are the project's packages
    packages = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert {p.rstrip("*") for p in packages["include"]} <= {s.rstrip("/") for s in copied}


def test_constraints_pin_every_runtime_dependency() -> None:
    """constraints.txt has an exact pin for each dependency pyproject.toml declares."""
    pins = {}
    for line in (PROJECT_ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    declared = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.sub(r"[-_.]+", "-", re.split(r"[\[<>=!~ ]", d, maxsplit=1)[0]).lower() for d in declared}
    assert sorted(names - set(pins)) == []
