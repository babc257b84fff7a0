"""Issue 27 §2: the dead-letter console's API, as its page calls it: sign-in, groups, search, detail with the run
link, replay of a group with evidence (refused without), resolve; every action audited in the letter's notes."""

from __future__ import annotations

import sqlalchemy as sa
from starlette.testclient import TestClient

from orchestration.console import PAGE, create_app
from redrive import operators
from redrive.clock import FrozenClock
from tests.foundation.test_dlq_groups import T0, seed

UI = "http://127.0.0.1:3999"


def client(engine: sa.Engine) -> tuple[TestClient, dict[str, str]]:
    with engine.begin() as conn:
        token = operators.create_token(conn, "dana")
    app = create_app(engine, ui_url=UI, clock=FrozenClock(T0), sleep=lambda s: None)
    return TestClient(app), {"authorization": f"Bearer {token}"}


def notes(engine: sa.Engine, entity: str) -> list[dict]:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT notes FROM dead_letters WHERE entity_ref = :e"), {"e": entity}).scalar_one()


def test_sign_in_is_required_and_a_conversion_token_is_not_an_operators(engine) -> None:
    """No token, a wrong one, or a conversion owner's token: 401 on every API route; the page itself loads."""
    from assets.conversion import repository as conversion

    seed(engine)
    http, _ = client(engine)
    with engine.begin() as conn:
        owners = conversion.create_token(conn, "alice")
    for headers in ({}, {"authorization": "Bearer rdo_nope"}, {"authorization": f"Bearer {owners}"}):
        assert http.get("/api/groups", headers=headers).status_code == 401
        assert http.post("/api/letters/1/replay", headers=headers, json={}).status_code == 401
    page = http.get("/")
    assert page.status_code == 200 and "Operator token" in page.text and page.text == PAGE.read_text()


def test_groups_search_and_a_letters_detail_with_its_run_link(engine) -> None:
    """Grouped by root cause with counts; search by entity (a partition's users) and by text; the detail has
    the sanitized context, the stack, the notes and the Dagster run's URL."""
    seed(engine)
    http, auth = client(engine)
    groups = http.get("/api/groups", headers=auth).json()
    assert [(g["pipeline"], g["stage"], g["letters"]) for g in groups] == [
        ("criticizer", "llm", 3), ("matchmaking", "validate", 2), ("criticizer", "fetch", 1)]
    users = http.get("/api/letters", headers=auth, params={"search": "2026-03-08:America/New_York"}).json()
    assert sorted(u["entity_ref"] for u in users) == ["2026-03-08:America/New_York:u-1",
                                                      "2026-03-08:America/New_York:u-2"]
    by_entity = http.get("/api/letters", headers=auth, params={"entity": "2026-03-08:America/New_York"}).json()
    assert len(by_entity) == 2
    one = http.get("/api/letters", headers=auth, params={"group": groups[2]["fingerprint"]}).json()
    detail = http.get(f"/api/letters/{one[0]['id']}", headers=auth).json()
    assert detail["run_url"] == f"{UI}/runs/{detail['run_id']}" and detail["error_message"] == "artifact missing"
    assert detail["sanitized_context"]["stage"] == "fetch" and detail["notes"][0]["kind"] == "dead_lettered"


def test_a_group_replay_needs_evidence_and_the_safety_statement_and_is_audited(engine) -> None:
    """Refused (409, nothing changed) without a note or without confirm_safe; accepted: every letter of the group
    is replaying, its note naming the operator and the evidence. A letter resolves with a note, audited too."""
    seed(engine)
    http, auth = client(engine)
    group = http.get("/api/groups", headers=auth).json()[0]["fingerprint"]
    for body in ({"confirm_safe": True}, {"note": "INC-7: key rotated"}, {"note": "  ", "confirm_safe": True}):
        refused = http.post(f"/api/groups/{group}/replay", headers=auth, json=body)
        assert refused.status_code == 409 and "replay refused" in refused.json()["error"]
    assert all(n[-1]["kind"] == "dead_lettered" for n in (notes(engine, f"req-{i}") for i in range(3)))
    accepted = http.post(f"/api/groups/{group}/replay", headers=auth,
                         json={"note": "INC-7: key rotated", "confirm_safe": True, "rate": 1000})
    assert accepted.status_code == 202 and accepted.json()["requested"] == 3
    from tests.matchmaking.conftest import wait_for

    wait_for(lambda: all(notes(engine, f"req-{i}")[-1]["kind"] == "replay_requested" for i in range(3)),
             what="the paced group replay", timeout=30)
    last = notes(engine, "req-0")[-1]
    assert last["by"] == "operator:dana" and "INC-7: key rotated" in last["text"]

    single = http.get("/api/letters", headers=auth, params={"entity": "req-9"}).json()[0]
    assert http.post(f"/api/letters/{single['id']}/resolve", headers=auth, json={}).status_code == 409
    done = http.post(f"/api/letters/{single['id']}/resolve", headers=auth, json={"note": "artifact withdrawn"})
    assert done.status_code == 200 and done.json()["status"] == "resolved"
    assert notes(engine, "req-9")[-1]["by"] == "operator:dana"
    again = http.post(f"/api/letters/{single['id']}/replay", headers=auth,
                      json={"note": "x", "confirm_safe": True})
    assert again.status_code == 409 and "resolved" in again.json()["error"]
