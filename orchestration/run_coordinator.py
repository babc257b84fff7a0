"""The instance's run coordinator: Dagster's queue, with the pipeline's tag on asset runs that lack it.

A launch from an asset's page and every run of an asset backfill run the implicit `__ASSET_JOB`,
which carries none of our jobs' tags: the queue's `redrive/pipeline` tag concurrency limits would
not hold for them, and their alerts would name `__ASSET_JOB` (issue 13 §7). Every launch path
(UI, backfill daemon, sensors, GraphQL) submits through here, so the tag is added from the assets'
own definitions (`tags={"redrive/pipeline": ...}`) before the run is queued. Configured in
`dagster.yaml.example` and in devstack's instance.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dagster import DagsterRun, QueuedRunCoordinator
from dagster._core.run_coordinator import SubmitRunContext

from sensors.core import PIPELINE_TAG


def pipeline_of_assets(asset_tags: Iterable[Mapping[str, str]]) -> str | None:
    """Pure: the one pipeline the run's assets name; None when none does, or several do."""
    names = {tags[PIPELINE_TAG] for tags in asset_tags if PIPELINE_TAG in tags}
    return names.pop() if len(names) == 1 else None


class PipelineTaggingRunCoordinator(QueuedRunCoordinator):
    """`QueuedRunCoordinator` (same config) that tags an untagged asset run with its assets' pipeline."""

    def submit_run(self, context: SubmitRunContext) -> DagsterRun:
        run = context.dagster_run
        if PIPELINE_TAG not in run.tags and run.asset_selection:
            graph = context.workspace.asset_graph
            pipeline = pipeline_of_assets(graph.get(key).tags for key in run.asset_selection if graph.has(key))
            if pipeline is not None:
                self._instance.add_run_tags(run.run_id, {PIPELINE_TAG: pipeline})
                run = self._instance.get_run_by_id(run.run_id) or run
                context = context._replace(dagster_run=run)
        return super().submit_run(context)
