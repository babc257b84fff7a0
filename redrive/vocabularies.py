"""Each seed's words for failures, as tables over the core codes.

The classifier says *what* happened (a core :class:`~redrive.failures.Code`); a :class:`Vocabulary`
says what the seed calls it and whether the seed retries it. Pipelines pick a vocabulary; they do
not write ``if``-chains. Where a seed is silent on a core code, the row carries a comment saying
what we chose and why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from redrive.failures import Code, Failure

__all__ = [
    "CONVERSION",
    "CONVERSION_INTERNAL",
    "CONVERSION_PUBLIC_CODES",
    "CONVERSION_RETRYABLE",
    "CRITICIZER",
    "CRITICIZER_CATEGORIES",
    "EVIDENCE",
    "EVIDENCE_CATEGORY_CODES",
    "EVIDENCE_RETRYABLE_CATEGORIES",
    "EVIDENCE_S3",
    "MATCHING",
    "MATCHMAKING",
    "VOCABULARIES",
    "Entry",
    "Vocabulary",
    "criticizer_error_class",
    "evidence_category",
    "public_code",
]


@dataclass(frozen=True)
class Entry:
    """A seed's name for a failure, whether the seed retries it, and the seed's category if it has one."""

    code: str
    retryable: bool
    category: str = ""


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """A table from core code to a seed's :class:`Entry`, plus a default for codes it does not list.

    ``idempotent_only`` holds seed codes that are retryable only when the operation is idempotent
    (002 §8.1: conflicts are "safe only for idempotent operations"); :meth:`apply` turns them
    permanent when told ``idempotent=False``. That is the only rule; the rest is lookup.
    """

    name: str
    table: Mapping[str, Entry]
    default: Entry
    idempotent_only: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        unknown = set(self.table) - set(Code)
        if unknown:
            raise ValueError(f"vocabulary {self.name}: keys must be core codes, got {sorted(unknown)}")
        object.__setattr__(self, "table", MappingProxyType(dict(self.table)))

    def entry(self, failure: Failure | str, *, idempotent: bool = True) -> Entry:
        """The seed's entry for a failure (or a core code), with the idempotency rule applied."""
        core = failure.core if isinstance(failure, Failure) else str(failure)
        found = self.table.get(core, self.default)
        if found.retryable and not idempotent and found.code in self.idempotent_only:
            return Entry(found.code, False, found.category)
        return found

    def apply(self, failure: Failure, *, idempotent: bool = True) -> Failure:
        """The failure renamed to the seed's code with the seed's retryability; ``retry_after`` is kept.

        Looks up the *core* code, so applying twice, or applying another vocabulary afterwards, is safe.
        """
        found = self.entry(failure, idempotent=idempotent)
        return failure.as_code(found.code, retryable=found.retryable)

    @property
    def codes(self) -> frozenset[str]:
        """Every seed code this vocabulary can produce."""
        return frozenset(e.code for e in self.table.values()) | {self.default.code}

    def __repr__(self) -> str:
        return f"Vocabulary({self.name!r}, {len(self.table)} rows)"


def _table(rows: Iterable[tuple[Code, Entry]]) -> dict[str, Entry]:
    table: dict[str, Entry] = {}
    for core, found in rows:
        if core in table:
            raise ValueError(f"duplicate row for {core}")
        table[str(core)] = found
    return table


# ---------------------------------------------------------------------------------------------- 003

CONVERSION_PUBLIC_CODES: frozenset[str] = frozenset(
    {"NOT_PDF", "TOO_LARGE", "GW_4XX", "GW_5XX", "GW_TIMEOUT", "IO_ERROR", "NOT_READY", "EXPIRED", "FORBIDDEN", "UNKNOWN"}
)
"""003 §2: the canonical codes the UI and API show."""

CONVERSION_RETRYABLE: frozenset[str] = frozenset({"GW_5XX", "GW_TIMEOUT", "IO_ERROR", "UNKNOWN"})
"""003 §3.2: retried; ``GW_4XX`` never is."""


def _conv(code: str) -> Entry:
    return Entry(code, code in CONVERSION_RETRYABLE)


