"""Redaction of secrets and PII before text leaves the process (002 §8.4).

Dead-letter payloads, ``last_stack``, ``matching_error`` columns, Slack alerts and logs all pass
through here. Each removed value becomes a stable marker carrying a short keyed hash of the value,
``[REDACTED:email:hmac=1a2b3c4d5e6f]``, so an operator can tell "the same key failed twice"
without ever seeing the key.

The hash is an HMAC-SHA-256 under the install's redaction key (:mod:`redrive.keys`), so a
guessable value (a phone number, a card number, a common password) cannot be recovered by
hashing candidates: that takes the key. It is a correlation aid, not encryption.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import re
import secrets
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date, datetime
from enum import Enum
from typing import Any
from uuid import UUID

__all__ = [
    "MAX_CONTEXT_STRING",
    "MAX_STACK_CHARS",
    "TEXT_HASH_THRESHOLD",
    "SanitizingFilter",
    "configure_redaction_key",
    "digest",
    "install_log_sanitizer",
    "iban_ok",
    "is_pii_key",
    "is_secret_key",
    "is_text_key",
    "luhn_ok",
    "marker",
    "sanitize_context",
    "sanitize_exception",
    "sanitize_text",
    "truncate",
]

TEXT_HASH_THRESHOLD = 256
"""Prompt/body-like values longer than this are replaced by their length and hash (002 §8.4: no full prompts)."""
MAX_CONTEXT_STRING = 1024
"""Any other string in a sanitized context is cut to this many characters."""
MAX_STACK_CHARS = 20_000
"""A sanitized stack keeps at most this many characters, from the end (the newest frames)."""
_MAX_DEPTH = 20


_KEY: list[bytes] = []  # the redaction key, loaded on first use (never at import time)


def configure_redaction_key(key: bytes | None) -> None:
    """Use ``key`` for markers from now on; None forgets it, so the next marker reloads the configured one."""
    _KEY.clear()
    _sanitized_short.cache_clear()  # its markers were hashed under the old key
    if key is not None:
        _KEY.append(key)


def _redaction_key() -> bytes:
    if not _KEY:
        from redrive.keys import redaction_key  # keys reads settings; sanitize stays importable anywhere

        try:
            _KEY.append(redaction_key())
        except OSError:  # no writable data dir: a process-local key still hides values, correlation stays in-process
            _KEY.append(secrets.token_bytes(32))
    return _KEY[0]


def digest(value: object) -> str:
    """First 12 hex digits of the HMAC-SHA-256 of ``value`` under the redaction key (str as UTF-8,
    bytes as is, else ``repr``)."""
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
    else:
        data = repr(value).encode("utf-8", "surrogatepass")
    return hmac.new(_redaction_key(), data, hashlib.sha256).hexdigest()[:12]


def _kind(name: str) -> str:
    return (re.sub(r"[^a-z0-9_]+", "_", name.lower()).strip("_") or "value")[:32]


def marker(kind: str, value: object) -> str:
    """The text that stands in for a redacted value: its kind and a short hash, never the value."""
    return f"[REDACTED:{_kind(kind)}:hmac={digest(value)}]"


# Anything the sanitizer itself wrote. Text is split on these so no pattern ever looks inside one.
# Markers written before the hash was keyed (``sha256=``) are recognised too, so stored text stays stable.
_MARKER = re.compile(
    r"\[REDACTED:[a-z0-9_]{1,32}:(?:hmac|sha256)=[0-9a-f]{12}\]"
    r"|\[TEXT len=\d+ (?:hmac|sha256)=[0-9a-f]{12}\]"
    r"|\[BYTES len=\d+ (?:hmac|sha256)=[0-9a-f]{12}\]"
)


@dataclass(frozen=True)
class _Rule:
    """One secret shape: the regex, the marker kind, and which group holds the secret (default: all)."""

    kind: str
    pattern: re.Pattern[str]
    group: str | None = None
    accept: Callable[[str], bool] | None = None  # extra check on the secret text
    accept_match: Callable[[re.Match[str]], bool] | None = None  # extra check on the whole match


def _digits_between(low: int, high: int) -> Callable[[str], bool]:
    return lambda text: low <= sum(ch.isdigit() for ch in text) <= high


def luhn_ok(digits: str) -> bool:
    """The Luhn check digit of a payment card number holds (ISO/IEC 7812-1)."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = int(ch)
        if i % 2:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _card(text: str) -> bool:
    """13-19 digits, an issuer range (2-6: Mastercard, Amex/Diners/JCB, Visa, Mastercard, Discover/UnionPay)
    and a valid Luhn digit: an epoch-millisecond timestamp (1…) or a random id rarely passes all three."""
    digits = "".join(ch for ch in text if ch.isdigit())
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and luhn_ok(digits)


