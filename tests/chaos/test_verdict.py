"""The chaos harness's verdict on real PostgreSQL rows: a broken build must fail it.

A drain on the core's real work queue dead-letters some entities; the verdict counts them as
dead-lettered. The same drain with the dead-letter write skipped leaves rows dead with no letter,
and the verdict counts them lost. Duplicated effects, a canary in a log and a letter that cannot
be replayed each fail it too, so the harness cannot pass by counting nothing.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa

from bench import _verdict as v
from bench import chaos
from redrive import deadletters, work
from redrive.backoff import FixedSchedule
from redrive.clock import FrozenClock
from redrive.drain import Attempt, Drain
from redrive.failures import Code, Failure, PermanentError
from redrive.reliability import Reliability
from redrive.stages import StagePolicy

START = datetime(2026, 11, 23, 9, 0, tzinfo=UTC)
PIPELINE = "chaos_probe"
POLICIES = {"send": StagePolicy(max_attempts=2, backoff=FixedSchedule((1.0,)))}


def _run(engine: sa.Engine, n: int, fail_every: int) -> set[str]:
    """n entities through a real drain; every `fail_every`-th fails permanently. Returns the refs."""
    clock = FrozenClock(START)
    refs = {f"e-{i}" for i in range(n)}
    with engine.begin() as conn:
        for ref in sorted(refs):
            work.enqueue(conn, PIPELINE, ref, now=clock.now())

    def handle(attempt: Attempt) -> None:
        def send() -> dict[str, bool]:
            if int(attempt.entity_ref.split("-")[1]) % fail_every == 0:
                raise PermanentError(Failure.of(Code.BAD_REQUEST))
            return {"sent": True}

        attempt.stage("send", send)

    Drain(reliability=Reliability(engine=engine, clock=clock), pipeline=PIPELINE, policies=POLICIES, owner="test",
          sleep=clock.sleep, concurrency=2, batch_size=5, linger_seconds=0).run(handle)
    return refs


def _verdict(engine: sa.Engine, refs: set[str], *, drained: set[str] = frozenset({PIPELINE})) -> v.Verdict:
    with engine.connect() as conn:
        rows, letters = chaos.work_rows(conn, PIPELINE), chaos.letter_refs(conn, PIPELINE)
        written, alerted = chaos.letter_ids(conn, PIPELINE), chaos.alerted_letters(conn, PIPELINE)
    return v.verdict(PIPELINE, v.settle(len(refs), refs, rows, letters), duplicate_effects=0,
                     canaries=v.canaries_in(chaos.sink_texts(engine, PIPELINE), ["sk-chaos-neverplanted0000"]),
                     unreplayable=chaos.unreplayable(engine, PIPELINE, set(drained), set()),
                     alerts=v.alert_mismatches(written, alerted))


def test_a_sound_build_passes_with_its_dead_letters_counted(engine) -> None:
    refs = _run(engine, 12, fail_every=4)
    verdict = _verdict(engine, refs)
    assert (verdict.items_in, verdict.done, verdict.dead_lettered, verdict.lost) == (12, 9, 3, 0)
    assert (verdict.unreplayable, verdict.alerts_not_one) == (0, 0)
    assert not verdict.failed


def test_skipping_the_dead_letter_write_fails_the_verdict(engine, monkeypatch) -> None:
    """The broken build: the dead letter (and its alert) is written and rolled back; the row still ends dead."""
    real = Reliability._record_final

    def skipped(self, conn, final, link):
        nested = conn.begin_nested()
        recorded = real(self, conn, final, link)
        nested.rollback()
        return recorded

    monkeypatch.setattr(Reliability, "_record_final", skipped)
    refs = _run(engine, 12, fail_every=4)
    verdict = _verdict(engine, refs)
    assert verdict.dead_lettered == 0
    assert verdict.lost == 3 and verdict.failed
    assert set(verdict.examples["lost"]) == {"e-0", "e-4", "e-8"}


def test_an_entity_the_system_never_saw_is_lost(engine) -> None:
    refs = _run(engine, 4, fail_every=100)
    verdict = _verdict(engine, refs | {"e-submitted-but-never-enqueued"})
    assert verdict.lost == 1 and verdict.failed


def test_an_alert_sent_twice_or_never_fails_the_verdict(engine) -> None:
    refs = _run(engine, 8, fail_every=4)
    with engine.begin() as conn:
        first, second = (deadletters.active_for(conn, PIPELINE, ref).id for ref in ("e-0", "e-4"))
        conn.execute(sa.text("INSERT INTO alerts (dedupe_key, group_key, pipeline, kind, entity_ref, summary) "
                             "VALUES (:k, 'g', :p, 'dead_letter', 'e-0', 'sent twice')"),
                     {"p": PIPELINE, "k": f"dead_letter:{first}:0:again"})
        conn.execute(sa.text("DELETE FROM alerts WHERE entity_ref = 'e-4'"))
    verdict = _verdict(engine, refs)
    assert verdict.alerts_not_one == 2 and verdict.failed
    assert sorted(verdict.examples["alerts"]) == sorted([(str(first), 2), (str(second), 0)])


def test_a_letter_replay_cannot_run_is_unreplayable(engine) -> None:
    refs = _run(engine, 8, fail_every=4)
    assert _verdict(engine, refs, drained=set()).unreplayable == 2  # neither drained nor a replay target
    with engine.begin() as conn:
        letter = deadletters.active_for(conn, PIPELINE, "e-0")
        deadletters.request_replay(conn, letter.id, evidence="INC-1", confirm_safe=True, at=START)
    verdict = _verdict(engine, refs)  # a letter already replaying is refused by `redrive dlq replay`
    assert verdict.unreplayable == 1 and verdict.failed
    assert verdict.examples["unreplayable"] == [f"{letter.id}: dead letter {letter.id} is already being replayed"]
    with engine.connect() as conn:  # the dry check changed nothing
        assert deadletters.active_for(conn, PIPELINE, "e-4").status == "open"


def test_a_duplicated_email_counts_per_recipient_and_version() -> None:
    key = chaos.LOADS["review_notifications"].effect_key
    sent = [{"to": "reviewer-1-0@example.com", "subject": "Review v1 of changelist CL-1 is ready", "idempotency_token": t}
            for t in ("a", "b")]
    other = {"to": "reviewer-1-0@example.com", "subject": "Review v2 of changelist CL-1 is ready",
             "idempotency_token": "c"}
    assert v.duplicates([sent[0], other], key) == 0
    assert v.duplicates([*sent, other], key) == 1
    attach = chaos.LOADS["evidence"].effect_key
    assert v.duplicates([{"case_id": "c", "artifact_id": "a", "idempotency_key": k} for k in "xy"], attach) == 1


def test_webhook_deliveries_count_per_request_whatever_their_key() -> None:
    """The receiver keeps one delivery per key; a key that changed between retries is a second delivery to
    the same request's webhook, and the verdict counts it."""
    load = chaos.LOADS["criticizer"]
    ctx = chaos.Context(None, None, "s1", chaos.Canaries.from_seed(1), None, None)  # type: ignore[arg-type]
    posts = [{"kind": "webhook.delivery", "path": "chaos-s1/0", "idempotency_key": k} for k in ("k-a", "k-b")]
    other = {"kind": "webhook.delivery", "path": "chaos-s1/1", "idempotency_key": "k-c"}
    foreign = {"kind": "webhook.delivery", "path": "chaos-s2/0", "idempotency_key": "k-d"}
    mine = [e for e in [*posts, other, foreign] if load.mine(ctx, e)]
    assert load.effect_kind == "webhook.delivery" and len(mine) == 3
    assert v.duplicates(mine, load.effect_key) == 1
    assert v.duplicates([posts[0], other], load.effect_key) == 0


