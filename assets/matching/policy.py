"""Pure matching policy: contracts, normalization, the offline embedding, ranking, the LLM's schema,
the per-delivery decision and cluster components. No I/O, no Dagster.
"""

from __future__ import annotations

import hashlib
import math
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from enum import StrEnum
from functools import lru_cache
from typing import Annotated, Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, create_model

from redrive.budgets import RetryDecision

PIPELINE = "matching"

# 000 state transitions: NULL → pending → in-progress → succeeded | failed.
PENDING, IN_PROGRESS, SUCCEEDED, FAILED = "pending", "in-progress", "succeeded", "failed"
STATUSES = (PENDING, IN_PROGRESS, SUCCEEDED, FAILED)

# 000: NULL is "non-matchable type, or pre-feature". These types are queued at ingestion.
MATCHABLE_TYPES = frozenset({"invoice", "purchase_order", "delivery_note", "credit_note", "receipt", "order_confirmation"})

SQS_MAX_VISIBILITY = 43200  # seconds; SQS refuses more

# ------------------------------------------------------------------------------------------ contracts

DocumentId = Annotated[str, StringConstraints(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:\-]*$")]


class DocumentIn(BaseModel):
    """What ingestion hands us; anything else is refused with pydantic's field-by-field error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: DocumentId
    tenant: Annotated[str, StringConstraints(min_length=1, max_length=100)]
    doc_type: Annotated[str, StringConstraints(min_length=1, max_length=50, pattern=r"^[a-z_]+$")]
    counterparty: Annotated[str, StringConstraints(max_length=300)] = ""
    references: Annotated[list[Annotated[str, StringConstraints(max_length=100)]], Field(max_length=50)] = []
    amount: Decimal | None = Field(default=None, max_digits=18, decimal_places=2)
    currency: Annotated[str, StringConstraints(pattern=r"^[A-Z]{3}$")] | None = None
    document_date: date | None = None
    text: Annotated[str, StringConstraints(max_length=20000)] = ""

    @property
    def matchable(self) -> bool:
        return self.doc_type in MATCHABLE_TYPES


class MatchingMessage(BaseModel):
    """The body of a message on the matching queue: a document id, nothing else (000)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    document_id: DocumentId


# ------------------------------------------------------------------------------------- normalization

_LEGAL_FORMS = frozenset(
    "gmbh mbh ag kg ohg ug ltd limited inc incorporated llc llp plc sa sas sarl srl spa bv nv oy ab as aps "
    "co corp corporation company the".split()
)
_NON_WORD = re.compile(r"[^0-9a-z]+")
_NON_ALNUM = re.compile(r"[^0-9A-Z]+")
_SPACE = re.compile(r"\s+")


def _fold(text: str) -> str:
    """Accents off, case folded: "Müller" and "MULLER" meet."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold()


def normalize_counterparty(name: str | None) -> str | None:
    """Lower-case words without punctuation or legal form: "ACME GmbH" and "Acme, Ltd." → "acme"."""
    if not name:
        return None
    words = _NON_WORD.sub(" ", _fold(name).replace("&", " and ")).split()
    kept = [w for w in words if w not in _LEGAL_FORMS]
    out = " ".join(kept or words)
    return out or None


def normalize_references(refs: Iterable[str]) -> list[str]:
    """Upper-case alphanumerics only, at least 3 characters, sorted and unique: "inv-00123" → "INV00123"."""
    out = {_NON_ALNUM.sub("", _fold(r).upper()) for r in refs}
    return sorted(r for r in out if len(r) >= 3)


def searchable_text(doc: DocumentIn | Mapping[str, Any]) -> str:
    """The one line the embedding and the LLM read about a document."""
    get = doc.get if isinstance(doc, Mapping) else lambda k: getattr(doc, k)
    refs = " ".join(get("references") or [])
    amount = f"{get('amount')} {get('currency') or ''}".strip() if get("amount") is not None else ""
    when = get("document_date").isoformat() if get("document_date") else ""
    parts = [get("doc_type"), get("counterparty") or "", refs, amount, when, get("text") or ""]
    return _SPACE.sub(" ", " | ".join(p for p in parts if p)).strip()[:4000]


# ------------------------------------------------------------------------------------------ embedding

EMBEDDING_DIMS = 256
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fixed, platform-independent hash of uint64s."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


class Embedder(Protocol):
    dims: int

    def embed(self, text: str) -> np.ndarray: ...


@dataclass(frozen=True)
class HashedNgramEmbedder:
    """Offline and deterministic: character 4-grams hashed (with a sign) into a fixed-size,
    L2-normalized vector. No model, no download; same text → same bytes on every machine."""

    dims: int = EMBEDDING_DIMS
    ngrams: tuple[int, ...] = (4,)

    def embed(self, text: str) -> np.ndarray:
        data = np.frombuffer(f"  {_fold(_SPACE.sub(' ', text))}  ".encode(), dtype=np.uint8).astype(np.uint64)
        vec = np.zeros(self.dims, dtype=np.float64)
        with np.errstate(over="ignore"):
            for n in self.ngrams:
                if len(data) < n:
                    continue
                h = np.zeros(len(data) - n + 1, dtype=np.uint64)
                for k in range(n):
                    h = h * np.uint64(257) + data[k: len(data) - n + 1 + k]
                h = _mix(h + np.uint64(n))
                signs = np.where((h >> np.uint64(63)) == 1, -1.0, 1.0)
                vec += np.bincount((h % np.uint64(self.dims)).astype(np.int64), weights=signs, minlength=self.dims)
        norm = float(np.linalg.norm(vec))
        return (vec / norm if norm > 0 else vec).astype(np.float32)


DEFAULT_EMBEDDER = HashedNgramEmbedder()


def to_bytes(vec: np.ndarray) -> bytes:
    return np.asarray(vec, dtype="<f4").tobytes()


def from_bytes(raw: bytes | memoryview | None, dims: int = EMBEDDING_DIMS) -> np.ndarray:
    data = bytes(raw) if raw is not None else b""
    if len(data) != dims * 4:  # missing, or written by another embedding size: no vector signal
        return np.zeros(dims, dtype=np.float32)
    return np.frombuffer(data, dtype="<f4")


# Random-hyperplane LSH: 16 bands of 12 sign bits. Two documents share a band value with
# probability (1 - angle/π)^12 per band, so near neighbours meet in one of the GIN-indexed
# band values while a random document meets about N/4096 per band.
LSH_BANDS, LSH_BITS = 16, 12


@lru_cache(maxsize=4)
def _hyperplanes(dims: int) -> np.ndarray:
    """±1 hyperplanes from a fixed hash, never from a library RNG whose stream could change."""
    idx = np.arange(LSH_BANDS * LSH_BITS * dims, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    bits = (_mix(idx) >> np.uint64(63)).astype(np.float32)
    return (bits * 2 - 1).reshape(LSH_BANDS * LSH_BITS, dims)


def lsh_bands(vec: np.ndarray) -> list[int]:
    """One int per band: band index in the high bits, so values never collide across bands."""
    if not np.any(vec):
        return []
    bits = (_hyperplanes(len(vec)) @ vec.astype(np.float32)) > 0
    weights = 1 << np.arange(LSH_BITS, dtype=np.int64)
    values = bits.reshape(LSH_BANDS, LSH_BITS).astype(np.int64) @ weights
    return [int(b << LSH_BITS | v) for b, v in enumerate(values)]


def lsh_bands_many(matrix: np.ndarray) -> np.ndarray:
    """`lsh_bands` for many rows at once (bulk loads); rows of zeros get band values anyway."""
    bits = (matrix.astype(np.float32) @ _hyperplanes(matrix.shape[1]).T) > 0
    weights = 1 << np.arange(LSH_BITS, dtype=np.int64)
    values = bits.reshape(len(matrix), LSH_BANDS, LSH_BITS).astype(np.int64) @ weights
    return (np.arange(LSH_BANDS, dtype=np.int64) << LSH_BITS) | values


@dataclass(frozen=True)
class Prepared:
    """What pre-processing persists (outside the write transaction; a retry writes the same values)."""

    searchable_text: str
    normalized_counterparty: str | None
    normalized_references: list[str]
    embedding: np.ndarray
    bands: list[int]


def embedding_text(doc: Mapping[str, Any]) -> str:
    """What the embedding reads: the free text only (counterparty and description). Type, amount, date
    and references are matched exactly or shown to the LLM; embedded, their shared template would make
    every pair of documents look alike and flood the LSH bands."""
    return f"{doc.get('counterparty') or ''} {doc.get('text') or ''}".strip()


def prepare(doc: Mapping[str, Any], embedder: Embedder = DEFAULT_EMBEDDER) -> Prepared:
    text = searchable_text(doc)
    vec = embedder.embed(embedding_text(doc))
    return Prepared(text, normalize_counterparty(doc.get("counterparty")),
                    normalize_references(doc.get("references") or []), vec, lsh_bands(vec))


# -------------------------------------------------------------------------------------------- ranking


@dataclass(frozen=True)
class Candidate:
    id: str
    doc_type: str
    counterparty: str
    normalized_counterparty: str | None
    normalized_references: Sequence[str]
    amount: Decimal | None
    currency: str | None
    document_date: date | None
    text: str
    embedding: np.ndarray
    cosine: float = 0.0
    score: float = 0.0


def rank_candidates(query: Prepared, found: Sequence[Candidate], limit: int) -> list[Candidate]:
    """Exact cosine re-ranking of the few retrieved rows, boosted by the exact signals.

    score = cosine + 0.5 if the normalized counterparty is the same + 0.25 per shared reference (max 2).
    Ties break on id, so the same inputs always show the LLM the same list.
    """
    if not found:
        return []
    matrix = np.vstack([c.embedding for c in found]).astype(np.float32)
    cosines = matrix @ query.embedding.astype(np.float32)
    refs = set(query.normalized_references)
    scored = []
    for cand, cos in zip(found, cosines, strict=True):
        same_cp = bool(query.normalized_counterparty) and cand.normalized_counterparty == query.normalized_counterparty
        shared = len(refs.intersection(cand.normalized_references))
        score = float(cos) + (0.5 if same_cp else 0.0) + 0.25 * min(shared, 2)
        scored.append(_replace(cand, cosine=float(cos), score=round(score, 6)))
    scored.sort(key=lambda c: (-c.score, c.id))
    return scored[:limit]


def _replace(c: Candidate, **changes: Any) -> Candidate:
    from dataclasses import replace

    return replace(c, **changes)


# --------------------------------------------------------------------------------------- LLM decision


class MatchItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    candidate: int = Field(ge=1)
    confidence: float = Field(ge=0.0, le=1.0)
    reason: str = Field(default="", max_length=500)


class MatchDecision(BaseModel):
    """A valid decision; `{"matches": []}` is a legitimate "no match", never a failure in disguise."""

    model_config = ConfigDict(extra="forbid")

    matches: list[MatchItem]


@lru_cache(maxsize=64)
def decision_schema(candidates: int) -> type[MatchDecision]:
    """The response schema for n candidates: a number outside 1..n fails validation (transient, 000)."""
    item = create_model(
        f"MatchItemOf{candidates}",
        __base__=MatchItem,
        candidate=(int, Field(ge=1, le=candidates)),
    )
    return create_model(f"MatchDecisionOf{candidates}", __base__=MatchDecision, matches=(list[item], ...))  # type: ignore[valid-type]


SYSTEM_PROMPT = (
    "You match business documents (invoices, purchase orders, delivery notes, receipts, credit notes) "
    "that belong to the same transaction. You get one document and numbered candidates of the same tenant. "
    'Answer only JSON: {"matches": [{"candidate": <number>, "confidence": <0..1>, "reason": "<short>"}]}. '
    'List only candidates that refer to the same transaction; answer {"matches": []} when none does.'
)


def _describe(d: Mapping[str, Any] | Candidate, limit: int = 300) -> str:
    get = d.get if isinstance(d, Mapping) else lambda k: getattr(d, k)
    refs = ", ".join(get("references") if isinstance(d, Mapping) else get("normalized_references")) or "-"
    amount = f"{get('amount')} {get('currency') or ''}".strip() if get("amount") is not None else "-"
    when = get("document_date").isoformat() if get("document_date") else "-"
    text = _SPACE.sub(" ", get("text") or "")[:limit]
    return f"type={get('doc_type')}; counterparty={get('counterparty') or '-'}; references={refs}; " \
           f"amount={amount}; date={when}; text={text}"


def build_messages(doc: Mapping[str, Any], candidates: Sequence[Candidate]) -> list[dict[str, str]]:
    lines = [f"Document: {_describe(doc)}", "", "Candidates:"]
    lines += [f"{i}. {_describe(c)}" for i, c in enumerate(candidates, start=1)]
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n".join(lines)}]


@dataclass(frozen=True, order=True)
class Edge:
    """An undirected match edge, stored with the smaller id first."""

    a: str
    b: str
    confidence: float
    reason: str


def edges_from(document_id: str, decision: MatchDecision, candidates: Sequence[Candidate]) -> list[Edge]:
    """One edge per matched candidate (the highest confidence if the LLM names one twice)."""
    best: dict[str, MatchItem] = {}
    for item in decision.matches:
        other = candidates[item.candidate - 1].id
        if other != document_id and (other not in best or item.confidence > best[other].confidence):
            best[other] = item
    return sorted(
        Edge(*sorted((document_id, other)), confidence=item.confidence, reason=item.reason)
        for other, item in best.items()
    )


# ----------------------------------------------------------------------------------- delivery decision


class Action(StrEnum):
    SUCCEEDED = "succeeded"  # mark succeeded, delete the message
    FAILED = "failed"  # non-transient: mark failed, notify, delete the message
    RETRY_LATER = "retry_later"  # transient: ChangeMessageVisibility to the receive count's step
    LEFT_FOR_DLQ = "left_for_dlq"  # transient on the last delivery: mark failed, notify, keep the message
    QUARANTINED = "quarantined"  # malformed message: moved to the DLQ by us, dead letter + alert
    DUPLICATE = "duplicate"  # a redelivery of an already succeeded document failed: result kept, message deleted


@dataclass(frozen=True)
class Delivery:
    action: Action
    delay: float = 0.0  # unscaled seconds before SQS delivers the message again (RETRY_LATER only)


def delivery(decision: RetryDecision, *, status: str | None = IN_PROGRESS) -> Delivery:
    """000's flow after in-process retries, from the core's decision on the receive count under
    `MATCHING_VISIBILITY_BACKOFF`: receive count 1 → 5 min, 2 → 30 min, 3 → failed, left for the DLQ.

    A non-transient failure fails at once, whatever the receive count. `status` is the document's
    status when the failure is recorded: a `succeeded` document (SQS delivered it twice) keeps its
    result, so this delivery only ends (000: delete on a definitive outcome) — never back to pending.
    The steps are the policy's, whatever a `Retry-After` said (000 as written).
    """
    if status == SUCCEEDED:
        return Delivery(Action.DUPLICATE)
    if decision.retry:
        return Delivery(Action.RETRY_LATER, decision.delay)
    return Delivery(Action.FAILED if decision.reason == "permanent" else Action.LEFT_FOR_DLQ)


def visibility_seconds(delay: float, scale: float) -> int:
    """Seconds for ChangeMessageVisibility: scaled, whole (SQS counts seconds), within SQS's limit."""
    if delay <= 0:
        return 0
    return max(1, min(SQS_MAX_VISIBILITY, math.ceil(delay * scale - 1e-9)))


# ------------------------------------------------------------------------------------------- clusters


def cluster_lock_keys(tenant: str, cluster_keys: Iterable[str]) -> list[int]:
    """Advisory lock keys for clusters, sorted: every writer takes its locks in this one order, so two
    writers never wait for each other crosswise (no deadlock). A cluster's key is its id, or a lone
    document's own id; a hash collision only serializes two writers that could have run in parallel."""
    keys = {int.from_bytes(hashlib.blake2b(f"matching:{tenant}:cluster:{k}".encode(), digest_size=8).digest(),
                           "big", signed=True) for k in cluster_keys}
    return sorted(keys)


def connected_components(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Node → cluster id, the smallest id of its component (union-find); a lone node is its own cluster."""
    parent: dict[str, str] = {n: n for n in nodes}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            lo, hi = sorted((ra, rb))
            parent[hi] = lo
    return {n: find(n) for n in list(parent)}