def iban_ok(text: str) -> bool:
    """ISO 13616 IBAN: 15-34 characters whose mod-97 check (country and check digits moved to the end) is 1."""
    compact = "".join(text.split()).upper()
    if not 15 <= len(compact) <= 34 or not compact.isalnum():
        return False
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1


def _named_secret(match: re.Match[str]) -> bool:
    value = match.group("dq") if match.group("dq") is not None else match.group("sq")
    return is_secret_key(match.group("n")) and not (value and _HEADER_NAME.fullmatch(value) and is_secret_key(value))


_HEADER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


# Keys whose value is a secret, as they appear in text: `password=…`, `"api_key": "…"`, `X-Amz-Signature=…`.
# The key must END with the secret word, so `max_tokens=256` and `token_count: 3` stay readable.
_SECRET_KEY_TEXT = (
    r"[A-Za-z0-9_.-]*?(?:passw(?:or)?d|pwd|secret|token|api[_-]?key|apikey|access[_-]?key|secret[_-]?key"
    r"|private[_-]?key|signing[_-]?key|credentials?|signature|session[_-]?id|cookie)"
)

# Order matters a little: structured shapes (URLs, headers) first, so their context survives and the
# redacted part is exactly the secret; loose shapes (emails, phones) last.
_RULES: tuple[_Rule, ...] = (
    # scheme://user:password@host  ->  keep scheme, user and host; the password goes.
    _Rule(
        "password",
        re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]{1,20}://[^\s:/?#@\[\]]*:(?P<v>[^\s@/?#\[\]]+)@"),
        "v",
    ),
    # Slack incoming-webhook URLs are bearer credentials in their path (000 keeps one in config).
    _Rule("slack_webhook", re.compile(r"hooks\.slack\.com/(?:services|workflows|triggers)/(?P<v>[A-Za-z0-9/_-]+)"), "v"),
    # Authorization / Proxy-Authorization header values, keeping the scheme word for triage.
    _Rule(
        "authorization",
        re.compile(
            r"(?i)\b(?:proxy-)?authorization[\"']?\s*[:=]\s*[\"']?"
            r"(?:(?:bearer|basic|token|digest|negotiate|aws4-hmac-sha256)\s+)?"
            r"(?!(?:bearer|basic|token|digest|negotiate|aws4-hmac-sha256)(?:\s|$))"  # a scheme word alone
            r"(?P<v>[^\s\"',;]+(?:,\s*[A-Za-z]+=[^\s\"',;]+)*)"
        ),
        "v",
    ),
    _Rule("bearer", re.compile(r"(?i)\b(?:bearer|basic)\s+(?P<v>[A-Za-z0-9._~+/=-]{8,})"), "v"),
    # JSON Web Tokens: three base64url segments, the header always starts with `eyJ` ('{"').
    _Rule("jwt", re.compile(r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*")),
    # `key: "value"` / `key=value` where the key names a secret.
    _Rule(
        "secret",
        re.compile(
            r"(?i)(?<![A-Za-z0-9_.-])[\"']?" + _SECRET_KEY_TEXT + r"[\"']?\s*[:=]\s*"
            r"(?:\"(?P<dq>[^\"\r\n]+)\"|'(?P<sq>[^'\r\n]+)'|(?P<v>[^\s\"'&,;)}\]]+))"
        ),
        "dq|sq|v",
    ),
    # A secret given as a name/value pair: `{"name": "X-Api-Key", "value": "…"}` (JSON or Python repr,
    # either order) and `("X-Api-Key", "…")` inside a list of headers (a lone `["authorization", "x-api-key"]`
    # is a list of names, not a pair).
    _Rule(
        "secret",
        re.compile(
            r"(?i)[\"']?(?:name|key|header|field)[\"']?\s*[:=]\s*[\"'](?P<n>[A-Za-z0-9_.-]{1,64})[\"']\s*,\s*"
            r"[\"']?value[\"']?\s*[:=]\s*(?:\"(?P<dq>[^\"\r\n]*)\"|'(?P<sq>[^'\r\n]*)')"
        ),
        "dq|sq",
        accept_match=_named_secret,
    ),
    _Rule(
        "secret",
        re.compile(
            r"(?i)[\"']?value[\"']?\s*[:=]\s*(?:\"(?P<dq>[^\"\r\n]*)\"|'(?P<sq>[^'\r\n]*)')\s*,\s*"
            r"[\"']?(?:name|key|header|field)[\"']?\s*[:=]\s*[\"'](?P<n>[A-Za-z0-9_.-]{1,64})[\"']"
        ),
        "dq|sq",
        accept_match=_named_secret,
    ),
    _Rule(
        "secret",
        re.compile(
            r"(?<=[\[(,])\s*[\(\[]\s*[\"'](?P<n>[A-Za-z0-9_.-]{1,64})[\"']\s*,\s*"
            r"(?:b?\"(?P<dq>[^\"\r\n]*)\"|b?'(?P<sq>[^'\r\n]*)')\s*[\)\]]"
        ),
        "dq|sq",
        accept_match=_named_secret,
    ),
    # Well-known API key shapes, wherever they appear.
    _Rule("api_key", re.compile(r"\b(?:sk|pk|rk)-(?:[A-Za-z0-9]+-)*[A-Za-z0-9_-]{16,}")),
    _Rule("api_key", re.compile(r"\b(?:sk|pk|rk)_(?:live|test)_[A-Za-z0-9]{12,}")),
    _Rule("slack_token", re.compile(r"\bxox[abeoprs]-[A-Za-z0-9-]{10,}")),
    _Rule("aws_access_key", re.compile(r"\b(?:AKIA|ASIA|AROA|AIDA)[0-9A-Z]{16}\b")),
    _Rule("github_token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})")),
    _Rule("google_api_key", re.compile(r"\bAIza[0-9A-Za-z_-]{35}")),
    _Rule("private_key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)")),
    # Payment cards: 13-19 digits, bare or in groups split by spaces or dashes, checked (see `_card`).
    _Rule(
        "card",
        re.compile(r"(?<![\w.+-])(?:\d{13,19}|\d{4}(?:([ -])\d{2,7})(?:\1\d{1,7}){1,3})(?![\w-]?\d)"),
        accept=_card,
    ),
    # Bank accounts: IBAN, compact or in groups of four, with its mod-97 check.
    _Rule(
        "iban",
        re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b"),
        accept=iban_ok,
    ),
    # US social security numbers: AAA-GG-SSSS (or spaces), minus the ranges the SSA never issues.
    _Rule(
        "ssn",
        re.compile(r"(?<![\w.+-])(?!000|666|9\d\d)\d{3}([- ])(?!00)\d{2}\1(?!0000)\d{4}(?![\w-]?\d)"),
    ),
    # Emails, but not the `user@` of a URL (`postgres://app@db:5432` names a role, not a person).
    _Rule(
        "email",
        re.compile(
            r"(?<![A-Za-z0-9._%+-])(?<!://)[A-Za-z0-9][A-Za-z0-9._%+-]*@"
            r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.[A-Za-z]{2,}\b"
        ),
    ),
    # Phones need a `+` country code, parentheses, or the 3-3-4 shape with one repeated separator, so ids,
    # ports, ISO timestamps and plain numbers are left alone.
    _Rule(
        "phone",
        re.compile(r"(?<![\w+.-])\+[1-9]\d{0,2}(?:[ .-]?\(?\d{1,4}\)?){2,6}(?![\w.-]?\d)"),
        accept=_digits_between(8, 15),
    ),
    _Rule("phone", re.compile(r"(?<![\w(.-])\(\d{3}\)[ .-]?\d{3}[ .-]\d{4}(?![\w.-]?\d)")),
    _Rule("phone", re.compile(r"(?<![\w.+-])\d{3}([ .-])\d{3}\1\d{4}(?![\w.-]?\d)")),
    # Phones written without separators: a bare number is an id until something says it is a phone
    # (`tel:`, "phone", "call", a `"mobile":` key); then 7-15 digits go.
    _Rule(
        "phone",
        re.compile(
            r"(?i)(?:\btel:|\b(?:phone|mobile|cell|tel|fax|sms|whatsapp|call|ring|text|msisdn|contact)"
            r"(?:[_ -]?(?:no|num|number|nr))?\b[\"']?(?:[\s:=#-]+(?:me|us|him|her|them|is|at|on|to|via|no|nr|number|num)\b){0,3}"
            r"[\s:=#\"']*)(?P<v>\+?\d{7,15})(?![\w.-]?\d)"
        ),
        "v",
    ),
)


