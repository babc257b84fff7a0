"""The 002 §8.4 sanitizer: secrets and PII never leave in text, contexts, stacks or logs."""

from __future__ import annotations

import logging
import re
import string

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from redrive.sanitize import (
    TEXT_HASH_THRESHOLD,
    SanitizingFilter,
    digest,
    install_log_sanitizer,
    is_secret_key,
    marker,
    sanitize_context,
    sanitize_exception,
    sanitize_text,
    truncate,
)

MARKER = re.compile(r"\[REDACTED:[a-z0-9_]+:hmac=[0-9a-f]{12}\]")

# (text containing a canary, the canary that must disappear, text that must stay)
CANARIES = [
    ("openai key sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t in config", "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t", "openai key"),
    ("anthropic sk-ant-api03-AAAABBBBCCCCDDDDEEEE", "sk-ant-api03-AAAABBBBCCCCDDDDEEEE", "anthropic"),
    ("stripe sk_live_51HxyzABCDEFGHIJKLMN", "sk_live_51HxyzABCDEFGHIJKLMN", "stripe"),
    ("slack bot xoxb-123456789012-1234567890123-AbCdEfGhIjKl", "xoxb-123456789012-1234567890123-AbCdEfGhIjKl", "slack bot"),
    ("user token xoxp-1111111111-2222222222-abcdef", "xoxp-1111111111-2222222222-abcdef", "user token"),
    ("aws key AKIAIOSFODNN7EXAMPLE used", "AKIAIOSFODNN7EXAMPLE", "aws key"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "aws_secret_access_key"),
    ("GET /v1?api_key=abc123def456&page=2", "abc123def456", "page=2"),
    ("curl -H 'x-api-key: k3y-v4lu3-zz'", "k3y-v4lu3-zz", "curl -H"),
    ("Authorization: Bearer abc.def-ghi_jkl~123", "abc.def-ghi_jkl~123", "Authorization: Bearer"),
    ("sent with bearer 0123456789abcdefXYZ", "0123456789abcdefXYZ", "sent with"),
    ("headers {'Authorization': 'Basic dXNlcjpodW50ZXIy'}", "dXNlcjpodW50ZXIy", "headers"),
    ("password=hunter2 and more", "hunter2", "and more"),
    ('{"user": "bob", "password": "correct horse battery"}', "correct horse battery", '"user": "bob"'),
    ("pwd=s3cr3t;", "s3cr3t", ";"),
    ("client_secret: 'qwertyuiop'", "qwertyuiop", "client_secret"),
    ("postgresql://app:Sup3r$ecret@db.internal:5432/redrive", "Sup3r$ecret", "@db.internal:5432/redrive"),
    ("redis://:r3d1spass@cache:6379/0", "r3d1spass", "@cache:6379/0"),
    ("contact jane.doe+ops@example.co.uk today", "jane.doe+ops@example.co.uk", "today"),
    ("call +1 (415) 555-0132 now", "(415) 555-0132", "now"),
    ("ring +44 20 7946 0958 please", "20 7946 0958", "please"),
    ("e164 +4915112345678 end", "4915112345678", "end"),
    ("us 415-555-0132 end", "415-555-0132", "end"),
    ("paren (415) 555-0132 end", "555-0132", "end"),
    (
        "jwt eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
        "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c",
        "jwt",
    ),
    ("webhook https://hooks.slack.com/services/T0001/B0002/XXXXyyyyZZZZ", "XXXXyyyyZZZZ", "https://hooks.slack.com/services/"),
    ("s3 ?X-Amz-Signature=deadbeef00&X-Amz-Security-Token=FwoGZXIvYXdz", "FwoGZXIvYXdz", "s3 ?X-Amz-Signature="),
    ("gh ghp_abcdefghijklmnopqrstuvwxyz0123456789 x", "ghp_abcdefghijklmnopqrstuvwxyz0123456789", "gh"),
]


@pytest.mark.parametrize(("text", "canary", "kept"), CANARIES, ids=[c[1][:16] for c in CANARIES])
def test_canary_disappears(text: str, canary: str, kept: str) -> None:
    """Each secret or PII shape is replaced by a marker; the surrounding context survives."""
    out = sanitize_text(text)
    assert canary not in out
    assert kept in out
    assert MARKER.search(out)


