"""The matching policy, pure: classification, delivery decisions, schema, embedding, ranking, clusters."""

from __future__ import annotations

import json
import random

import httpx
import numpy as np
import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from assets.matching import policy
from assets.matching.policy import Action, Candidate, Edge, MatchDecision
from assets.matching.worker import classify
from redrive.backoff import MATCHING_LLM_BACKOFF, MATCHING_VISIBILITY_BACKOFF
from redrive.budgets import decide
from redrive.failures import Code, Failure
from redrive.vocabularies import MATCHING

REQUEST = httpx.Request("POST", "https://llm.example/v1/chat/completions")


def http_error(status: int, body: dict | None = None) -> httpx.HTTPStatusError:
    response = httpx.Response(status, request=REQUEST, content=json.dumps(body or {}).encode())
    return httpx.HTTPStatusError(f"HTTP {status}", request=REQUEST, response=response)


def schema_error() -> pydantic.ValidationError:
    try:
        policy.decision_schema(2).model_validate({"unexpected": "shape"})
    except pydantic.ValidationError as exc:
        return exc
    raise AssertionError("the schema accepted a wrong shape")


# 000's table, row by row, with the exceptions the LLM client really raises.
SEED_TABLE = [
    (http_error(429), True),
    (http_error(500), True),
    (http_error(502), True),
    (http_error(503), True),
    (httpx.ReadTimeout("timed out", request=REQUEST), True),
    (httpx.ConnectError("connection refused", request=REQUEST), True),
    (json.JSONDecodeError("Expecting value", "{", 1), True),  # parse failure
    (schema_error(), True),  # schema validation failure: transient here (LLMs are non-deterministic)
    (http_error(400, {"error": {"code": "context_length_exceeded", "type": "invalid_request_error"}}), False),
    (http_error(401, {"error": {"code": "invalid_api_key"}}), False),
    (http_error(403), False),
]


@pytest.mark.parametrize(("exc", "transient"), SEED_TABLE, ids=lambda v: type(v).__name__ if not isinstance(v, bool) else str(v))
def test_classification_follows_000s_table(exc: BaseException, transient: bool) -> None:
    """Each row of 000's table: 429/5xx/timeouts/refused/parse/schema transient; 400 context, 401/403 not."""
    assert classify(exc).retryable is transient


def delivery_decision(failure: Failure, receive_count: int, status: str = policy.IN_PROGRESS) -> policy.Delivery:
    """The core's decision on the receive count (as `redrive.settle` makes it), read as 000's delivery."""
    decision = decide(failure, max(1, receive_count), 3, MATCHING_VISIBILITY_BACKOFF, random.Random(1))
    return policy.delivery(decision, status=status)


@pytest.mark.parametrize(("receive_count", "action", "delay"), [
    (1, Action.RETRY_LATER, 300.0), (2, Action.RETRY_LATER, 1800.0), (3, Action.LEFT_FOR_DLQ, 0.0),
    (4, Action.LEFT_FOR_DLQ, 0.0),  # a message seen more often than the policy says: never loop further
])
def test_transient_delivery_steps(receive_count: int, action: Action, delay: float) -> None:
    """Transient after in-process retries: receive count 1 → 5 min, 2 → 30 min, 3 → failed, left for the DLQ."""
    failure = MATCHING.apply(Failure.of(Code.UPSTREAM_UNAVAILABLE))
    assert delivery_decision(failure, receive_count) == policy.Delivery(action, delay)


@pytest.mark.parametrize("receive_count", [1, 2, 3])
def test_non_transient_fails_on_any_delivery(receive_count: int) -> None:
    """401/403/context window: failed and deleted whatever the receive count."""
    failure = MATCHING.apply(Failure.of(Code.AUTH_DENIED))
    assert delivery_decision(failure, receive_count).action is Action.FAILED


@pytest.mark.parametrize(("receive_count", "retry_after", "delay"), [
    (1, 1000.0, 300.0), (1, 3600.0, 300.0), (2, 3600.0, 1800.0), (1, 10.0, 300.0)])
def test_retry_after_never_stretches_a_visibility_step(receive_count: int, retry_after: float, delay: float) -> None:
    """000 as written: the steps stay 5 and 30 minutes whatever a server's Retry-After asks."""
    failure = MATCHING.apply(Failure.of(Code.RATE_LIMITED, retry_after=retry_after))
    assert delivery_decision(failure, receive_count).delay == delay


