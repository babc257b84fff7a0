"""Each pipeline's backlog as an asset the UI shows, with three checks that need nothing but PostgreSQL.

`<pipeline>_backlog` is the pipeline's open work — due queue rows and retry timers (and its own queue,
for conversion) and its unresolved dead letters. It is never materialized: the checks are the point.
- `no_open_dead_letters`: no unresolved dead letter at all (issue 27: a drain run that dead-letters an entity
  is a green run, so this red check is where the UI shows it; ERROR). Clears when the last letter is resolved
  or replayed successfully;
- `no_stale_dead_letters`: no unresolved dead letter older than DEAD_LETTER_MAX_AGE_HOURS (someone must
  replay or resolve it; WARN);
- `due_work_flowing`: nothing due has waited longer than DUE_WORK_MAX_WAIT_SECONDS (the sensor, the
  daemon or the workers are not picking work up; ERROR);
- `pipeline_progressing`: the stall watch does not hold the pipeline stalled (due work and no progress
  for PIPELINE_STALL_SECONDS, `redrive.stalls`; ERROR).
Each check runs on demand from the asset page, and the `redrive_pipeline_backlog` sensor reports them
within one tick (30 s) of a change, and again every few minutes, without starting a run (sensors/core.py);
the stall watch reports `pipeline_progressing` when it changes.
"""

# No `from __future__ import annotations`: Dagster reads resource types from live annotations.

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import dagster as dg

from assets import OWNERS
from redrive import stalls
from redrive.metrics import PipelineSource, due_work, open_dead_letters
from redrive.reliability import Reliability
from redrive.stages import OP_RETRY_POLICY, sanitized_body
from redrive.stalls import StallState
from resources.reliability import ReliabilityResource

OPEN_LETTERS, STALE_LETTERS, DUE_FLOWING = "no_open_dead_letters", "no_stale_dead_letters", "due_work_flowing"
PROGRESSING = "pipeline_progressing"
DEFAULT_STALL_SECONDS = 180.0


@dataclass(frozen=True)
class Verdict:
    check: str
    passed: bool
    severity: dg.AssetCheckSeverity
    description: str
    metadata: Mapping[str, float | int]
    count: int = 0  # what the verdict counts (letters, due items): a change of it is news for the UI

    @property
    def signature(self) -> list:
        """What must change for the sensor to report this verdict again before its refresh (ages do not count)."""
        return [self.passed, self.count]


def open_letters_verdict(pipeline: str, by_class: Mapping[str, int]) -> Verdict:
    """Pure: fails while any dead letter of the pipeline is unresolved; says how many of each class."""
    total = sum(by_class.values())
    classes = ", ".join(f"{n} {c}" for c, n in sorted(by_class.items(), key=lambda kv: (-kv[1], kv[0])))
    text = (f"{total} unresolved dead letter(s): {classes}; `redrive dlq list --pipeline {pipeline}` lists them, "
            "replay or resolve each (docs/operating.md)" if total else "no unresolved dead letter")
    return Verdict(OPEN_LETTERS, total == 0, dg.AssetCheckSeverity.ERROR, text,
                   {"open_dead_letters": total, "error_classes": len(by_class)}, count=total)


def stale_letters_verdict(open_letters: int, oldest_age_seconds: float, max_age_hours: float) -> Verdict:
    """Pure: fails when the oldest unresolved dead letter is older than the limit."""
    hours = oldest_age_seconds / 3600
    passed = open_letters == 0 or hours <= max_age_hours
    text = (f"{open_letters} unresolved dead letter(s), the oldest {hours:.1f} h old (limit {max_age_hours:g} h)"
            if open_letters else "no unresolved dead letter")
    return Verdict(STALE_LETTERS, passed, dg.AssetCheckSeverity.WARN, text,
                   {"open_dead_letters": open_letters, "oldest_open_hours": round(hours, 3)}, count=open_letters)