# NOT_PDF, TOO_LARGE, NOT_READY and EXPIRED come from the app's own checks (upload validation, a
# result asked for too early, a download link past its date), never from classifying an error, so
# no core code maps to them. A gateway 404 is a gateway 4xx.
CONVERSION = Vocabulary(
    "conversion",
    _table(
        [
            (Code.NETWORK_TIMEOUT, _conv("GW_TIMEOUT")),
            (Code.NETWORK_ERROR, _conv("GW_5XX")),  # 003 §3.1: network errors -> GW_5XX
            (Code.UPSTREAM_UNAVAILABLE, _conv("GW_5XX")),
            (Code.UPSTREAM_INTERNAL, _conv("GW_5XX")),
            (Code.RATE_LIMITED, _conv("GW_5XX")),  # silent in 003: a busy gateway, worth retrying
            (Code.CONFLICT, _conv("IO_ERROR")),  # silent: a lost write race on our side, retried
            (Code.DB_TRANSIENT, _conv("IO_ERROR")),
            (Code.SCHEMA_INVALID, _conv("GW_4XX")),  # 003 §3.1: validation internals -> GW_4XX
            (Code.PARSE_ERROR, _conv("GW_4XX")),
            (Code.CONTEXT_LENGTH_EXCEEDED, _conv("GW_4XX")),
            (Code.BAD_REQUEST, _conv("GW_4XX")),
            (Code.NOT_FOUND, _conv("GW_4XX")),
            (Code.POLICY_REJECTED, _conv("GW_4XX")),
            (Code.DATA_ERROR, _conv("GW_4XX")),
            (Code.AUTH_DENIED, _conv("FORBIDDEN")),
            # 003 §3.2 retries UNKNOWN "only if not user-induced"; a bug in our code is not user-induced,
            # and the 3-attempt budget bounds the waste.
            (Code.INVARIANT_VIOLATION, _conv("UNKNOWN")),
            (Code.UNKNOWN, _conv("UNKNOWN")),
        ]
    ),
    default=_conv("UNKNOWN"),
)

CONVERSION_INTERNAL: Mapping[str, str] = MappingProxyType(
    {
        # 003 §2 / §3.1 internal names
        "GW_UNAVAILABLE": "GW_5XX",
        "NETWORK_ERROR": "GW_5XX",
        "PARSE_ERROR": "GW_4XX",
        "VALIDATION_ERROR": "GW_4XX",
        "INVALID_MAPPING": "GW_4XX",
        "MEMORY_ERROR": "UNKNOWN",  # 003: "or IO_ERROR if it's local resource pressure"; we cannot tell
        # the canonical codes name themselves
        **{code: code for code in sorted(CONVERSION_PUBLIC_CODES)},
    }
)
"""003's internal error names -> canonical public code."""


def public_code(internal: str) -> str:
    """The canonical 003 code for an internal name; anything unrecognised is ``UNKNOWN``."""
    return CONVERSION_INTERNAL.get(internal, "UNKNOWN")


# ---------------------------------------------------------------------------------------------- 002

CRITICIZER_CATEGORIES: Mapping[str, bool] = MappingProxyType(
    {
        "network_transient": True,
        "rate_limiting": True,
        "upstream_internal": True,
        "conflict": True,
        "validation": False,
        "auth": False,
        "not_found": False,
        "policy": False,
        "bug": False,
    }
)
"""002 §8.1 failure categories and their classification (True = retryable)."""


def _crit(error_class: str, category: str) -> Entry:
    return Entry(error_class, CRITICIZER_CATEGORIES[category], category)


CRITICIZER = Vocabulary(
    "criticizer",
    _table(
        [
            (Code.NETWORK_TIMEOUT, _crit("NETWORK_TIMEOUT", "network_transient")),
            (Code.NETWORK_ERROR, _crit("NETWORK_TRANSIENT", "network_transient")),
            (Code.UPSTREAM_UNAVAILABLE, _crit("NETWORK_TRANSIENT", "network_transient")),  # §8.1 lists 502/503/504 here
            (Code.RATE_LIMITED, _crit("RATE_LIMITED", "rate_limiting")),
            (Code.UPSTREAM_INTERNAL, _crit("UPSTREAM_INTERNAL", "upstream_internal")),
            (Code.CONFLICT, _crit("CONFLICT", "conflict")),
            # silent in 002: a deadlock or dropped connection rolled the whole transaction back, so a
            # retry is safe even for non-idempotent work; it rides with network transients.
            (Code.DB_TRANSIENT, _crit("DB_TRANSIENT", "network_transient")),
            (Code.SCHEMA_INVALID, _crit("SCHEMA_INVALID", "validation")),
            (Code.PARSE_ERROR, _crit("MALFORMED_PAYLOAD", "validation")),
            (Code.CONTEXT_LENGTH_EXCEEDED, _crit("CONTEXT_LENGTH_EXCEEDED", "validation")),
            (Code.BAD_REQUEST, _crit("BAD_REQUEST", "validation")),
            (Code.DATA_ERROR, _crit("DATA_INVALID", "validation")),
            (Code.AUTH_DENIED, _crit("AUTH_DENIED", "auth")),
            (Code.NOT_FOUND, _crit("NOT_FOUND", "not_found")),
            (Code.POLICY_REJECTED, _crit("POLICY_REJECTED", "policy")),
            (Code.INVARIANT_VIOLATION, _crit("CONFIG_OR_RUNTIME_BUG", "bug")),
            # §8.1: every failure is retryable or not; one nothing classifies is a missing rule: page, don't loop.
            (Code.UNKNOWN, _crit("UNCLASSIFIED", "bug")),
        ]
    ),
    default=_crit("UNCLASSIFIED", "bug"),
    idempotent_only=frozenset({"CONFLICT"}),
)


