"""Requests arrive through the Python API and the command: validated, stored once, never echoing a secret."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from assets.criticizer import api, policy
from assets.criticizer.cli import app
from assets.criticizer.repository import SEALED, criticizer_requests, open_headers

SECRET = "hdr-canary-5e1f0a77"
GOOD = {
    "artifact_url": "http://store.test/store/reviews/pr-1.diff",
    "rubric": "Is the change safe to deploy?",
    "webhook_url": "http://hooks.test/requester/pr-1",
    "webhook_headers": {"Authorization": f"Bearer {SECRET}"},
}


@pytest.fixture(autouse=True)
def allowed_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """The configured artifact stores, as an operator sets them."""
    monkeypatch.setenv("CRITICIZER_ARTIFACT_URL_PREFIXES", "http://store.test/store/, http://docs.test/")


def rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(criticizer_requests)).scalar_one()


def test_submitting_the_same_request_twice_is_one_request(engine) -> None:
    """No id given: the id derives from the content, so a resubmission returns the same id and adds nothing."""
    first = api.submit(engine, GOOD)
    again = api.submit(engine, dict(GOOD))
    assert first.created and not again.created
    assert first.request_id == again.request_id and first.request_id.startswith("crit-")
    assert api.submit(engine, {**GOOD, "rubric": "Another question"}).request_id != first.request_id
    assert rows(engine) == 2
    assert api.status(engine, first.request_id).status == "submitted"


def test_reusing_an_id_for_other_content_is_refused_and_keeps_the_first(engine) -> None:
    """The same request_id with another artifact: RequestIdConflict, and the stored request is unchanged."""
    api.submit(engine, {**GOOD, "request_id": "pr-1"})
    with pytest.raises(api.RequestIdConflict, match="already used by a different request"):
        api.submit(engine, {**GOOD, "request_id": "pr-1", "artifact_url": "http://store.test/store/other"})
    with engine.connect() as conn:
        assert conn.execute(sa.select(criticizer_requests.c.artifact_url)).scalar_one() == GOOD["artifact_url"]


@pytest.mark.parametrize(("change", "message"), [
    ({"artifact_url": "file:///etc/passwd"}, "artifact_url: must be an absolute http(s) URL"),
    ({"webhook_url": "not a url"}, "webhook_url: must be an absolute http(s) URL"),
    ({"rubric": "   "}, "rubric: String should have at least 1 character"),
    ({"request_id": "../etc"}, "request_id: must be 1-128 letters"),
    ({"webhook_headers": {"Authorization": f"Bearer {SECRET}\r\nX-Injected: 1"}},
     "webhook_headers: header Authorization: value too long or contains a line break"),
    ({"webhook_headers": {"Idempotency-Key": SECRET}}, "header Idempotency-Key is set by the criticizer"),
    ({"priority": "high"}, "priority: Extra inputs are not permitted"),
])
def test_bad_input_is_refused_with_a_clear_message_and_nothing_stored(engine, change, message) -> None:
    """Each invalid field is named with its problem; the header's secret value is never in the message."""
    with pytest.raises(api.InvalidRequest) as refused:
        api.submit(engine, {**GOOD, **change})
    assert message in str(refused.value)
    assert SECRET not in str(refused.value)
    assert rows(engine) == 0


def test_missing_fields_are_all_named(engine) -> None:
    """A request without artifact, rubric and webhook names all three at once."""
    with pytest.raises(api.InvalidRequest) as refused:
        api.submit(engine, {"webhook_headers": {}})
    assert all(f"{field}: Field required" in str(refused.value) for field in ("artifact_url", "rubric", "webhook_url"))