@pytest.mark.parametrize("code", [Code.UPSTREAM_UNAVAILABLE, Code.AUTH_DENIED])
@pytest.mark.parametrize("receive_count", [1, 3])
def test_failed_redelivery_of_a_succeeded_document_is_a_duplicate(code: Code, receive_count: int) -> None:
    """A document already succeeded keeps its result: the failed delivery only ends, never pending or failed."""
    failure = MATCHING.apply(Failure.of(code))
    decision = delivery_decision(failure, receive_count, status="succeeded")
    assert decision == policy.Delivery(Action.DUPLICATE)


def test_llm_backoff_is_2_4_8_and_scales() -> None:
    """The core's in-process policy for llm-match-decision: 2 s → 4 s → 8 s."""
    rng = random.Random(0)
    assert [MATCHING_LLM_BACKOFF.delay(a, rng) for a in (1, 2, 3)] == [2.0, 4.0, 8.0]


@pytest.mark.parametrize(("delay", "scale", "seconds"), [
    (300, 1.0, 300), (1800, 1.0, 1800), (300, 0.001, 1), (1800, 0.001, 2), (1800, 0.01, 18), (0, 1.0, 0),
    (10**9, 1.0, policy.SQS_MAX_VISIBILITY),
])
def test_visibility_seconds_are_whole_scaled_and_bounded(delay: float, scale: float, seconds: int) -> None:
    """SQS takes whole seconds up to 12 h; a scaled wait never rounds down to 'at once'."""
    assert policy.visibility_seconds(delay, scale) == seconds


def test_decision_schema_refuses_unknown_candidates_and_extra_fields() -> None:
    """A number outside 1..n or an extra key is a schema failure; `{"matches": []}` is valid."""
    schema = policy.decision_schema(3)
    assert schema.model_validate({"matches": []}).matches == []
    for bad in ({"matches": [{"candidate": 4, "confidence": 0.5}]}, {"matches": [{"candidate": 0, "confidence": 0.5}]},
                {"matches": [], "note": "x"}, {"matches": [{"candidate": 1, "confidence": 1.5}]}, {"ok": True}):
        with pytest.raises(pydantic.ValidationError):
            schema.model_validate(bad)


def cand(doc_id: str, text: str = "x", cp: str | None = None, refs: tuple[str, ...] = ()) -> Candidate:
    return Candidate(doc_id, "invoice", cp or "", cp, refs, None, None, None, text,
                     policy.DEFAULT_EMBEDDER.embed(text))


def test_edges_are_ordered_deduplicated_and_never_self() -> None:
    """The LLM naming a candidate twice keeps its best confidence; edges store the smaller id first."""
    cands = [cand("b-2"), cand("a-1"), cand("z-9")]
    decision = MatchDecision.model_validate({"matches": [
        {"candidate": 1, "confidence": 0.4}, {"candidate": 1, "confidence": 0.8}, {"candidate": 2, "confidence": 0.7}]})
    assert policy.edges_from("m-5", decision, cands) == [Edge("a-1", "m-5", 0.7, ""), Edge("b-2", "m-5", 0.8, "")]


def test_ranking_prefers_exact_signals_and_is_deterministic() -> None:
    """Same counterparty and shared references lift a candidate above a merely similar text; ties by id."""
    query_doc = {"doc_type": "invoice", "counterparty": "ACME GmbH", "references": ["INV-1"], "text": "consulting"}
    query = policy.prepare(query_doc)
    found = [cand("similar", text=policy.embedding_text(query_doc)), cand("same-cp", cp="acme", refs=("INV1",), text="zz"),
             cand("b-tie", text="qq"), cand("a-tie", text="qq")]
    ranked = [c.id for c in policy.rank_candidates(query, found, 10)]
    assert ranked[:2] == ["similar", "same-cp"]  # cosine 1.0 beats cosine ≈ 0 + 0.5 + 0.25
    assert ranked.index("a-tie") < ranked.index("b-tie")
    assert [c.id for c in policy.rank_candidates(query, list(reversed(found)), 10)] == ranked
    assert len(policy.rank_candidates(query, found, 2)) == 2