def criticizer_error_class(failure: Failure, *, idempotent: bool) -> Entry:
    """002 §8.4 ``error_class`` for a failure; conflicts retry only for idempotent operations (§8.1)."""
    return CRITICIZER.entry(failure, idempotent=idempotent)


# ---------------------------------------------------------------------------------------------- 000

# 000's table names seven rows; codes stay the core names, the category is the seed's word.


def _transient(core: Code) -> Entry:
    return Entry(str(core), True, "transient")


def _non_transient(core: Code) -> Entry:
    return Entry(str(core), False, "non_transient")


MATCHING = Vocabulary(
    "matching",
    _table(
        [
            (Code.RATE_LIMITED, _transient(Code.RATE_LIMITED)),  # HTTP 429
            (Code.UPSTREAM_UNAVAILABLE, _transient(Code.UPSTREAM_UNAVAILABLE)),  # HTTP 5xx
            (Code.UPSTREAM_INTERNAL, _transient(Code.UPSTREAM_INTERNAL)),  # HTTP 5xx
            (Code.NETWORK_TIMEOUT, _transient(Code.NETWORK_TIMEOUT)),
            (Code.NETWORK_ERROR, _transient(Code.NETWORK_ERROR)),  # connection refused
            (Code.PARSE_ERROR, _transient(Code.PARSE_ERROR)),  # LLMs are non-deterministic
            (Code.SCHEMA_INVALID, _transient(Code.SCHEMA_INVALID)),  # ditto: transient here, unlike 002
            (Code.CONTEXT_LENGTH_EXCEEDED, _non_transient(Code.CONTEXT_LENGTH_EXCEEDED)),
            (Code.AUTH_DENIED, _non_transient(Code.AUTH_DENIED)),  # 401 / 403
            # silent in 000: the write phase is one transaction, rolled back whole, so retry DB hiccups
            (Code.DB_TRANSIENT, _transient(Code.DB_TRANSIENT)),
            (Code.CONFLICT, _transient(Code.CONFLICT)),
            # silent: the same request gets the same answer
            (Code.BAD_REQUEST, _non_transient(Code.BAD_REQUEST)),
            (Code.NOT_FOUND, _non_transient(Code.NOT_FOUND)),
            (Code.POLICY_REJECTED, _non_transient(Code.POLICY_REJECTED)),
            (Code.DATA_ERROR, _non_transient(Code.DATA_ERROR)),
            (Code.INVARIANT_VIOLATION, _non_transient(Code.INVARIANT_VIOLATION)),
            # silent: an unclassified error marks the document failed and alerts admins at once,
            # rather than parking it for 35 minutes of redeliveries.
            (Code.UNKNOWN, _non_transient(Code.UNKNOWN)),
        ]
    ),
    default=_non_transient(Code.UNKNOWN),
)

# ---------------------------------------------------------------------------------------------- 001

# 001's four failure types. Its only retryable rows are "Transient DB error" and "Timeout"; any other
# transient infrastructure failure rides the Timeout row, so the ADR's codes stay exactly four.
_DB = Entry("TRANSIENT_DB_ERROR", True)
_TIMEOUT = Entry("TIMEOUT", True)
_LOGIC = Entry("LOGIC_ERROR", False)
_DATA = Entry("DATA_INCONSISTENCY", False)

MATCHMAKING = Vocabulary(
    "matchmaking",
    _table(
        [
            (Code.DB_TRANSIENT, _DB),
            (Code.CONFLICT, _DB),  # the (date, user_id) upsert lost a race; the retry takes the ON CONFLICT path
            (Code.NETWORK_TIMEOUT, _TIMEOUT),
            (Code.NETWORK_ERROR, _TIMEOUT),
            (Code.UPSTREAM_UNAVAILABLE, _TIMEOUT),
            (Code.UPSTREAM_INTERNAL, _TIMEOUT),
            (Code.RATE_LIMITED, _TIMEOUT),
            (Code.DATA_ERROR, _DATA),
            (Code.SCHEMA_INVALID, _DATA),
            (Code.PARSE_ERROR, _DATA),
            (Code.NOT_FOUND, _DATA),  # a user or candidate vanished under us
            (Code.INVARIANT_VIOLATION, _LOGIC),
            (Code.BAD_REQUEST, _LOGIC),
            (Code.CONTEXT_LENGTH_EXCEEDED, _LOGIC),
            (Code.AUTH_DENIED, _LOGIC),  # misconfiguration: alert, manual fix
            (Code.POLICY_REJECTED, _LOGIC),
            (Code.UNKNOWN, _LOGIC),
        ]
    ),
    default=_LOGIC,
)