def _secret_span(rule: _Rule, match: re.Match[str]) -> tuple[int, int] | None:
    """Where in the match the secret sits, or None when the rule does not apply after all."""
    names = rule.group.split("|") if rule.group else []
    for name in names:
        if match.group(name) is not None:
            start, end = match.span(name)
            break
    else:
        start, end = match.span()
    if start == end:
        return None
    if rule.accept is not None and not rule.accept(match.string[start:end]):
        return None
    if rule.accept_match is not None and not rule.accept_match(match):
        return None
    return start, end


def _apply_rule(rule: _Rule, segments: list[tuple[str, bool]]) -> tuple[list[tuple[str, bool]], bool]:
    """Run one rule over the plain segments (markers are skipped) and split out what it redacts."""
    out: list[tuple[str, bool]] = []
    changed = False
    for text, is_marker in segments:
        if is_marker:
            out.append((text, True))
            continue
        pos = 0
        for match in rule.pattern.finditer(text):
            span = _secret_span(rule, match)
            if span is None:
                continue
            start, end = span
            if start > pos:
                out.append((text[pos:start], False))
            out.append((marker(rule.kind, text[start:end]), True))
            pos = end
            changed = True
        if pos < len(text):
            out.append((text[pos:], False))
    return out, changed


def _split_markers(text: str) -> list[tuple[str, bool]]:
    segments: list[tuple[str, bool]] = []
    pos = 0
    for match in _MARKER.finditer(text):
        if match.start() > pos:
            segments.append((text[pos : match.start()], False))
        segments.append((match.group(0), True))
        pos = match.end()
    if pos < len(text):
        segments.append((text[pos:], False))
    return segments