def due_flowing_verdict(due: int, oldest_wait_seconds: float, max_wait_seconds: float) -> Verdict:
    """Pure: fails when work that is due has waited longer than the limit (nobody is taking it)."""
    passed = due == 0 or oldest_wait_seconds <= max_wait_seconds
    text = (f"{due} item(s) due, the oldest waiting {oldest_wait_seconds:.0f} s (limit {max_wait_seconds:g} s)"
            if due else "nothing due")
    return Verdict(DUE_FLOWING, passed, dg.AssetCheckSeverity.ERROR, text,
                   {"due": due, "oldest_wait_seconds": round(oldest_wait_seconds, 1)}, count=due)


def progressing_verdict(state: StallState | None, now: datetime, stall_seconds: float) -> Verdict:
    """Pure: fails while the stall watch holds the pipeline stalled (due work, no progress for the limit)."""
    waited = state.seconds_without_progress(now) if state is not None else 0.0
    due = state.due if state is not None else 0
    if state is not None and state.stalled_since is not None:
        text = (f"stalled: {due} item(s) due and no progress for {waited:.0f} s (limit {stall_seconds:g} s); "
                "see docs/operating.md, Stuck runs and stalled pipelines")
        return Verdict(PROGRESSING, False, dg.AssetCheckSeverity.ERROR, text,
                       {"due": due, "seconds_without_progress": round(waited, 1)})
    text = f"moving: {due} item(s) due, last progress {waited:.0f} s ago" if due else "nothing due"
    return Verdict(PROGRESSING, True, dg.AssetCheckSeverity.ERROR, text,
                   {"due": due, "seconds_without_progress": round(waited, 1)})


def backlog_key(pipeline: str) -> dg.AssetKey:
    return dg.AssetKey(f"{pipeline}_backlog")


def verdicts(runtime: Reliability, pipelines: Sequence[str], sources: Mapping[str, PipelineSource],
             max_age_hours: float, max_wait_seconds: float,
             stall_seconds: float = DEFAULT_STALL_SECONDS) -> dict[str, list[Verdict]]:
    """The four verdicts of every pipeline, from one read of PostgreSQL."""
    now: datetime = runtime.now()
    with runtime.engine.connect() as conn:
        letters = open_dead_letters(conn)
        due = due_work(conn, now, pipelines, sources)
        states = stalls.load(conn)
    out = {}
    for pipeline in pipelines:
        mine = [(n, first) for p, _, n, first in letters if p == pipeline]
        by_class = {c: n for p, c, n, _ in letters if p == pipeline}
        oldest_letter = max(((now - first).total_seconds() for _, first in mine), default=0.0)
        n_due, oldest_due = due.get(pipeline, [0, None])
        wait = (now - oldest_due).total_seconds() if oldest_due is not None else 0.0
        out[pipeline] = [open_letters_verdict(pipeline, by_class),
                         stale_letters_verdict(sum(n for n, _ in mine), oldest_letter, max_age_hours),
                         due_flowing_verdict(n_due, wait, max_wait_seconds),
                         progressing_verdict(states.get(pipeline), now, stall_seconds)]
    return out


CHECKS_JOB = "pipeline_backlog_checks"


def backlog_defs(pipelines: Sequence[str], sources: Mapping[str, PipelineSource], max_age_hours: float,
                 max_wait_seconds: float, stall_seconds: float = DEFAULT_STALL_SECONDS) -> tuple[list[dg.AssetSpec], list[dg.AssetChecksDefinition],
                                                   Any]:
    """One backlog asset per pipeline, in the pipeline's group, its two checks, and a job running all of them."""
    specs, checks = [], []
    for pipeline in pipelines:
        key = backlog_key(pipeline)
        specs.append(dg.AssetSpec(
            key, group_name=pipeline, owners=OWNERS, kinds={"postgres"}, tags={"redrive/pipeline": pipeline},
            description=f"{pipeline}'s open work: due queue rows and retry timers, and its unresolved dead letters. "
                        "Not materialized; its checks say whether work flows and letters are handled."))
        checks.append(_checks(pipeline, key, sources, max_age_hours, max_wait_seconds, stall_seconds))
    job = dg.define_asset_job(CHECKS_JOB, selection=dg.AssetSelection.checks(*checks),
                              description="Runs every pipeline's backlog checks now (the sensor reports them every "
                                          "5 minutes without a run).")
    return specs, checks, job


