"""Issue 13 item 1: cards, IBANs, SSNs, bare phone numbers and name/value secrets are redacted, with keyed markers."""

from __future__ import annotations

import hashlib
import json
import re
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redrive.sanitize import configure_redaction_key, iban_ok, luhn_ok, marker, sanitize_context, sanitize_text

MARKER = re.compile(r"\[REDACTED:([a-z0-9_]+):hmac=[0-9a-f]{12}\]")

# (text, the value that must go, the marker kind, context that must stay)
PII = [
    ("card 4111 1111 1111 1111 on file", "4111 1111 1111 1111", "card", "on file"),
    ("card 4111-1111-1111-1111 on file", "4111-1111-1111-1111", "card", "on file"),
    ("card=4111111111111111&x=1", "4111111111111111", "card", "&x=1"),
    ("mastercard 5555555555554444.", "5555555555554444", "card", "mastercard"),
    ("amex 3782 822463 10005 ok", "3782 822463 10005", "card", "amex"),
    ("visa19 4111111111111111110 ok", "4111111111111111110", "card", "visa19"),
    ("iban GB82 WEST 1234 5698 7654 32 paid", "GB82 WEST 1234 5698 7654 32", "iban", "paid"),
    ("iban DE89370400440532013000 paid", "DE89370400440532013000", "iban", "paid"),
    ("to FR1420041010050500013M02606 now", "FR1420041010050500013M02606", "iban", "now"),
    ("ssn 123-45-6789 on form", "123-45-6789", "ssn", "on form"),
    ("ssn 123 45 6789 on form", "123 45 6789", "ssn", "on form"),
    ("phone 4155550132 ok", "4155550132", "phone", "ok"),
    ("call me at 4155550132.", "4155550132", "phone", "call me at"),
    ("tel:+14155550132", "+14155550132", "phone", "tel:"),
    ('{"mobile": "07911123456"}', "07911123456", "phone", "mobile"),
    ("e164 +14155550132 end", "4155550132", "phone", "end"),
    ('{"name": "X-Api-Key", "value": "k3y-v4lue"}', "k3y-v4lue", "secret", "X-Api-Key"),
    ("{'value': 'k3y-v4lue', 'name': 'Authorization'}", "k3y-v4lue", "secret", "Authorization"),
    ('[{"key": "client_secret", "value": "s3cr3t!"}]', "s3cr3t!", "secret", "client_secret"),
    ("headers=[('X-Api-Key', 'k3y-v4lue'), ('Accept', 'text/plain')]", "k3y-v4lue", "secret", "text/plain"),
    ('[["X-Auth-Token", "tok-123456"]]', "tok-123456", "secret", "X-Auth-Token"),
]


@pytest.mark.parametrize(("text", "gone", "kind", "kept"), PII, ids=[p[0][:24] for p in PII])
def test_pii_and_named_secrets_disappear(text: str, gone: str, kind: str, kept: str) -> None:
    """Each PII shape or name/value secret becomes a marker of its kind; the context survives."""
    out = sanitize_text(text)
    assert gone not in out
    assert kept in out
    assert kind in MARKER.findall(out)


KEPT = [
    "card 4111 1111 1111 1112 fails Luhn",  # one digit off
    "epoch millis 1763897405123 and 1700000000000",
    "document 4815162342 matched 12 of 1234567",  # a bare 10-digit id is not a phone without a phone word
    "iban GB82 WEST 1234 5698 7654 33 bad check",
    "ssn-like 000-12-3456 and 666-12-3456 and 900-12-3456 are never issued",
    "date 2026-11-23 version 2024.01.15 port 5432",
    '{"name": "Accept", "value": "application/json"}',
    "header names ['authorization', 'x-api-key'] were sent",  # a list of names, not a pair
    "[('authorization', 'x-api-key')]",
    "order 5500-0000-0000-0005 x",  # 16 digits, Mastercard range, Luhn fails
    "uuid 123e4567-e89b-12d3-a456-426614174000",
]


@pytest.mark.parametrize("text", KEPT)
def test_lookalikes_are_left_alone(text: str) -> None:
    """Numbers that fail the card, IBAN or SSN checks, and non-secret name/value pairs, stay readable."""
    assert sanitize_text(text) == text


