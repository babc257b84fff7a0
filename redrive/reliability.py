"""The core at run time: what every pipeline calls when a unit of work ends for good.

`Reliability` bundles the system of record, the alert channels, the clock and the
random source, so pipelines never write a dead letter, an alert or a timer by hand.
It imports nothing of Dagster; `redrive.stages` adapts it to ops.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from redrive import alerts, counters, deadletters, observations, timers
from redrive.alerts import Alert, Channel, DispatchReport
from redrive.clock import Clock, SystemClock
from redrive.deadletters import FinalFailure, Recorded

log = logging.getLogger(__name__)


@dataclass
class Reliability:
    engine: sa.Engine
    channels: Mapping[str, Channel] = field(default_factory=dict)
    clock: Clock = field(default_factory=SystemClock)
    jitter_seed: str = ""
    time_scale: float = 1.0
    durable_threshold: float = 300.0
    burst_window: float = 300.0
    ui_url: str = "http://localhost:3000"

    def rng_for(self, key: str) -> random.Random:
        """Jitter drawn per (entity, stage, attempt): spread across entities, reproducible for one."""
        return random.Random(f"{self.jitter_seed}:{key}")

    def now(self) -> datetime:
        return self.clock.now()

    def run_link(self, run_id: str | None) -> str | None:
        return f"{self.ui_url.rstrip('/')}/runs/{run_id}" if run_id else None

    def fail_for_good(self, final: FinalFailure, *, link: str | None = None,
                      conn: sa.Connection | None = None) -> Recorded:
        """Dead-letter the final failure and enqueue its alert in one transaction, then try to send.

        Exactly once: the dead letter is one active row per entity and the alert's
        dedupe key names that row and its replay number, so a re-executed op or a
        second worker adds an occurrence, not a second letter or message. Pass `conn`
        to make it part of the caller's transaction (the entity's own `failed` write);
        the alert is then sent by the caller's `try_dispatch()` after commit, or by the
        alert sensor.
        """
        if conn is not None:
            return self._record_final(conn, final, link)
        with self.engine.begin() as own:
            recorded = self._record_final(own, final, link)
        self.try_dispatch()
        return recorded

    def _record_final(self, conn: sa.Connection, final: FinalFailure, link: str | None) -> Recorded:
        """The dead letter and, when it is new or a replay failed, its alert (no sending here)."""
        recorded = deadletters.record(conn, final)
        letter = recorded.dead_letter
        # every pipeline's final failures pass here: each is an attempt that failed for good (a rerun that
        # fails again is one more, though its letter only counts an occurrence), and a new letter or a
        # failed replay is one more dead-lettered entity (`redrive_items_failed_total`)
        observations.observe(conn, final.pipeline, final.stage, observations.FAILED, error_class=final.failure.code)
        if recorded.created or recorded.replay_failed:
            counters.add(conn, counters.ITEMS_FAILED, {"pipeline": final.pipeline, "error_class": final.failure.code})
            kind = "escalation" if recorded.escalated else ("replay_failed" if recorded.replay_failed else "dead_letter")
            what = {
                "dead_letter": "dead-lettered",
                "replay_failed": "failed again after replay",
                "escalation": "failed again with the same error after replay: escalated for engineering review",
            }[kind]
            alerts.enqueue(
                conn,
                Alert(
                    pipeline=final.pipeline,
                    kind=kind,
                    dedupe_key=f"dead_letter:{letter.id}:{letter.replay_count}:{kind}",
                    summary=f"{final.stage} {what}: {final.failure.message} "
                    f"(dead letter {letter.id}; `redrive dlq show {letter.id}`)",
                    entity_ref=final.entity_ref,
                    tenant=final.tenant,
                    error_class=final.failure.code,
                    attempts=final.attempts,
                    link=link or self.run_link(final.run_id),
                ),
                list(self.channels),
                self.now(),
            )
        return recorded

    def observe(self, pipeline: str, stage: str, outcome: str, *, error_class: str | None = None,
                seconds: float | None = None, count: int = 1) -> None:
        """Count stage outcomes for the metrics endpoint (`redrive.observations`), in a transaction of their own."""
        if count <= 0:
            return
        with self.engine.begin() as conn:
            observations.observe(conn, pipeline, stage, outcome, error_class=error_class, seconds=seconds,
                                 count=count)

    def alert(self, alert: Alert) -> bool:
        """Enqueue a non-dead-letter alert (stuck work, broken ordering contract…) and try to send it."""
        with self.engine.begin() as conn:
            created = alerts.enqueue(conn, alert, list(self.channels), self.now())
        if created:
            self.try_dispatch()
        return created

    def try_dispatch(self) -> DispatchReport | None:
        """Best effort now; whatever fails stays pending for the alert sensor."""
        if not self.channels:
            return None
        try:
            return alerts.dispatch(self.engine, self.channels, now=self.now(), burst_window=self.burst_window)
        except Exception:  # noqa: BLE001 - the rows are safe; the sensor retries
            log.warning("alert dispatch failed; deliveries stay pending", exc_info=False)
            return None

    def retry_budget_exhausted(self, upstream: str) -> bool:
        """One alert per upstream and exhaustion episode (`redrive.upstreams` calls it once across processes)."""
        return self.alert(Alert(
            pipeline="upstreams", kind="retry_budget_exhausted", error_class=upstream,
            dedupe_key=f"retry_budget:{upstream}:{self.now().isoformat()}",
            summary=(f"retry budget of upstream {upstream} exhausted: its retries beyond the budget are deferred "
                     "(no attempt spent) until its calls succeed again; see `redrive_upstream_retries_denied_total`"),
        ))

    def defer(self, pipeline: str, entity_ref: str, attempt: int, delay: float,
              payload: Mapping[str, Any] | None = None) -> datetime:
        due_at = self.now() + timedelta(seconds=delay)
        with self.engine.begin() as conn:
            timers.defer(conn, timers.Timer(pipeline, entity_ref, attempt, due_at, payload or {}))
        return due_at

    def resume(self, pipeline: str, entity_ref: str, attempt: int) -> bool:
        """A run started by a durable timer consumes it, so the sensor does not request it again."""
        with self.engine.begin() as conn:
            return timers.consume(conn, pipeline, entity_ref, attempt, self.now())

    def succeeded(self, pipeline: str, entity_ref: str) -> deadletters.DeadLetter | None:
        """Post-replay verification (§8.5): completed work closes its entity's dead letter, if any."""
        with self.engine.begin() as conn:
            return deadletters.close_after_success(conn, pipeline, entity_ref, self.now())
