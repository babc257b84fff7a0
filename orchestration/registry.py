"""The one list of pipelines: what each adds to the code location, its tables, its demo and its commands.

A pipeline is a package under `assets/<name>/` plus its Dagster wiring in
`orchestration/pipelines/<name>.py`, which exports `pipeline_defs(settings) -> PipelineDefs`.
Adding a pipeline is one `Pipeline(...)` entry in `PIPELINES` below; the code location,
Alembic's metadata, `make demo` and the `redrive` command all read this list, so nothing
else keeps a copy of it (the core never imports a pipeline).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `redrive --help` reads this list: no SQLAlchemy or settings import just for annotations
    import sqlalchemy as sa

    from redrive.settings import Settings


@dataclass(frozen=True)
class PipelineDefs:
    name: str
    assets: Sequence[Any] = ()
    asset_checks: Sequence[Any] = ()
    jobs: Sequence[Any] = ()
    schedules: Sequence[Any] = ()
    sensors: Sequence[Any] = ()
    resources: Mapping[str, Any] = field(default_factory=dict)
    # pipeline name → sensors.core.ReplayTarget, for dead-letter replays of run-per-partition pipelines
    replay_targets: Mapping[str, Any] = field(default_factory=dict)
    # pipeline names whose replays and retries are rows of the core's work queue (drain runs)
    drained: Sequence[str] = ()
    # pipeline name → `(conn, limit) -> [FinalFailure]` from its repository (redrive.reconcile)
    failed_for_good: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Pipeline:
    """Where each piece of a pipeline lives; `tests/foundation/test_registry.py` checks every one exists."""

    name: str
    wiring: str  # module with pipeline_defs(settings) -> PipelineDefs
    schema: str  # module that adds the pipeline's tables to redrive.schema.metadata
    demo: str  # module with run_demo(ctx) -> DemoReport
    commands: Mapping[str, str] = field(default_factory=dict)  # `redrive <name>` → "module:typer_app"
    # module counting the pipeline's work in tables of its own: SOURCE (redrive.metrics.PipelineSource) and
    # collectors(engine, clock); None when the core's stage observations count all of it
    metrics: str | None = None
    # "module:function" with `(settings) -> [redrive.retention.Rule]`: what the core pruner removes of the
    # pipeline's rows and files, and when (docs/operating.md, Retention); None: it keeps nothing of its own
    retention: str | None = None


def _pipeline(name: str, metrics: str | None = None, **commands: str) -> Pipeline:
    return Pipeline(name=name, wiring=f"orchestration.pipelines.{name}", schema=f"assets.{name}.repository",
                    demo=f"orchestration.demos.{name}", commands=commands, metrics=metrics,
                    retention=f"assets.{name}.repository:retention_rules")


# In seed order; the rehearsal pipeline is the core's own two-stage example.
PIPELINES: tuple[Pipeline, ...] = (
    _pipeline("rehearsal"),
    _pipeline("conversion", metrics="assets.conversion.metrics",
              worker="assets.conversion.worker:worker_app"),  # `redrive worker conversion`
    _pipeline("criticizer", criticizer="assets.criticizer.cli:app"),
    _pipeline("matching", matching="assets.matching.cli:app"),
    _pipeline("matchmaking"),
    _pipeline("review_notifications", review="assets.review_notifications.cli:app"),
    _pipeline("evidence", evidence="assets.evidence.cli:app"),
)

# Core modules with tables of their own besides redrive.schema.
CORE_SCHEMAS: tuple[str, ...] = ("redrive.schema", "redrive.breaker", "redrive.observations", "redrive.counters",
                                 "redrive.upstreams", "redrive.operators")


def selected(names: Iterable[str] | None = None) -> tuple[Pipeline, ...]:
    if names is None:
        return PIPELINES
    wanted = set(names)
    return tuple(p for p in PIPELINES if p.name in wanted)


def retention_rules(settings: Settings) -> list[Any]:
    """Every pipeline's retention rules, then the core's (redrive.retention.all_rules), for the one pruner."""
    from redrive.retention import all_rules

    rules = []
    for pipeline in PIPELINES:
        if pipeline.retention is not None:
            module, _, attr = pipeline.retention.partition(":")
            rules += getattr(importlib.import_module(module), attr)(settings)
    return all_rules(rules)


def load_pipelines(settings: Settings, names: Iterable[str] | None = None) -> list[PipelineDefs]:
    out = []
    for pipeline in selected(names):
        factory: Callable[[Settings], PipelineDefs] = importlib.import_module(pipeline.wiring).pipeline_defs
        out.append(factory(settings))
    return out


def all_metadata() -> sa.MetaData:
    """One MetaData for every table of the core and of every pipeline (Alembic compares against it)."""
    from redrive.schema import metadata

    for module in (*CORE_SCHEMAS, *(p.schema for p in PIPELINES)):
        importlib.import_module(module)
    return metadata


def missing_pieces(pipeline: Pipeline, settings: Settings) -> list[str]:
    """What docs/adding-a-pipeline.md requires and this pipeline lacks; empty when it is complete.

    Its wiring builds `PipelineDefs` named like the entry; its schema module adds at least one
    table; its demo has `run_demo`; its commands import; and a dead letter of it can be replayed
    (`redrive dlq replay`): it is drained (a replay is its work row falling due) or has a replay target.
    """
    import sqlalchemy as sa

    missing: list[str] = []

    def load(module: str, what: str) -> Any:
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{what}: cannot import {module} ({exc})")
            return None

    from redrive.schema import metadata

    before = set(metadata.tables)
    schema = load(pipeline.schema, "schema")
    if schema is not None:
        own = [t for t in vars(schema).values() if isinstance(t, sa.Table) and t.metadata is metadata]
        if not own and not (set(metadata.tables) - before):
            missing.append(f"schema: {pipeline.schema} defines no table on redrive.schema.metadata")
    demo = load(pipeline.demo, "demo")
    if demo is not None and not callable(getattr(demo, "run_demo", None)):
        missing.append(f"demo: {pipeline.demo} has no run_demo(ctx)")
    for name, target in pipeline.commands.items():
        module, _, attr = target.partition(":")
        loaded = load(module, f"command {name}")
        if loaded is not None and not hasattr(loaded, attr):
            missing.append(f"command {name}: {target} does not exist")
    if pipeline.retention is not None:
        module, _, attr = pipeline.retention.partition(":")
        loaded = load(module, "retention")
        if loaded is not None and not callable(getattr(loaded, attr, None)):
            missing.append(f"retention: {pipeline.retention} does not exist")
    if pipeline.metrics is not None:
        source = load(pipeline.metrics, "metrics")
        if source is not None and not (hasattr(source, "SOURCE") and callable(getattr(source, "collectors", None))):
            missing.append(f"metrics: {pipeline.metrics} needs SOURCE and collectors(engine, clock)")
    wiring = load(pipeline.wiring, "wiring")
    if wiring is None:
        return missing
    defs = wiring.pipeline_defs(settings)
    if defs.name != pipeline.name:
        missing.append(f"wiring: pipeline_defs names the pipeline {defs.name!r}, the registry {pipeline.name!r}")
    if pipeline.name not in defs.drained and pipeline.name not in defs.replay_targets:
        missing.append("replay: neither drained nor given a replay target; `redrive dlq replay` could not run it")
    if not (defs.jobs or defs.assets):
        missing.append("wiring: no job and no asset")
    return missing