def _luhn_complete(body: str) -> str:
    for check in string.digits:
        if luhn_ok(body + check):
            return body + check
    raise AssertionError("unreachable")


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from("23456"),
    st.text(alphabet=string.digits, min_size=12, max_size=14),
    st.sampled_from(["", " ", "-"]),
    st.sampled_from(["paid with ", "card: ", "(", "charge "]),
)
def test_any_valid_card_in_any_grouping_never_survives(first: str, body: str, sep: str, before: str) -> None:
    """A Luhn-valid 14-16 digit card number, bare or in groups of four, is always redacted."""
    number = _luhn_complete(first + body)
    grouped = sep.join(number[i : i + 4] for i in range(0, len(number), 4)) if sep else number
    out = sanitize_text(f"{before}{grouped} thanks")
    assert grouped not in out and number not in out.replace(" ", "").replace("-", "")


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=string.digits, min_size=11, max_size=30))
def test_iban_check_matches_iso_13616(bban: str) -> None:
    """An IBAN built with the ISO check digits passes `iban_ok` and is redacted; a changed check digit fails."""
    check = 98 - int("".join(str(int(c, 36)) for c in bban + "DE00")) % 97
    iban = f"DE{check:02d}{bban}"
    assert iban_ok(iban)
    assert iban not in sanitize_text(f"pay to {iban} today")
    wrong = f"DE{(check + 1) % 100:02d}{bban}"
    assert not iban_ok(wrong)


def test_context_name_value_pairs_and_header_lists_lose_their_values() -> None:
    """In a dead-letter context, `{"name", "value"}` headers and ("Name", value) pairs keep the name only."""
    context = {
        "headers": [{"name": "X-Api-Key", "value": "k3y-v4lue"}, {"name": "Accept", "value": "application/json"}],
        "raw_headers": [["Authorization", "Bearer abc"], ["Accept", "text/plain"]],
        "phone_number": "4155550132",
        "iban": "DE89370400440532013000",
        "body_json": json.dumps({"name": "X-Api-Key", "value": "k3y-v4lue"}),
    }
    out = sanitize_context(context)
    flat = json.dumps(out)
    for gone in ("k3y-v4lue", "Bearer abc", "4155550132", "DE89370400440532013000"):
        assert gone not in flat
    assert out["headers"][1] == {"name": "Accept", "value": "application/json"}
    assert out["raw_headers"][1] == ["Accept", "text/plain"]
    assert out["headers"][0]["name"] == "X-Api-Key"
    assert sanitize_context({"webhook_header_names": ["authorization", "x-api-key"]}) == {
        "webhook_header_names": ["authorization", "x-api-key"]}  # names only: nothing to redact


def test_markers_are_keyed_so_a_phone_number_cannot_be_guessed_back() -> None:
    """The marker of a phone number is not its plain SHA-256, and it changes with the key."""
    phone = "4155550132"
    try:
        configure_redaction_key(b"key-one")
        one = marker("phone", phone)
        configure_redaction_key(b"key-two")
        two = marker("phone", phone)
    finally:
        configure_redaction_key(None)
    plain = hashlib.sha256(phone.encode()).hexdigest()[:12]
    assert plain not in one and plain not in two
    assert one != two
    assert marker("phone", phone) == marker("phone", phone)  # stable under one key: still a correlation aid


def test_a_remembered_text_is_redacted_again_under_a_new_key() -> None:
    """Short texts' results are remembered (a log line's fields repeat); a new key still gives the new key's marker,
    never the one remembered from the old key."""
    text = "call me on 4155550132"
    try:
        configure_redaction_key(b"key-one")
        one = sanitize_text(text)
        assert sanitize_text(text) == one  # remembered
        configure_redaction_key(b"key-two")
        two = sanitize_text(text)
    finally:
        configure_redaction_key(None)
    assert "4155550132" not in one and "4155550132" not in two
    assert one != two and two == text.replace("4155550132", marker_under(b"key-two", "phone", "4155550132"))


def marker_under(key: bytes, kind: str, value: str) -> str:
    import hmac

    return f"[REDACTED:{kind}:hmac={hmac.new(key, value.encode(), hashlib.sha256).hexdigest()[:12]}]"


def test_the_key_comes_from_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    """REDRIVE_REDACTION_KEY sets the key; markers follow it."""
    import hmac

    monkeypatch.setenv("REDRIVE_REDACTION_KEY", "configured-key")
    configure_redaction_key(None)
    try:
        expected = hmac.new(b"configured-key", b"4155550132", hashlib.sha256).hexdigest()[:12]
        assert marker("phone", "4155550132") == f"[REDACTED:phone:hmac={expected}]"
    finally:
        monkeypatch.delenv("REDRIVE_REDACTION_KEY")
        configure_redaction_key(None)