def _checks(pipeline: str, key: dg.AssetKey, sources: Mapping[str, PipelineSource], max_age_hours: float,
            max_wait_seconds: float, stall_seconds: float) -> dg.AssetChecksDefinition:
    @dg.multi_asset_check(
        name=f"{pipeline}_backlog_checks",
        specs=[dg.AssetCheckSpec(OPEN_LETTERS, asset=key, description=(
                   f"No {pipeline} dead letter is unresolved (a drain run that dead-letters an entity is still a "
                   "green run: this check is where it shows; `redrive dlq list`).")),
               dg.AssetCheckSpec(STALE_LETTERS, asset=key, description=(
                   f"No unresolved {pipeline} dead letter is older than DEAD_LETTER_MAX_AGE_HOURS "
                   f"({max_age_hours:g} h).")),
               dg.AssetCheckSpec(DUE_FLOWING, asset=key, description=(
                   f"No due {pipeline} work has waited longer than DUE_WORK_MAX_WAIT_SECONDS "
                   f"({max_wait_seconds:g} s).")),
               dg.AssetCheckSpec(PROGRESSING, asset=key, description=(
                   f"{pipeline} is not stalled: it has no due work, or its work moved within PIPELINE_STALL_SECONDS "
                   "(the stall watch's verdict)."))],
        can_subset=True,
        retry_policy=OP_RETRY_POLICY,
    )
    @sanitized_body
    def _check(context: dg.AssetCheckExecutionContext, reliability: ReliabilityResource):
        found = verdicts(reliability.runtime(), [pipeline], sources, max_age_hours, max_wait_seconds,
                         stall_seconds)[pipeline]
        for v in found:
            if dg.AssetCheckKey(key, v.check) in context.selected_asset_check_keys:
                yield dg.AssetCheckResult(asset_key=key, check_name=v.check, passed=v.passed, severity=v.severity,
                                          description=v.description, metadata=dict(v.metadata))

    return _check


def evaluation(pipeline: str, v: Verdict) -> dg.AssetCheckEvaluation:
    """A verdict as the check evaluation a sensor reports (no run)."""
    return dg.AssetCheckEvaluation(asset_key=backlog_key(pipeline), check_name=v.check, passed=v.passed,
                                   severity=v.severity, description=v.description,
                                   metadata={k: dg.MetadataValue.float(float(x)) for k, x in v.metadata.items()})


def evaluations(found: Mapping[str, list[Verdict]]) -> list[dg.AssetCheckEvaluation]:
    """Every verdict as a check evaluation."""
    return [evaluation(pipeline, v) for pipeline, vs in found.items() for v in vs]


def news(found: Mapping[str, list[Verdict]], reported: Mapping[str, Any], now: float,
         refresh_seconds: float) -> tuple[list[dg.AssetCheckEvaluation], dict[str, Any]]:
    """Pure: the evaluations to report this tick, and what the cursor remembers.

    A verdict is reported when it changed since it was last reported (passed, or its count) — so a new
    dead letter shows on the next tick — and otherwise once every `refresh_seconds` (ages stay current,
    and a check never reported shows a result on the first tick). `reported` maps "pipeline/check" to
    [signature, when reported].
    """
    events, cursor = [], {}
    for pipeline, vs in found.items():
        for v in vs:
            key = f"{pipeline}/{v.check}"
            last = reported.get(key)
            if last is None or last[0] != v.signature or now - last[1] >= refresh_seconds:
                events.append(evaluation(pipeline, v))
                cursor[key] = [v.signature, now]
            else:
                cursor[key] = last
    return events, cursor