SHORT_TEXT = 256  # texts up to this long are remembered: a log line's fields repeat (pipeline, stage, run, logger)


def sanitize_text(text: str) -> str:
    """Replace every secret and PII shape in ``text`` by a hashed marker; idempotent.

    Rules run over the text between markers only, and the whole pass repeats until nothing changes, so
    sanitizing an already sanitized text returns it unchanged (each pass strictly shrinks the plain
    text, so the loop ends). A short text's result is remembered (the rules are a pure function of the text
    and the key): 21 patterns cost ~12 µs even for `attach`, and a JSON log line's fields ~330 µs in all,
    the largest part of a drain's settlement of an entity (issue 26).
    """
    if not text:
        return text
    if len(text) <= SHORT_TEXT:
        return _sanitized_short(text)
    return _sanitized(text)


@functools.lru_cache(maxsize=4096)
def _sanitized_short(text: str) -> str:
    return _sanitized(text)


def _sanitized(text: str) -> str:
    current = text
    while True:
        segments = _split_markers(current)
        any_change = False
        for rule in _RULES:
            segments, changed = _apply_rule(rule, segments)
            any_change = any_change or changed
        result = "".join(part for part, _ in segments)
        if not any_change or result == current:
            return result
        current = result


# ---------------------------------------------------------------------------------------- structures

