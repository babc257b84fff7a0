"""Issue 27 §2 (the CLI half): dead letters by root cause, search by entity or text, a group replayed at once."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from click.testing import CliRunner

from orchestration.cli import app
from redrive import deadletters
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure

T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def cli(db_url: str, *args: str, code: int = 0, **env: str):
    out = CliRunner().invoke(app, list(args), env={"DATABASE_URL": db_url, **env}, catch_exceptions=False)
    assert out.exit_code == code, out.output
    return out.output


def seed(engine: sa.Engine) -> None:
    """Three 401s whose messages differ only in ids and numbers, a 404 of another stage, two users of a partition."""
    failures = [("criticizer", "llm", f"req-{i}", Code.AUTH_DENIED,
                 f"LLM 401 for request 9f{i}c2a1e-0b7d-4c1e-9a3f-00000000000{i}: key revoked after {10 + i} calls")
                for i in range(3)]
    failures += [("criticizer", "fetch", "req-9", Code.NOT_FOUND, "artifact missing"),
                 ("matchmaking", "validate", "2026-03-08:America/New_York:u-1", Code.DATA_ERROR, "age range"),
                 ("matchmaking", "validate", "2026-03-08:America/New_York:u-2", Code.DATA_ERROR, "age range")]
    with engine.begin() as conn:
        for i, (pipeline, stage, entity, code, message) in enumerate(failures):
            deadletters.record(conn, FinalFailure(pipeline=pipeline, stage=stage, entity_ref=entity, attempts=1,
                                                  failure=Failure.of(code, message=message),
                                                  at=T0 + timedelta(minutes=i), run_id=f"run-{i}"))


def test_groups_count_one_root_cause_once_with_first_last_and_a_sample(engine, db_url) -> None:
    """The three 401s are one group (ids and numbers aside); each group has its counts, first/last seen, the
    newest letter as its sample; `dlq list --group` lists exactly that group's letters."""
    seed(engine)
    found = json.loads(cli(db_url, "dlq", "groups", "--json"))
    shape = [(g["pipeline"], g["stage"], g["error_class"], g["letters"]) for g in found]
    assert shape == [("criticizer", "llm", "AUTH_DENIED", 3), ("matchmaking", "validate", "DATA_ERROR", 2),
                     ("criticizer", "fetch", "NOT_FOUND", 1)]
    llm = found[0]
    assert (llm["first_seen"], llm["last_seen"]) == (T0.isoformat(), (T0 + timedelta(minutes=2)).isoformat())
    assert llm["sample_entity"] == "req-2" and "key revoked" in llm["sample_message"]
    listed = json.loads(cli(db_url, "dlq", "list", "--group", llm["fingerprint"], "--json"))
    assert sorted(r["entity_ref"] for r in listed) == ["req-0", "req-1", "req-2"]
    assert llm["fingerprint"] in cli(db_url, "dlq", "groups")  # the table shows the id to act on


def test_search_by_entity_and_by_text(engine, db_url) -> None:
    """`--entity` finds an entity and those under it (a partition's users); `--search` any text, any case."""
    seed(engine)
    under = json.loads(cli(db_url, "dlq", "list", "--entity", "2026-03-08:America/New_York", "--json"))
    assert sorted(r["entity_ref"] for r in under) == ["2026-03-08:America/New_York:u-1",
                                                      "2026-03-08:America/New_York:u-2"]
    assert [r["entity_ref"] for r in json.loads(cli(db_url, "dlq", "list", "--entity", "req-9", "--json"))] == ["req-9"]
    assert len(json.loads(cli(db_url, "dlq", "list", "--search", "KEY REVOKED", "--json"))) == 3
    assert json.loads(cli(db_url, "dlq", "list", "--search", "nothing like it", "--json")) == []


def test_a_group_replays_with_evidence_and_safety_only(engine, db_url) -> None:
    """`dlq replay-group` is refused without the safety statement and without evidence; with both, every letter
    of the group (and no other) is replaying, each with the evidence in its notes."""
    seed(engine)
    group = json.loads(cli(db_url, "dlq", "groups", "--json"))[0]["fingerprint"]
    refused = cli(db_url, "dlq", "replay-group", group, "--note", "INC-7: key rotated", "--rate", "100")
    assert "requested 0 replays, refused 3" in refused and "--confirm-safe" in refused
    cli(db_url, "dlq", "replay-group", group, "--confirm-safe", "--rate", "100", code=2)  # --note is required
    done = cli(db_url, "dlq", "replay-group", group, "--note", "INC-7: key rotated", "--confirm-safe",
               "--rate", "100")
    assert "requested 3 replays, refused 0" in done
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT entity_ref, status, notes FROM dead_letters ORDER BY id")).all()
    replaying = {r.entity_ref for r in rows if r.status == "replaying"}
    assert replaying == {"req-0", "req-1", "req-2"}
    assert all("INC-7: key rotated" in r.notes[-1]["text"] for r in rows if r.status == "replaying")


def test_dlq_show_links_the_run(engine, db_url) -> None:
    """`dlq show` gives the run's page in the Dagster UI (DAGSTER_UI_URL), text and JSON."""
    seed(engine)
    with engine.connect() as conn:
        letter = conn.execute(sa.text("SELECT id, run_id FROM dead_letters WHERE entity_ref = 'req-9'")).one()
    shown = cli(db_url, "dlq", "show", str(letter.id), DAGSTER_UI_URL="http://127.0.0.1:3999/")
    assert f"run_url: http://127.0.0.1:3999/runs/{letter.run_id}" in shown
    as_json = json.loads(cli(db_url, "dlq", "show", str(letter.id), "--json", DAGSTER_UI_URL="http://ui.example"))
    assert as_json["run_url"] == f"http://ui.example/runs/{letter.run_id}"