def test_a_canary_in_a_process_log_is_found_and_a_sanitized_one_is_not(project_tmp: Path) -> None:
    canaries = chaos.Canaries.from_seed(3)
    log_file = project_tmp / "worker.log"
    handler = logging.FileHandler(log_file)
    logger = logging.getLogger("chaos-probe")
    logger.addHandler(handler)
    try:
        logger.error("upstream said: invalid key %s for %s", canaries.api_key, canaries.email)  # logs.install()
    finally:
        logger.removeHandler(handler)
        handler.close()
    scan = list(chaos.shared_texts(_NoEffects(), None, 0, [project_tmp]))
    assert v.canaries_in(scan, canaries.values()) == []
    (project_tmp / "leaky.log").write_text(f"Authorization: Bearer {canaries.bearer}\n")
    scan = list(chaos.shared_texts(_NoEffects(), None, 0, [project_tmp]))
    assert v.canaries_in(scan, canaries.values()) == [(f"log {project_tmp / 'leaky.log'}", canaries.bearer)]


def test_canaries_are_shapes_the_sanitizer_knows() -> None:
    """A canary the sanitizer cannot recognise would be a false alarm, not a finding."""
    from redrive.sanitize import sanitize_text

    canaries = chaos.Canaries.from_seed(15)
    text = (f"key {canaries.api_key} auth Bearer {canaries.bearer} card {canaries.card} mail {canaries.email}")
    assert v.canaries_in([("t", sanitize_text(text))], canaries.values()) == []
    assert len(v.canaries_in([("t", text)], canaries.values())) == 4


class _NoEffects:
    def effects(self) -> list[dict]:
        return []


def test_the_longest_stall_counts_only_open_work_that_does_not_move_and_fails_the_verdict_past_the_limit() -> None:
    """Polls of (entities, open): a spell with open work and no change is a stall, a missed poll (PostgreSQL away)
    counts as part of it, idle time does not; a stall over the limit fails the pipeline's verdict."""
    meter = v.StallMeter()
    for t, total, open_ in [(0, 10, 10), (2, 10, 8), (100, 10, 8), (400, 10, 8),  # 398 s stuck at 8 open
                            (402, 10, 0), (900, 10, 0),  # done: idle is not a stall
                            (902, 12, 2), (950, 12, 1)]:
        meter.observe(t, total, open_, expected=10)
    assert meter.longest == 398
    short = v.StallMeter()
    for t in range(0, 600, 2):  # moving every poll
        short.observe(t, 10, 600 - t, expected=10)
    assert short.longest == 0
    settled = v.settle(2, {"a", "b"}, {"a": v.DONE, "b": v.DONE}, set())
    ok = v.verdict("p", settled, duplicate_effects=0, canaries=[], unreplayable=[], alerts=[], longest_stall=299)
    stuck = v.verdict("p", settled, duplicate_effects=0, canaries=[], unreplayable=[], alerts=[],
                      longest_stall=meter.longest)
    assert not ok.failed and stuck.failed and stuck.as_json()["longest_stall_seconds"] == 398
    assert "398 |" in v.table([stuck])[-1] and "FAIL" in v.table([stuck])[-1]
