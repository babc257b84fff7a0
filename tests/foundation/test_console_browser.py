"""Issue 27 §2: the dead-letter console's page in a real headless Chromium, against the console served on a real
port (uvicorn) over the test's database: sign-in required (a conversion owner's token refused), the letters by root
cause with counts, search by entity, a letter's sanitized detail with its Dagster run link, a group replay refused
without its evidence note and safety box and done with them. Each step is checked on the page and in the database.

The browser, the server and the waits are tests/browser.py's (shared with tests/conversion/test_browser.py). The
screenshots go into REDRIVE_SCREENSHOTS when it is set (`make screenshots`: docs/images, shown in
docs/operating.md "Dead letters"), else into the test's temporary folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from selenium.webdriver.common.by import By

from orchestration.console import create_app
from redrive import deadletters, operators
from redrive.clock import FrozenClock
from redrive.deadletters import FinalFailure
from redrive.failures import Code, Failure
from tests.browser import wait_until
from tests.foundation.test_dlq_groups import T0, seed

pytestmark = pytest.mark.browser

UI = "http://127.0.0.1:3000"  # the Dagster UI of `make dev` (DAGSTER_UI_URL)
RUN_ID = "8c1e2f4a-6b0d-4e2a-9f17-3d5c2b1a0e9f"
API_KEY = "sk_live_4f9a8b7c6d5e4f3a2b1c"
EMAIL = "billing.lead@acme.example"
STACK = f"""Traceback (most recent call last):
  File "assets/evidence/ingest.py", line 88, in ingest_rows
    rows = client.post(url, headers={{"Authorization": "Bearer {API_KEY}"}}, json=batch)
ValueError: row 17: amount 'twelve' is not a number (uploaded by {EMAIL})"""
USERS = ["2026-03-08:America/New_York:u-1", "2026-03-08:America/New_York:u-2"]
LLM = [f"req-{i}" for i in range(3)]
EVIDENCE = "inbox/2026-06-01.zip#row-17"
OPEN = sorted(LLM + USERS + ["req-9", EVIDENCE])
GROUPS = [("criticizer", "llm", "AUTH_DENIED", "3"), ("matchmaking", "validate", "DATA_ERROR", "2"),
          ("evidence", "ingest", "SCHEMA_INVALID", "1"), ("criticizer", "fetch", "NOT_FOUND", "1")]


@dataclass(frozen=True)
class Console:
    url: str
    token: str  # operator dana's


@pytest.fixture
def console(engine, serve_app) -> Console:
    """test_dlq_groups's letters (three 401s of one root cause, a 404, a partition's two users) plus an evidence row
    whose stack and context carried an API key and an email; the console on a real port, on a frozen clock, its group
    replays unpaced."""
    seed(engine)
    with engine.begin() as conn:
        deadletters.record(conn, FinalFailure(
            pipeline="evidence", stage="ingest", entity_ref=EVIDENCE, attempts=1,
            failure=Failure.of(Code.SCHEMA_INVALID, message="row 17: amount is not a number"), stack=STACK,
            context={"api_key": API_KEY, "file": "inbox/2026-06-01.zip", "row": 17}, at=T0 + timedelta(minutes=10),
            run_id=RUN_ID))
        token = operators.create_token(conn, "dana")
    app = create_app(engine, ui_url=UI, clock=FrozenClock(T0 + timedelta(minutes=30)), sleep=lambda s: None)
    return Console(serve_app(app), token)


def letters_in_db(engine, entities: list[str]) -> dict[str, Any]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, entity_ref, status, replay_count, notes, run_id FROM dead_letters "
                                    "WHERE entity_ref = ANY(:e)"), {"e": entities}).all()
    return {r.entity_ref: r for r in rows}


def status_of(driver, fetch_token: str | None = None) -> int:
    """What the API answers the browser for /api/groups, with that bearer token or none."""
    return driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('/api/groups', {headers: arguments[0] ? {authorization: 'Bearer ' + arguments[0]} : {}})"
        ".then((r) => done(r.status), (e) => done(String(e)));", fetch_token)


def by_id(driver, element_id: str):
    return driver.find_element(By.ID, element_id)


def groups_shown(driver) -> list[tuple[str, ...]]:
    return [tuple(row.find_element(By.CSS_SELECTOR, cell).text for cell in (".pipeline", ".stage", ".error-class",
                                                                            ".count"))
            for row in driver.find_elements(By.CSS_SELECTOR, "#groups tbody tr")]


def group_row(driver, pipeline: str, stage: str):
    for row in driver.find_elements(By.CSS_SELECTOR, "#groups tbody tr"):
        if (row.find_element(By.CSS_SELECTOR, ".pipeline").text, row.find_element(By.CSS_SELECTOR, ".stage").text) \
                == (pipeline, stage):
            return row
    raise AssertionError(f"no group {pipeline}/{stage} on the page")


def click_in_group(driver, pipeline: str, stage: str, button: str) -> None:
    """Click a group's button, looking again if the list was re-rendered under the click."""
    wait_until(lambda: group_row(driver, pipeline, stage).find_element(By.CSS_SELECTOR, button).click() or True,
               what=f"{button} of {pipeline}/{stage}")


