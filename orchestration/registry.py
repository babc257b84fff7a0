"""Each pipeline hands the code location one `PipelineDefs`; `definitions.py` joins them.

A pipeline package (`assets/<name>/`) exports `pipeline_defs(settings) -> PipelineDefs`
from its `definitions.py`; adding a pipeline is one line in `PIPELINES` below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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
    # pipeline name → sensors.core.ReplayTarget, for dead-letter replays and durable retries
    replay_targets: Mapping[str, Any] = field(default_factory=dict)
    # pipeline name → `(conn, limit) -> [FinalFailure]` from its repository (redrive.reconcile)
    failed_for_good: Mapping[str, Any] = field(default_factory=dict)


# Modules with a `pipeline_defs(settings)` function, in seed order.
PIPELINES: tuple[str, ...] = (
    "assets.rehearsal.definitions",
    "assets.matching.definitions",
    "assets.matchmaking.definitions",
    "assets.criticizer.definitions",
    "assets.review_notifications.definitions",
    "assets.conversion.definitions",
    "assets.evidence.definitions",
)


def load_pipelines(settings: Settings) -> list[PipelineDefs]:
    out = []
    for module in PIPELINES:
        factory: Callable[[Settings], PipelineDefs] = importlib.import_module(module).pipeline_defs
        out.append(factory(settings))
    return out
