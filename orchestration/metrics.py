"""The one metrics endpoint of a deployment: every pipeline's series, its breakers, conversion's own.

`redrive metrics serve` (a service in devstack/topology.py and docs/deploying.md) reads PostgreSQL
at each scrape (redrive.metrics); it holds no state, so any number of replicas agree and a restart
loses nothing.
"""

from __future__ import annotations

import importlib
import signal
import threading

import sqlalchemy as sa
from prometheus_client import start_http_server
from prometheus_client.registry import CollectorRegistry

from orchestration.registry import PIPELINES
from redrive import metrics
from redrive.clock import Clock


def pipeline_sources() -> dict[str, metrics.PipelineSource]:
    """The pipelines that count their work in tables of their own (registry `metrics=`), by name."""
    return {p.name: importlib.import_module(p.metrics).SOURCE for p in PIPELINES if p.metrics is not None}


def build_registry(engine: sa.Engine, clock: Clock) -> CollectorRegistry:
    extra, breakers = [], []
    for pipeline in PIPELINES:
        if pipeline.metrics is None:
            continue
        module = importlib.import_module(pipeline.metrics)
        extra += module.collectors(engine, clock)
        breakers += list(getattr(module, "BREAKERS", ()))
    return metrics.registry(engine, clock, [p.name for p in PIPELINES], pipeline_sources(), extra, breakers)


def serve(engine: sa.Engine, clock: Clock, host: str, port: int) -> None:
    """Serve /metrics until SIGTERM or SIGINT."""
    server, thread = start_http_server(port, addr=host, registry=build_registry(engine, clock))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        server.shutdown()
        thread.join(timeout=5)