def letters_shown(driver) -> dict[str, tuple[str, str]]:
    """entity → (letter id, status) of the letters table."""
    return {row.find_element(By.CSS_SELECTOR, ".entity").text: (row.get_attribute("data-id"),
                                                                 row.find_element(By.CSS_SELECTOR, ".status").text)
            for row in driver.find_elements(By.CSS_SELECTOR, "#letters tbody tr")}


def sign_in(driver, token: str) -> None:
    field = by_id(driver, "token")
    field.clear()
    field.send_keys(token)
    by_id(driver, "signin-button").click()


def signed_in(driver, console: Console) -> None:
    driver.get(console.url + "/")
    sign_in(driver, console.token)
    wait_until(lambda: by_id(driver, "app").is_displayed() and groups_shown(driver) == GROUPS
               and sorted(letters_shown(driver)) == OPEN, what="the groups and the open letters")


def test_sign_in_is_required_and_a_conversion_owners_token_is_refused(driver, console, engine) -> None:
    """Not signed in: the sign-in form, no letters, and the API answers the page 401; a conversion owner's token is
    refused on the page (its message shown, nothing listed); dana's operator token signs in."""
    from assets.conversion import repository as conversion

    with engine.begin() as conn:
        owners = conversion.create_token(conn, "alice")
    driver.get(console.url + "/")
    wait_until(lambda: by_id(driver, "signin").is_displayed(), what="the sign-in form")
    assert not by_id(driver, "app").is_displayed()
    assert groups_shown(driver) == [] and letters_shown(driver) == {}
    assert not any(entity in driver.page_source for entity in LLM + USERS)
    assert status_of(driver) == 401 and status_of(driver, owners) == 401 and status_of(driver, console.token) == 200

    sign_in(driver, owners)
    refused = wait_until(lambda: by_id(driver, "signin-message").text, what="the refusal of alice's token")
    assert refused == "unknown or revoked operator token"
    assert by_id(driver, "signin").is_displayed() and not by_id(driver, "app").is_displayed()
    assert groups_shown(driver) == [] and "req-0" not in driver.page_source

    sign_in(driver, console.token)
    wait_until(lambda: by_id(driver, "app").is_displayed() and groups_shown(driver) == GROUPS, what="dana's groups")
    assert not by_id(driver, "signin").is_displayed() and by_id(driver, "signin-message").text == ""


