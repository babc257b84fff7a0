"""The INSERT … ON CONFLICT written for every entity is compiled once, and writes what the Core statement wrote."""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa

from assets.criticizer import repository as criticizer
from redrive import checkpoints

AT = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)


def test_a_checkpoint_and_a_delivery_are_compiled_once_and_round_trip(engine) -> None:
    """SQLAlchemy 2.0 caches no `postgresql.insert`, so each of these compiled again for every entity (7 % of a
    criticizer run worker). Written twice, the second is a hit in the engine's statement cache; what was written
    reads back with its types (JSONB, timestamps), and a conflict updates or does nothing as before. (Evidence's
    outbox event, built the same way, is written by every evidence test.)"""
    hits: list[tuple[str, object]] = []

    @sa.event.listens_for(engine, "after_execute")
    def seen(conn, clause, multiparams, params, options, result) -> None:  # noqa: ANN001
        hits.append((str(clause).split("(")[0].strip(), result.context.cache_hit))

    with engine.begin() as conn:
        criticizer.create(conn, request_id="r-1", tenant=None, artifact_url="https://store.example/a", rubric="r",
                          webhook_url="https://hooks.example/r-1", webhook_headers={}, fingerprint="f")
        for output in ({"text": "first"}, {"text": "second", "n": [1, 2]}):
            checkpoints.save(conn, "p", "e-1", "fetch", output)
        for status in (200, 500):
            criticizer.record_delivery(conn, "r-1", "webhook", "k-1", status, AT)
    saved = [hit for statement, hit in hits if statement.startswith("INSERT INTO stage_checkpoints")]
    recorded = [hit for statement, hit in hits if statement.startswith("INSERT INTO criticizer_deliveries")]
    cached = engine.dialect.CACHE_HIT
    assert len(saved) == len(recorded) == 2 and saved[1] == recorded[1] == cached, hits
    with engine.connect() as conn:
        assert checkpoints.load(conn, "p", "e-1", "fetch") == {"text": "second", "n": [1, 2]}  # the conflict updated
        assert [(d["target"], d["upstream_status"], d["delivered_at"]) for d in criticizer.deliveries(conn, "r-1")] \
            == [("webhook", 200, AT)]  # the second did nothing