def test_marker_carries_a_stable_short_hash() -> None:
    """The same value always gets the same marker, so operators can correlate without seeing it."""
    a = sanitize_text("mail jane@example.com")
    b = sanitize_text("again jane@example.com!")
    expected = f"[REDACTED:email:hmac={digest('jane@example.com')}]"
    assert expected in a and expected in b
    assert len(digest("x")) == 12 and marker("email", "x") == f"[REDACTED:email:hmac={digest('x')}]"


@pytest.mark.parametrize(
    "text",
    [
        "job 123e4567-e89b-12d3-a456-426614174000 failed",
        "at 2026-02-26T10:30:00+00:00 and 2026-02-26 10:30:00.123456+01:00",
        "listening on 0.0.0.0:5432, pid 31337, port 8080",
        "attempt 3 of 5, delay 120.5s, status 503",
        "document 4815162342 matched 12 of 1234567",
        "ip 192.168.100.200 version 1.2.3 build 2024.01.15",
        "max_tokens=256 prompt_tokens: 1200 token_count=3 idempotency_key=2026-02-26:UTC:42",
        "s3://bucket/evidence/2026/02/26/file_job_42.pdf",
        "Authorization header missing",
        "timezone +05:30 offset, +0000 zone",
        "version +1.2.3",
        "price 1,234,567.89 EUR",
        "",
    ],
)
def test_ordinary_text_is_left_intact(text: str) -> None:
    """Ids, UUIDs, ISO timestamps, ports, counters and plain numbers are not mistaken for secrets."""
    assert sanitize_text(text) == text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200))
def test_sanitize_text_is_idempotent(text: str) -> None:
    """Sanitizing an already sanitized text changes nothing."""
    once = sanitize_text(text)
    assert sanitize_text(once) == once


secret_chars = string.ascii_letters + string.digits + "-._~+/"
secrets = st.text(alphabet=secret_chars, min_size=10, max_size=40).filter(lambda s: any(c.isalnum() for c in s))
prose = st.text(alphabet=string.ascii_letters + " ,.:;!?()\n", max_size=40)


@settings(max_examples=200, deadline=None)
@given(prose, secrets, prose)
def test_bearer_token_never_survives(before: str, token: str, after: str) -> None:
    """Any token after 'Bearer ' is gone from the output."""
    assume(token not in before and token not in after)
    out = sanitize_text(f"{before} Bearer {token} {after}")
    assert token not in out


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet=string.ascii_letters + string.digits, min_size=1, max_size=12),
    st.text(alphabet=string.ascii_letters + string.digits + "!$%^*()_-+=~", min_size=6, max_size=30),
    st.sampled_from(["postgresql", "postgres", "redis", "amqp", "https", "mysql+pymysql"]),
    prose,
)
def test_url_password_never_survives(user: str, password: str, scheme: str, after: str) -> None:
    """The password of scheme://user:password@host is gone; the user and host remain."""
    assume(password not in user and password not in after and password not in "connect db.example.internal:5432/app")
    out = sanitize_text(f"connect {scheme}://{user}:{password}@db.example.internal:5432/app {after}")
    assert f":{password}@" not in out
    assert password not in out.split("@", 1)[0].split("://", 1)[1]
    assert "@db.example.internal:5432/app" in out


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet=string.ascii_lowercase + string.digits + "._+-", min_size=1, max_size=20).filter(
        lambda s: s[0].isalnum()
    ),
    st.text(alphabet=string.ascii_lowercase + string.digits, min_size=1, max_size=12),
    st.sampled_from(["com", "org", "co.uk", "example", "io"]),
    prose,
    prose,
)
def test_email_never_survives(local: str, domain: str, tld: str, before: str, after: str) -> None:
    """A planted email address is gone from the output, whatever prose surrounds it."""
    email = f"{local}@{domain}.{tld}"
    out = sanitize_text(f"{before} {email} {after}")
    assert email not in out


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["password", "api_key", "client_secret", "refresh_token", "X-Amz-Signature"]), secrets, prose)
def test_secret_assignments_never_survive(key: str, value: str, after: str) -> None:
    """key=value and "key": "value" for secret-named keys lose the value."""
    assume(value not in after and value not in key)
    for text in (f"{key}={value} {after}", f'{{"{key}": "{value}"}}', f"{key}: '{value}'"):
        assert value not in sanitize_text(text)