def test_normalization() -> None:
    """Legal forms, punctuation, accents and case do not separate a counterparty; references are alnum."""
    assert policy.normalize_counterparty("ACME GmbH") == policy.normalize_counterparty("Acme, Ltd.") == "acme"
    assert policy.normalize_counterparty("Müller & Söhne AG") == "muller and sohne"
    assert policy.normalize_counterparty("") is None and policy.normalize_counterparty("GmbH") == "gmbh"
    assert policy.normalize_references(["inv-00123", "INV 00123", "x", "po#77"]) == ["INV00123", "PO77"]


@given(st.text(max_size=300))
def test_embedding_is_unit_length_deterministic_and_offline(text: str) -> None:
    """Any text embeds to a unit (or zero) float32 vector, identical every time, with no model."""
    a, b = policy.DEFAULT_EMBEDDER.embed(text), policy.DEFAULT_EMBEDDER.embed(text)
    assert a.dtype == np.float32 and a.shape == (policy.EMBEDDING_DIMS,)
    assert np.array_equal(a, b)
    norm = float(np.linalg.norm(a))
    assert norm == pytest.approx(1.0, abs=1e-5) or norm == 0.0
    assert np.array_equal(policy.from_bytes(policy.to_bytes(a)), a)


def test_embedding_bytes_are_pinned() -> None:
    """The hash is ours (splitmix64), not Python's salted hash() nor a library RNG: stored vectors stay valid."""
    vec = policy.DEFAULT_EMBEDDER.embed("invoice | ACME GmbH | INV-1001")
    assert policy.lsh_bands(vec) == policy.lsh_bands(policy.DEFAULT_EMBEDDER.embed("invoice | ACME GmbH | INV-1001"))
    assert len(policy.lsh_bands(vec)) == policy.LSH_BANDS
    assert np.array_equal(policy.lsh_bands_many(np.vstack([vec, vec]))[0], policy.lsh_bands(vec))


@given(st.lists(st.tuples(st.sampled_from("abcdefgh"), st.sampled_from("abcdefgh")), max_size=12))
def test_components_name_each_cluster_by_its_smallest_member(edges: list[tuple[str, str]]) -> None:
    """Every node of a component gets the component's smallest id; unlinked nodes are their own cluster."""
    clusters = policy.connected_components("abcdefgh", edges)
    for a, b in edges:
        assert clusters[a] == clusters[b]
    for node, cluster in clusters.items():
        members = [n for n, c in clusters.items() if c == cluster]
        assert cluster == min(members) and node >= cluster


def test_document_contract_refuses_extras_and_bad_values() -> None:
    """Ingestion's contract: unknown fields, bad ids and bad currencies are refused by name."""
    ok = {"id": "d-1", "tenant": "t", "doc_type": "invoice"}
    assert policy.DocumentIn.model_validate(ok).matchable
    for bad in ({**ok, "extra": 1}, {**ok, "id": "has space"}, {**ok, "currency": "eur"}, {**ok, "doc_type": ""}):
        with pytest.raises(pydantic.ValidationError):
            policy.DocumentIn.model_validate(bad)
    assert not policy.DocumentIn.model_validate({**ok, "doc_type": "memo"}).matchable


def test_message_contract() -> None:
    """The queue message is exactly {"document_id": …}."""
    assert policy.MatchingMessage.model_validate_json('{"document_id": "d-1"}').document_id == "d-1"
    for bad in ('"d-1"', '{"document_id": ""}', '{"document_id": "d", "x": 1}', "not json"):
        with pytest.raises(pydantic.ValidationError):
            policy.MatchingMessage.model_validate_json(bad)


def test_cluster_lock_keys_are_sorted_unique_and_per_tenant() -> None:
    """One global order for every writer (no deadlock); the same cluster in two tenants is two locks."""
    keys = policy.cluster_lock_keys("t1", ["b", "a", "b"])
    assert keys == sorted(keys) and len(keys) == 2
    assert keys == policy.cluster_lock_keys("t1", ["a", "b"])
    assert set(keys).isdisjoint(policy.cluster_lock_keys("t2", ["a", "b"]))
    assert all(-(2**63) <= k < 2**63 for k in keys)