# ---------------------------------------------------------------------------------------------- 004

EVIDENCE_CATEGORY_CODES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("NETWORK", ("ATTACHMENT_API_TIMEOUT", "503", "NETWORK_TIMEOUT")),
    ("SYSTEM", ("500", "SYSTEM_ERROR")),
    ("DATA", ("CORRUPTED_FILE", "INVALID_FORMAT", "S3_NOT_FOUND")),
    ("AUTH", ("401", "403", "UNAUTHORIZED", "CASE_NOT_FOUND")),
)
"""004 §1.1 ``error_category`` generated column, in the CASE's order; anything else is SYSTEM."""

EVIDENCE_RETRYABLE_CATEGORIES: frozenset[str] = frozenset({"NETWORK", "SYSTEM"})
"""004 §1.1 ``is_retryable``: the category half (the ``retry_count < 2`` half is the budget's)."""


def evidence_category(code: str | None) -> str:
    """004's ``error_category`` CASE, row by row: first matching list wins, else (and NULL) SYSTEM."""
    if code is not None:
        for category, codes in EVIDENCE_CATEGORY_CODES:
            if code in codes:
                return category
    return "SYSTEM"


def _ev(code: str) -> Entry:
    category = evidence_category(code)
    return Entry(code, category in EVIDENCE_RETRYABLE_CATEGORIES, category)


_EVIDENCE_ROWS: dict[str, Entry] = _table(
    [
        (Code.NETWORK_TIMEOUT, _ev("NETWORK_TIMEOUT")),
        (Code.NETWORK_ERROR, _ev("503")),  # connection refused/reset: the case API is unavailable
        (Code.UPSTREAM_UNAVAILABLE, _ev("503")),
        (Code.RATE_LIMITED, _ev("503")),  # no 429 in 004: a NETWORK-category retry, like a 503
        (Code.UPSTREAM_INTERNAL, _ev("500")),
        (Code.DB_TRANSIENT, _ev("SYSTEM_ERROR")),
        (Code.CONFLICT, _ev("SYSTEM_ERROR")),  # Rule 0's row lock makes the retry safe
        (Code.AUTH_DENIED, _ev("UNAUTHORIZED")),
        (Code.NOT_FOUND, _ev("CASE_NOT_FOUND")),  # 004 §7: the case was deleted mid-retry
        (Code.SCHEMA_INVALID, _ev("INVALID_FORMAT")),
        (Code.DATA_ERROR, _ev("INVALID_FORMAT")),
        (Code.BAD_REQUEST, _ev("INVALID_FORMAT")),  # the case API refused this file as sent
        (Code.CONTEXT_LENGTH_EXCEEDED, _ev("INVALID_FORMAT")),
        (Code.POLICY_REJECTED, _ev("INVALID_FORMAT")),
        (Code.PARSE_ERROR, _ev("CORRUPTED_FILE")),  # bytes we could not read
        # 004's CASE sends everything unlisted to SYSTEM, which is retryable; we follow it.
        (Code.INVARIANT_VIOLATION, _ev("SYSTEM_ERROR")),
        (Code.UNKNOWN, _ev("SYSTEM_ERROR")),
    ]
)

EVIDENCE = Vocabulary("evidence", _EVIDENCE_ROWS, default=_ev("SYSTEM_ERROR"))
"""004 ``attachment_error_code`` for calls to the case API."""

EVIDENCE_S3 = Vocabulary(
    "evidence_s3", {**_EVIDENCE_ROWS, str(Code.NOT_FOUND): _ev("S3_NOT_FOUND")}, default=_ev("SYSTEM_ERROR")
)
"""The same, for reading the artifact from S3: a missing object is ``S3_NOT_FOUND`` (DATA), not a missing case."""


VOCABULARIES: Mapping[str, Vocabulary] = MappingProxyType(
    {v.name: v for v in (CONVERSION, CRITICIZER, MATCHING, MATCHMAKING, EVIDENCE, EVIDENCE_S3)}
)
"""Every vocabulary by name, for configuration."""