_SECRET_KEY_ANYWHERE = re.compile(
    r"authorization|passw(?:or)?d|secret|apikey|cookie|credential|privatekey|accesskey|signingkey"
)
_SECRET_KEY_SUFFIX = re.compile(r"(?:token|session|sessionid|pwd|auth|signature)$")
_TEXT_KEY_SUFFIX = re.compile(r"(?:prompts?|messages|body|content|text|completion|payload|input|output)$")


_NOT_KEY_CHARACTER = re.compile(r"[^a-z0-9]")


@functools.lru_cache(maxsize=1024)
def _norm_key(key: str) -> str:
    """A mapping key as the key patterns read it; remembered, a structure's keys repeat (a log line asks 27 times)."""
    return _NOT_KEY_CHARACTER.sub("", key.lower())


def is_secret_key(key: str) -> bool:
    """True when a mapping key names a secret (``Authorization``, ``x-api-key``, ``refresh_token``, …)."""
    norm = _norm_key(key)
    return bool(_SECRET_KEY_ANYWHERE.search(norm) or _SECRET_KEY_SUFFIX.search(norm))


_PII_KEY = re.compile(
    r"^(?:[a-z]*(?:phone|mobile|msisdn|fax)(?:number|no|num)?|ssn|socialsecurity(?:number)?|iban|bankaccount(?:number)?"
    r"|(?:credit)?cardnumber|creditcard|pan)$"
)
_PAIR_NAME_KEYS = ("name", "key", "header", "field")


def is_pii_key(key: str) -> bool:
    """True when a mapping key names personal data whose value goes whole (``phone``, ``iban``, ``ssn``, …)."""
    return bool(_PII_KEY.match(_norm_key(key)))


def _pair_name(obj: Mapping[Any, Any]) -> str | None:
    """The secret name of a ``{"name": …, "value": …}`` pair, or None when it is not one."""
    lowered = {str(k).lower(): v for k, v in obj.items()}
    if "value" not in lowered:
        return None
    for key in _PAIR_NAME_KEYS:
        name = lowered.get(key)
        if isinstance(name, str) and (is_secret_key(name) or is_pii_key(name)):
            return name
    return None


def _is_pair(item: Any) -> bool:
    return isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)


def is_text_key(key: str) -> bool:
    """True when a mapping key holds free text that may be a full prompt or body (hashed when long)."""
    return bool(_TEXT_KEY_SUFFIX.search(_norm_key(key)))


def truncate(text: str, limit: int = MAX_CONTEXT_STRING) -> str:
    """Cut ``text`` to ``limit`` characters, never inside a marker, and say how much was dropped."""
    if len(text) <= limit:
        return text
    cut = limit
    for match in _MARKER.finditer(text, max(0, limit - 64), limit + 64):
        if match.start() < cut < match.end():
            cut = match.start()
    return f"{text[:cut]}…[truncated {len(text) - cut} chars]"


def _text_marker(text: str) -> str:
    return f"[TEXT len={len(text)} hmac={digest(text)}]"