def test_artifact_outside_the_allowed_stores_is_refused_at_submit(engine) -> None:
    """An artifact URL outside the configured stores (an SSRF attempt) is bad input, not a failed run."""
    with pytest.raises(api.InvalidRequest) as refused:
        api.submit(engine, {**GOOD, "artifact_url": "http://169.254.169.254/latest/meta-data"})
    assert str(refused.value) == ("invalid critique request: artifact_url: not in an allowed store "
                                  "(http://store.test/store/, http://docs.test/)")
    assert api.submit(engine, {**GOOD, "artifact_url": "http://docs.test/a.md"}).created
    assert api.submit(engine, {**GOOD, "artifact_url": "http://anywhere.test/a.md"},
                      allowed_artifact_prefixes=()).created  # an explicit "anywhere"
    assert rows(engine) == 2


def cli(db_url: str, *args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env={"DATABASE_URL": db_url, **(env or {})}, catch_exceptions=False)


def test_command_submits_reads_header_from_env_and_shows_status(db_url, engine, stack) -> None:
    """`submit` stores the request (header value from an env var, not argv); `status` and `list` show it."""
    artifact = "http://store.test/store/reviews/cli.py"
    out = cli(db_url, "submit", "--artifact-url", artifact, "--rubric", "Any bugs?", "--webhook-url",
              "http://hooks.test/requester/cli", "--header-from-env", "Authorization=CRIT_TEST_WEBHOOK_AUTH",
              "--header", "X-Team: reviews", "--request-id", "cli-1", "--json",
              env={"CRIT_TEST_WEBHOOK_AUTH": f"Bearer {SECRET}"})
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == {"request_id": "cli-1", "created": True}
    with engine.connect() as conn:
        headers = conn.execute(sa.select(criticizer_requests.c.webhook_headers)).scalar_one()
    # issue 13 item 14: stored sealed, names readable, values only for the delivery
    assert set(headers) == {"Authorization", "X-Team"} and SECRET not in json.dumps(headers)
    assert all(v.startswith(SEALED) for v in headers.values())
    assert open_headers(headers) == {"Authorization": f"Bearer {SECRET}", "X-Team": "reviews"}

    shown = cli(db_url, "status", "cli-1", "--json")
    assert json.loads(shown.output)["status"] == "submitted" and SECRET not in shown.output
    listed = cli(db_url, "list")
    assert "cli-1  submitted" in listed.output and SECRET not in listed.output


def test_command_refuses_bad_input_in_one_line(db_url, engine, stack) -> None:
    """Bad input exits 2 with one `error:` line naming the problem; no traceback, no secret, nothing stored."""
    out = cli(db_url, "submit", "--artifact-url", "ftp://x/y", "--rubric", "?", "--webhook-url",
              "http://hooks.test/x", "--header", f"Authorization: Bearer {SECRET}\u0000")
    assert out.exit_code == 2
    assert out.output.startswith("error: invalid critique request: artifact_url")
    assert "Traceback" not in out.output and SECRET not in out.output
    outside = cli(db_url, "submit", "--artifact-url", "http://elsewhere.test/a", "--rubric", "?",
                  "--webhook-url", "http://hooks.test/x")
    assert outside.exit_code == 2 and "not in an allowed store" in outside.output
    missing = cli(db_url, "status", "nope")
    assert missing.exit_code == 2 and "no critique request 'nope'" in missing.output
    assert rows(engine) == 0


def test_triage_context_keeps_hashes_not_secrets() -> None:
    """§8.4: the dead-letter context names ids, hosts and hashes; header values, rubric and webhook path stay out."""
    context = policy.triage_context(
        request_id="pr-1", artifact_url=GOOD["artifact_url"], rubric="PROMPT-7781 secret plan",
        webhook_url="http://hooks.test/T000/B000/XXXXsecretpath", header_names=["Authorization"],
        completed={"fetch": {"sha256": "ab" * 32, "bytes": 10, "text": "artifact body"}}, failing_since=None)
    text = json.dumps(context)
    assert "PROMPT-7781" not in text and "XXXXsecretpath" not in text and "artifact body" not in text
    assert context["webhook_host"] == "hooks.test" and context["webhook_header_names"] == ["authorization"]
    assert context["artifact_sha256"] == "ab" * 8 and context["rubric_sha256"]
