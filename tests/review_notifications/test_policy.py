"""The pure decisions of review notifications: requests, keys, modes, §6.4 row rules, §6.5, failure scopes."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from assets.review_notifications import policy
from assets.review_notifications.policy import Action, Evidence, Mode, VersionRegression
from redrive.failures import classify_exception

NOW = datetime(2026, 1, 1, tzinfo=UTC)
REQUEST = {"idempotency_key": "req-1", "changelist_id": "CL-4711", "review_version": 3,
           "recipients": ["Ana@Example.com", " bo@example.com "], "summary": "LGTM with nits"}


# ------------------------------------------------------------------------------------------ requests


def test_request_normalizes_recipients_and_version() -> None:
    """Case and spaces do not split one mailbox into two outbox keys; "v3" and 3 are the same version."""
    req = policy.parse_request({**REQUEST, "review_version": "v3",
                                "recipients": ["Ana@Example.com", "ana@example.com ", "bo@example.com"]})
    assert req.review_version == 3
    assert req.recipients == ("ana@example.com", "bo@example.com")


@pytest.mark.parametrize(("field", "value", "named"), [
    ("changelist_id", "CL:1", "changelist_id"),  # ':' separates job keys
    ("changelist_id", "a...b", "changelist_id"),  # Dagster refuses '...' in partition keys
    ("review_version", 0, "review_version"),
    ("review_version", "three", "review_version"),
    ("recipients", [], "recipients"),
    ("recipients", ["not-an-address"], "recipients"),
    ("idempotency_key", "", "idempotency_key"),
    ("idempotency_key", " padded", "idempotency_key"),
])
def test_bad_request_is_one_canonical_line_naming_the_field(field: str, value: object, named: str) -> None:
    """Bad input is refused with INVALID_REQUEST and the field's name, never the submitted value."""
    with pytest.raises(policy.InvalidRequest) as raised:
        policy.parse_request({**REQUEST, field: value})
    text = str(raised.value)
    assert text.startswith("INVALID_REQUEST: ") and named in text and "\n" not in text
    assert "not-an-address" not in text


def test_unknown_field_is_refused() -> None:
    """A typo in a request field is an error, not silently ignored (extra="forbid")."""
    with pytest.raises(policy.InvalidRequest, match="recipient"):
        policy.parse_request({**REQUEST, "recipient": "x@example.com"})


def test_request_digest_ignores_key_and_recipient_order() -> None:
    """Two requests asking for the same thing have one digest; a changed body has another."""
    a = policy.parse_request(REQUEST)
    b = policy.parse_request({**REQUEST, "idempotency_key": "other",
                              "recipients": list(reversed(REQUEST["recipients"]))})
    c = policy.parse_request({**REQUEST, "summary": "changed"})
    assert a.digest == b.digest != c.digest


# -------------------------------------------------------------------------------------- keys, payload


def test_provider_token_is_derived_from_the_outbox_tuple_only() -> None:
    """§10.3: same (changelist, recipient, version) → same token; any part changed → another token."""
    token = policy.provider_token("CL-1", "ana@example.com", 3)
    assert token == policy.provider_token("CL-1", " ANA@example.com", 3)
    assert token.startswith(policy.TOKEN_PREFIX)
    others = {policy.provider_token("CL-2", "ana@example.com", 3), policy.provider_token("CL-1", "bo@example.com", 3),
              policy.provider_token("CL-1", "ana@example.com", 4)}
    assert token not in others and len(others) == 3
    assert "ana" not in token  # the provider's logs do not learn the address from the token


def test_rendered_payload_is_deterministic() -> None:
    """A resend renders byte-identical subject and text (else the provider answers 409)."""
    assert policy.render("CL-1", 3, "Looks good") == policy.render("CL-1", 3, "Looks good")
    subject, text = policy.render("CL-1", 3, "Looks good")
    assert "CL-1" in subject and "v3" in subject and "Looks good" in text


@settings(suppress_health_check=[HealthCheck.too_slow])  # regex generation is slow on a loaded 2-core machine
@given(st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_/-]{0,20}", fullmatch=True), st.integers(1, 10**6),
       st.integers(1, 10**9))
def test_entity_refs_round_trip_to_their_job(changelist: str, version: int, delivery_id: int) -> None:
    """A recipient's work row and dead letter find their job, and a job ref is its own job."""
    key = policy.job_key(changelist, version)
    ref = policy.delivery_ref(key, delivery_id)
    assert policy.job_key_of(key) == key and policy.delivery_id_of(key) is None
    assert policy.job_key_of(ref) == key and policy.delivery_id_of(ref) == delivery_id


# -------------------------------------------------------------------------------------------- modes


@pytest.mark.parametrize(("requested", "latest", "existing", "mode"), [
    (3, None, None, Mode.CREATED),
    (4, 3, None, Mode.VERSIONED_RERUN),  # v3 → v4
    (3, 3, policy.SUCCEEDED, Mode.NOOP),  # v3 → v3 after success
    (3, 3, policy.IN_PROGRESS, Mode.EXISTING),
])
def test_processing_modes(requested: int, latest: int | None, existing: str | None, mode: Mode) -> None:
    """§6.2: first, versioned rerun, no-op for a succeeded version, join a running one."""
    assert policy.mode_for("CL-1", requested, latest=latest, existing_status=existing) is mode