# -------------------------------------------------------------------------------------- structures


def test_sanitize_context_redacts_secret_keys_and_hashes_prompts() -> None:
    """Secret-named keys lose their value, long prompts become length+hash, ids and counts stay."""
    prompt = "Summarise the attached contract for Jane. " * 20
    context = {
        "request_id": "req-8f2c",
        "stage": "llm",
        "attempt": 3,
        "upstream_status": 429,
        "Authorization": "Bearer sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t",
        "headers": {"X-Api-Key": "abc", "Set-Cookie": "session=xyz", "Content-Type": "application/json"},
        "credentials": {"user": "u", "pass": "p"},
        "prompt": prompt,
        "messages": [{"role": "user", "content": prompt}, {"role": "system", "content": "short"}],
        "note": "reply to jane@example.com",
        "max_tokens": 512,
        "idempotency_key": "cl-42:bob:v3",
        "session_id": "s-123",
    }
    out = sanitize_context(context)
    flat = repr(out)
    for gone in ("sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8t", "abc'", "session=xyz", "'p'", "Summarise", "jane@example.com", "s-123"):
        assert gone not in flat
    assert out["request_id"] == "req-8f2c" and out["attempt"] == 3 and out["upstream_status"] == 429
    assert out["max_tokens"] == 512 and out["idempotency_key"] == "cl-42:bob:v3"
    assert out["headers"]["Content-Type"] == "application/json"
    assert out["Authorization"].startswith("[REDACTED:authorization:hmac=")
    assert out["prompt"] == f"[TEXT len={len(prompt)} hmac={digest(prompt)}]"
    assert out["messages"][0]["content"].startswith("[TEXT len=")
    assert out["messages"][1]["content"] == "short"


def test_sanitize_context_truncates_long_strings() -> None:
    """A long ordinary string is cut, saying how much was dropped."""
    out = sanitize_context({"error": "x" * 5000})
    assert len(out["error"]) < 1100 and out["error"].endswith("[truncated 3976 chars]")


def test_truncate_never_splits_a_marker() -> None:
    """Truncation backs off to before a marker rather than cutting it in half."""
    text = "a" * 1000 + marker("email", "x") + "b" * 100
    out = truncate(text, 1010)
    assert out.startswith("a" * 1000 + "…[truncated")


def test_sanitize_context_handles_bytes_sets_and_objects() -> None:
    """Bytes become length+hash, sets become sorted lists, other objects their sanitized str."""
    class Opaque:
        def __str__(self) -> str:
            return "opaque for ops@example.com"

    out = sanitize_context({"raw": b"\x00secret", "tags": {"b", "a"}, "when": Opaque()})
    assert out["raw"].startswith("[BYTES len=7 hmac=")
    assert out["tags"] == ["a", "b"]
    assert out["when"].startswith("opaque for [REDACTED:email:hmac=")


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("authorization", True), ("Proxy-Authorization", True), ("token", True), ("access_token", True),
        ("secret", True), ("client_secret", True), ("password", True), ("db_password", True), ("api_key", True),
        ("apikey", True), ("x-api-key", True), ("cookie", True), ("set-cookie", True), ("credentials", True),
        ("private_key", True), ("session", True), ("session_id", True), ("aws_secret_access_key", True),
        ("max_tokens", False), ("prompt_tokens", False), ("token_count", False), ("idempotency_key", False),
        ("request_id", False), ("stage", False), ("key", False),
    ],
)
def test_is_secret_key_table(key: str, secret: bool) -> None:
    """Key names that hold secrets are recognised; counters and identifiers are not."""
    assert is_secret_key(key) is secret


# -------------------------------------------------------------------------------------- exceptions