def _secret_value_marker(key: str, value: Any) -> str:
    if isinstance(value, str | bytes):
        return marker(key, value)
    try:
        rendered = json.dumps(value, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        rendered = repr(value)
    return marker(key, rendered)


def sanitize_context(obj: Any, *, _depth: int = 0, _in_text: bool = False) -> Any:
    """A JSON-ready copy of ``obj`` safe for a dead-letter ``sanitized_context`` (002 §8.4).

    Values under secret-looking keys are replaced whole; long free text under prompt/body-like keys
    becomes ``[TEXT len=N sha256=…]``; every other string is sanitized and truncated.
    """
    if _depth > _MAX_DEPTH:
        return "[DEPTH LIMIT]"
    if obj is None or isinstance(obj, bool | int | float):
        return obj
    if isinstance(obj, str):
        if _in_text and len(obj) > TEXT_HASH_THRESHOLD:
            return _text_marker(obj)
        return truncate(sanitize_text(obj))
    if isinstance(obj, bytes | bytearray | memoryview):
        raw = bytes(obj)
        return f"[BYTES len={len(raw)} hmac={digest(raw)}]"
    if isinstance(obj, Enum):
        return sanitize_context(obj.value, _depth=_depth + 1, _in_text=_in_text)
    if isinstance(obj, datetime | date):
        return obj.isoformat()
    if isinstance(obj, UUID):
        return str(obj)
    if isinstance(obj, Mapping):
        named = _pair_name(obj)  # {"name": "X-Api-Key", "value": "…"}: the value is the secret
        out: dict[str, Any] = {}
        for key, value in obj.items():
            name = key if isinstance(key, str) else str(key)
            safe_key = truncate(sanitize_text(name), 128)
            if (is_secret_key(name) or is_pii_key(name)) and value is not None:
                out[safe_key] = _secret_value_marker(name, value)
            elif named is not None and name.lower() == "value" and value is not None:
                out[safe_key] = _secret_value_marker(named, value)
            else:
                out[safe_key] = sanitize_context(value, _depth=_depth + 1, _in_text=_in_text or is_text_key(name))
        return out
    if isinstance(obj, list | tuple) and obj and all(_is_pair(item) for item in obj):
        # a list of headers as (name, value) pairs: a secret name's value goes
        return [[truncate(sanitize_text(name), 128),
                 _secret_value_marker(name, value) if is_secret_key(name) and value is not None
                 else sanitize_context(value, _depth=_depth + 2, _in_text=_in_text)] for name, value in obj]
    if isinstance(obj, list | tuple | set | frozenset):
        items = sorted(obj, key=repr) if isinstance(obj, set | frozenset) else obj
        return [sanitize_context(item, _depth=_depth + 1, _in_text=_in_text) for item in items]
    model_dump = getattr(obj, "model_dump", None)
    if callable(model_dump):  # pydantic models
        return sanitize_context(model_dump(mode="json"), _depth=_depth + 1, _in_text=_in_text)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sanitize_context(dataclasses.asdict(obj), _depth=_depth + 1, _in_text=_in_text)
    return sanitize_context(str(obj), _depth=_depth + 1, _in_text=_in_text)


def sanitize_exception(exc: BaseException, *, limit: int = MAX_STACK_CHARS) -> str:
    """The formatted traceback with its cause/context chain, redacted (002 §8.4 ``last_stack``).

    Frame lines and exception type names are kept for triage; secrets in messages and source lines
    are not. Over ``limit`` characters, the oldest part is dropped: the newest frames matter most.
    """
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:  # a broken __str__ must not break the dead-letter write
        text = f"{type(exc).__module__}.{type(exc).__qualname__}: <unprintable exception>\n"
    text = sanitize_text(text)
    if len(text) > limit:
        dropped = len(text) - limit
        text = f"…[truncated {dropped} chars]\n{text[dropped:]}"
    return text


# ---------------------------------------------------------------------------------------------- logs


class SanitizingFilter(logging.Filter):
    """Formats each record's message, redacts it, and drops the raw args and exc_info.

    The message is rendered first (``msg % args``) because a secret usually arrives as an argument.
    The traceback is rendered into ``exc_text`` and ``exc_info`` cleared, so no handler can format
    the raw exception again. Applying it twice is harmless.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # bad format args: keep what we can, still redacted
            message = f"{record.msg!s} {record.args!r}"
        record.msg = sanitize_text(message)
        record.args = None
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = sanitize_exception(record.exc_info[1]).rstrip("\n")
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = sanitize_text(record.exc_text)
        if record.stack_info:
            record.stack_info = sanitize_text(record.stack_info)
        return True


def install_log_sanitizer(logger: logging.Logger | None = None) -> SanitizingFilter:
    """Attach one :class:`SanitizingFilter` to ``logger`` (root when None) and to its current handlers.

    A logger's own filters only see records logged on that logger; records from child loggers are
    caught by the handler filters. Handlers added later need ``handler.addFilter(...)`` themselves.
    Installing twice adds nothing.
    """
    target = logger if logger is not None else logging.getLogger()
    existing = next((f for f in target.filters if isinstance(f, SanitizingFilter)), None)
    log_filter = existing or SanitizingFilter()
    if existing is None:
        target.addFilter(log_filter)
    for handler in target.handlers:
        if not any(isinstance(f, SanitizingFilter) for f in handler.filters):
            handler.addFilter(log_filter)
    return log_filter