@pytest.mark.parametrize("existing", [None, policy.SUCCEEDED])
def test_lower_version_is_refused_with_canonical_error(existing: str | None) -> None:
    """§6.2: v4 → v3 is refused, also when v3 has a job of its own."""
    with pytest.raises(VersionRegression) as raised:
        policy.mode_for("CL-1", 3, latest=4, existing_status=existing)
    assert str(raised.value).startswith("REVIEW_VERSION_REGRESSION: changelist CL-1 is already at review_version 4")


# ----------------------------------------------------------------------------------- §6.4 row rules


@pytest.mark.parametrize(("status", "nid", "notified", "attempts", "action"), [
    ("pending", None, None, 0, Action.SEND),  # nothing recorded: safe to send
    ("sent", "msg_1", NOW, 1, Action.SKIP),  # notified_at set: never again
    ("sending", None, None, 1, Action.LOOKUP_FIRST),  # crashed after starting a send
    ("pending", "msg_1", None, 1, Action.LOOKUP_FIRST),  # id without notified_at: "send may have happened"
    ("pending", None, None, 2, Action.LOOKUP_FIRST),  # an earlier attempt reached the provider's door
    ("failed", None, None, 1, Action.SKIP),
    ("waived", None, None, 0, Action.SKIP),
    ("superseded", None, None, 0, Action.SKIP),
])
def test_next_action_follows_the_re_read_rules(status, nid, notified, attempts, action) -> None:
    """§6.4: re-read first; notified → skip; id without notified_at → lookup before resend; else send."""
    assert policy.next_action(policy.DeliveryState(status, nid, notified, attempts)) is action


def test_judging_a_row_marked_sent() -> None:
    """§8.3: provider evidence verifies a row; none at all is the reconciliation case."""
    assert policy.judge_sent_row("msg_1", "msg_1") is Evidence.VERIFIED
    assert policy.judge_sent_row("msg_bogus", "msg_1") is Evidence.REPAIR_ID
    assert policy.judge_sent_row(None, "msg_1") is Evidence.REPAIR_ID
    assert policy.judge_sent_row("msg_1", None) is Evidence.NONE


# ------------------------------------------------------------------------------------ §6.5 finalize


@pytest.mark.parametrize(("counts", "gave_up", "status"), [
    ({"sent": 3}, False, policy.SUCCEEDED),
    ({"sent": 2, "waived": 1}, False, policy.SUCCEEDED),  # a waived recipient is not required
    ({"sent": 2, "pending": 1}, False, policy.IN_PROGRESS),
    ({"sent": 2, "sending": 1}, True, policy.RETRYABLE_FAILED),
    ({"sent": 2, "failed": 1}, False, policy.RETRYABLE_FAILED),  # waits for an operator
    ({"superseded": 2}, False, policy.SUCCEEDED),
])
def test_finalization(counts: dict[str, int], gave_up: bool, status: str) -> None:
    """§6.5: succeeded only when every required recipient has notified_at."""
    outcome = policy.finalize(counts, gave_up=gave_up)
    assert outcome.status == status
    assert outcome.required == sum(counts.values()) - counts.get("waived", 0) - counts.get("superseded", 0)


# --------------------------------------------------------------------------------------- failures


def _http_error(status: int, body: dict, headers: dict | None = None) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://mail.test/v1/messages")
    response = httpx.Response(status, json=body, headers=headers or {}, request=request)
    return httpx.HTTPStatusError(f"HTTP {status}", request=request, response=response)


@pytest.mark.parametrize(("status", "code", "name", "retryable", "where"), [
    (422, "INVALID_RECIPIENT", "INVALID_RECIPIENT", False, policy.RECIPIENT),
    (422, "content_policy_violation", "POLICY_REJECTED", False, policy.RECIPIENT),
    (409, "IDEMPOTENCY_TOKEN_REUSED", "IDEMPOTENCY_TOKEN_REUSED", False, policy.JOB),
    (401, "HTTP_401", "PROVIDER_AUTH_DENIED", False, policy.JOB),
    (500, "HTTP_500", "PROVIDER_ERROR", True, policy.TRANSIENT),
    (503, "HTTP_503", "PROVIDER_UNAVAILABLE", True, policy.TRANSIENT),
    (429, "HTTP_429", "PROVIDER_RATE_LIMITED", True, policy.TRANSIENT),
])
def test_provider_answers_are_named_and_scoped(status, code, name, retryable, where) -> None:
    """§8.1: the sandbox's error envelopes → transient (retry), recipient (row fails), or job."""
    failure = policy.NOTIFICATION.apply(classify_exception(_http_error(status, {"error": {"code": code}})))
    assert (failure.code, failure.retryable, policy.scope(failure)) == (name, retryable, where)


def test_transport_failures_are_transient() -> None:
    """A timeout or a dropped connection is retried (the next attempt looks up before resending)."""
    for exc in (httpx.ReadTimeout("slow"), httpx.RemoteProtocolError("peer closed")):
        failure = policy.NOTIFICATION.apply(classify_exception(exc))
        assert failure.retryable and policy.scope(failure) == policy.TRANSIENT