def _fail_with_canary() -> None:
    api_key = "sk-proj-CANARYcanary1234567890"
    raise RuntimeError(f"provider refused key {api_key} for ops@example.com")


def test_sanitize_exception_removes_canary_keeps_type_and_frames() -> None:
    """A stack whose message holds a key and an email keeps its frames and type, not the secrets."""
    try:
        try:
            _fail_with_canary()
        except RuntimeError as inner:
            raise LookupError("stage llm failed") from inner
    except LookupError as exc:
        stack = sanitize_exception(exc)
    assert "sk-proj-CANARYcanary1234567890" not in stack
    assert "ops@example.com" not in stack
    assert "RuntimeError: provider refused key [REDACTED:api_key:hmac=" in stack
    assert "LookupError: stage llm failed" in stack
    assert "in _fail_with_canary" in stack and 'File "' in stack
    assert "The above exception was the direct cause" in stack


def test_sanitize_exception_keeps_the_newest_part_when_long() -> None:
    """An oversized stack is cut from the front, keeping the final exception line."""
    try:
        raise ValueError("x" * 50_000)
    except ValueError as exc:
        stack = sanitize_exception(exc, limit=1000)
    assert len(stack) < 1100 and stack.startswith("…[truncated")


# --------------------------------------------------------------------------------------------- logs


def test_log_filter_removes_canary_from_real_logger_output(caplog: pytest.LogCaptureFixture) -> None:
    """A canary passed as a log argument and in a logged exception never reaches the captured output."""
    logger = logging.getLogger("redrive.tests.sanitize")
    log_filter = install_log_sanitizer(logger)
    try:
        with caplog.at_level(logging.INFO, logger="redrive.tests.sanitize"):
            logger.info("calling provider with key %s for %s", "sk-proj-CANARYcanary1234567890", "ops@example.com")
            try:
                _fail_with_canary()
            except RuntimeError:
                logger.exception("send failed")
        output = caplog.text + "".join(r.getMessage() for r in caplog.records)
        assert "sk-proj-CANARYcanary1234567890" not in output
        assert "ops@example.com" not in output
        assert "calling provider with key [REDACTED:api_key:hmac=" in output
        assert "RuntimeError: provider refused key [REDACTED:api_key" in caplog.text
        assert "in _fail_with_canary" in caplog.text
    finally:
        logger.removeFilter(log_filter)


def test_handler_filter_covers_records_from_child_loggers(caplog: pytest.LogCaptureFixture) -> None:
    """A filter on the handler redacts records that propagate from child loggers."""
    caplog.handler.addFilter(SanitizingFilter())
    with caplog.at_level(logging.INFO):
        logging.getLogger("redrive.some.child").warning("token=%s", "tok_CANARY_999")
    assert "tok_CANARY_999" not in caplog.text
    assert "token=[REDACTED:secret:hmac=" in caplog.text


def test_filter_is_safe_to_apply_twice() -> None:
    """Running the filter on an already filtered record leaves it as it was."""
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "key %s", ("sk-proj-CANARYcanary1234567890",), None)
    SanitizingFilter().filter(record)
    first = record.getMessage()
    SanitizingFilter().filter(record)
    assert record.getMessage() == first and record.args is None


def test_install_twice_adds_one_filter() -> None:
    """install_log_sanitizer is idempotent on a logger."""
    logger = logging.getLogger("redrive.tests.install-twice")
    a = install_log_sanitizer(logger)
    b = install_log_sanitizer(logger)
    try:
        assert a is b and sum(isinstance(f, SanitizingFilter) for f in logger.filters) == 1
    finally:
        logger.removeFilter(a)


def test_text_hash_threshold_is_exclusive() -> None:
    """A prompt of exactly the threshold length is kept (sanitized); one char more is hashed."""
    assert sanitize_context({"prompt": "a" * TEXT_HASH_THRESHOLD})["prompt"] == "a" * TEXT_HASH_THRESHOLD
    assert sanitize_context({"prompt": "a" * (TEXT_HASH_THRESHOLD + 1)})["prompt"].startswith("[TEXT len=257")