def test_groups_with_counts_search_by_entity_and_a_letters_detail_with_its_run_link(
        driver, console, engine, screenshot_dir) -> None:
    """The root causes with their counts, largest first, and every open letter; searching a partition narrows the
    letters to its two users; a group's letters; a letter's detail shows its sanitized context and stack (no key, no
    email) and links its Dagster run in the UI."""
    signed_in(driver, console)
    assert {status for _, status in letters_shown(driver).values()} == {"open"}
    assert driver.save_screenshot(str(screenshot_dir / "dlq-console-groups.png"))

    by_id(driver, "search").send_keys("2026-03-08:America/New_York")
    by_id(driver, "search-button").click()
    wait_until(lambda: sorted(letters_shown(driver)) == USERS and by_id(driver, "letters-title").text
               == "Letters matching 2026-03-08:America/New_York", what="the search to narrow the list to the users")
    in_db = letters_in_db(engine, USERS)
    assert {e: int(i) for e, (i, _) in letters_shown(driver).items()} == {e: r.id for e, r in in_db.items()}
    by_id(driver, "clear").click()
    wait_until(lambda: sorted(letters_shown(driver)) == OPEN, what="all open letters again")
    assert groups_shown(driver) == GROUPS and by_id(driver, "search").get_attribute("value") == ""

    click_in_group(driver, "evidence", "ingest", "button.open-group")
    letter = letters_in_db(engine, [EVIDENCE])[EVIDENCE]
    wait_until(lambda: letters_shown(driver) == {EVIDENCE: (str(letter.id), "open")},
               what="the evidence group's letter")
    driver.find_element(By.CSS_SELECTOR, f'#letters tr[data-id="{letter.id}"] a.show').click()
    wait_until(lambda: by_id(driver, "detail").is_displayed() and by_id(driver, "detail-stack").text,
               what="the letter's detail")
    detail = by_id(driver, "detail")
    assert f"Dead letter {letter.id}: evidence / ingest / inbox/2026-06-01.zip#row-17" in detail.text
    assert "SCHEMA_INVALID: row 17: amount is not a number" in detail.text
    context, stack = by_id(driver, "detail-context").text, by_id(driver, "detail-stack").text
    assert '"file": "inbox/2026-06-01.zip"' in context and '"stage": "ingest"' in context
    assert '"api_key": "[REDACTED:api_key:hmac=' in context
    assert 'File "assets/evidence/ingest.py", line 88, in ingest_rows' in stack
    assert "Bearer [REDACTED:" in stack and "[REDACTED:email:hmac=" in stack
    assert API_KEY not in driver.page_source and EMAIL not in driver.page_source
    assert "dead_lettered (redrive): SCHEMA_INVALID" in by_id(driver, "detail-notes").text
    link = by_id(driver, "run-link")
    assert letter.run_id == RUN_ID and link.text == "Dagster run"
    assert link.get_attribute("href") == f"{UI}/runs/{RUN_ID}"
    driver.execute_script("arguments[0].scrollIntoView()", detail)
    assert driver.save_screenshot(str(screenshot_dir / "dlq-console-detail.png"))


def test_a_group_replay_is_refused_without_evidence_and_safety_and_recorded_with_them(
        driver, console, engine, screenshot_dir) -> None:
    """"Replay group" on the 401 group: without the evidence note, then without the safety box, the page shows the
    refusal and no letter changed; with both, the three letters (and no other) are replaying, each with a note by
    operator:dana carrying the evidence, and the page lists them as replaying."""
    signed_in(driver, console)
    before = letters_in_db(engine, LLM + USERS + ["req-9"])
    assert {r.status for r in before.values()} == {"open"}
    row = group_row(driver, "criticizer", "llm")
    group = row.get_attribute("data-group")
    row.find_element(By.CSS_SELECTOR, "button.replay-group").click()
    wait_until(lambda: by_id(driver, "act").is_displayed(), what="the replay form")
    assert by_id(driver, "act-title").text == f"Group {group}"
    assert by_id(driver, "note").get_attribute("value") == "" and not by_id(driver, "safe").is_selected()

    def refused(expected: str) -> None:
        by_id(driver, "do-replay").click()
        wait_until(lambda: by_id(driver, "message").text == expected, what=f"the refusal {expected!r}")
        assert letters_in_db(engine, list(before)) == before  # status, replay count and notes all as they were

    refused("replay refused: record the remediation evidence first (ticket and what was fixed)")
    by_id(driver, "note").send_keys("INC-7: LLM key rotated")
    refused("replay refused: confirm the replay is idempotent or safe for duplicate effects")
    assert driver.save_screenshot(str(screenshot_dir / "dlq-console-replay-refused.png"))

    by_id(driver, "safe").click()
    by_id(driver, "do-replay").click()
    wait_until(lambda: by_id(driver, "message").text == "replay of 3 letters requested (1/s)", what="the request")
    wait_until(lambda: {r.status for r in letters_in_db(engine, LLM).values()} == {"replaying"},
               what="the group's letters to be replaying in the database")
    after = letters_in_db(engine, LLM + USERS + ["req-9"])
    for entity in LLM:
        assert after[entity].replay_count == 1 and after[entity].notes[:-1] == before[entity].notes
        last = after[entity].notes[-1]
        assert (last["kind"], last["by"]) == ("replay_requested", "operator:dana")
        assert last["text"] == "from llm: INC-7: LLM key rotated"
    assert all(after[e] == before[e] for e in USERS + ["req-9"])

    click_in_group(driver, "criticizer", "llm", "button.open-group")
    wait_until(lambda: letters_shown(driver) == {e: (str(after[e].id), "replaying") for e in LLM},
               what="the page to list the group as replaying")
