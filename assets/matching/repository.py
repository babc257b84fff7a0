"""All SQL of document matching: documents with their 000 status columns, match edges, clusters.

Functions take a `Connection`, so the caller owns the transaction; `write_matches` is the one
function that owns its own: 000's write phase (delete edges → insert edges → update clusters)
in a single transaction, serialized per cluster it touches.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY, insert

from assets.matching import policy
from assets.matching.policy import FAILED, IN_PROGRESS, PENDING, SUCCEEDED, Candidate, DocumentIn, Edge, Prepared
from redrive import deadletters
from redrive.deadletters import FinalFailure
from redrive.failures import Code, ConflictError, Failure
from redrive.schema import NOW, TZ, metadata

document = sa.Table(
    "document",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant", sa.Text, nullable=False),
    sa.Column("doc_type", sa.Text, nullable=False),
    sa.Column("counterparty", sa.Text, nullable=False, server_default=""),
    sa.Column("reference_numbers", ARRAY(sa.Text), nullable=False, server_default=sa.text("'{}'::text[]")),
    sa.Column("amount", sa.Numeric(18, 2)),
    sa.Column("currency", sa.Text),
    sa.Column("document_date", sa.Date),
    sa.Column("text", sa.Text, nullable=False, server_default=""),
    # pre-processing output (000: persisted outside the write transaction)
    sa.Column("searchable_text", sa.Text),
    sa.Column("normalized_counterparty", sa.Text),
    sa.Column("normalized_references", ARRAY(sa.Text)),
    sa.Column("embedding", sa.LargeBinary),  # float32 little-endian, policy.EMBEDDING_DIMS values
    sa.Column("embedding_bands", ARRAY(sa.Integer)),  # LSH signature, GIN-indexed
    sa.Column("cluster_id", sa.Text),
    # 000's four columns
    sa.Column("matching_status", sa.Text),
    sa.Column("matching_error", sa.Text),
    sa.Column("matching_attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("matching_failed_at", TZ),
    # beyond the seed: when the current delivery started, for the stuck in-progress detector
    sa.Column("matching_started_at", TZ),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("updated_at", TZ, nullable=False, server_default=NOW),
    sa.CheckConstraint(
        "matching_status IN ('pending', 'in-progress', 'succeeded', 'failed')", name="matching_status"
    ),
    sa.Index("ix_document_tenant_normalized_counterparty", "tenant", "normalized_counterparty"),
    # GIN without the pending list: a lookup never scans megabytes of not-yet-merged entries
    sa.Index("ix_document_normalized_references", "normalized_references", postgresql_using="gin",
             postgresql_with={"fastupdate": "off"}),
    sa.Index("ix_document_tenant_cluster_id", "tenant", "cluster_id"),
    sa.Index("ix_document_tenant_matching_status", "tenant", "matching_status"),
    sa.Index(
        "ix_document_in_progress_started",
        "matching_started_at",
        postgresql_where=sa.text("matching_status = 'in-progress'"),
    ),
    sa.Index("ix_document_settled", "updated_at",
             postgresql_where=sa.text("matching_status IN ('succeeded', 'failed')")),  # the pruner's range
    sa.Index("ix_document_failed", "matching_failed_at",
             postgresql_where=sa.text("matching_status = 'failed'")),  # reconcile
)

# The LSH bands again, one row per (tenant, band, document), kept equal to `document.embedding_bands`
# by triggers (migration 0302): band retrieval ranks from this primary key alone, never the documents.
document_band = sa.Table(
    "document_band",
    metadata,
    sa.Column("tenant", sa.Text, primary_key=True),
    sa.Column("band", sa.Integer, primary_key=True),
    sa.Column("document_id", sa.Text, sa.ForeignKey("document.id", ondelete="CASCADE"), primary_key=True),
    sa.Index("ix_document_band_document_id", "document_id"),
)

document_match = sa.Table(
    "document_match",
    metadata,
    sa.Column("document_a_id", sa.Text, sa.ForeignKey("document.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("document_b_id", sa.Text, sa.ForeignKey("document.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("tenant", sa.Text, nullable=False),
    sa.Column("confidence", sa.Float, nullable=False),
    sa.Column("reason", sa.Text, nullable=False, server_default=""),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.CheckConstraint("document_a_id < document_b_id", name="ordered"),
    sa.Index("ix_document_match_document_b_id", "document_b_id"),
)


# ------------------------------------------------------------------------------------------ ingestion


def insert_document(conn: sa.Connection, doc: DocumentIn) -> bool:
    """Insert once by id (a re-sent document is a no-op); matchable types start `pending` (000)."""
    row = conn.execute(
        insert(document)
        .values(
            id=doc.id, tenant=doc.tenant, doc_type=doc.doc_type, counterparty=doc.counterparty,
            reference_numbers=list(doc.references), amount=doc.amount, currency=doc.currency,
            document_date=doc.document_date, text=doc.text,
            matching_status=PENDING if doc.matchable else None,
        )
        .on_conflict_do_nothing(index_elements=["id"])
        .returning(document.c.id)
    ).first()
    return row is not None


def mark_pending(conn: sa.Connection, document_ids: Sequence[str]) -> list[str]:
    """Re-queue (replay, backfill): back to `pending`; returns the ids that exist."""
    if not document_ids:
        return []
    rows = conn.execute(
        sa.update(document)
        .where(document.c.id.in_(list(document_ids)))
        .values(matching_status=PENDING, updated_at=sa.func.now())
        .returning(document.c.id)
    )
    return sorted(r.id for r in rows)


def select_for_requeue(conn: sa.Connection, *, tenant: str | None, statuses: Sequence[str],
                       include_never_queued: bool, limit: int) -> list[str]:
    """Ids a backfill re-queues: matchable documents in the given statuses (NULL = never queued)."""
    conds = []
    if statuses:
        conds.append(document.c.matching_status.in_(list(statuses)))
    if include_never_queued:
        conds.append(sa.and_(document.c.matching_status.is_(None),
                             document.c.doc_type.in_(sorted(policy.MATCHABLE_TYPES))))
    if not conds:
        return []
    q = sa.select(document.c.id).where(sa.or_(*conds)).order_by(document.c.id).limit(limit)
    if tenant:
        q = q.where(document.c.tenant == tenant)
    return [r.id for r in conn.execute(q)]


# --------------------------------------------------------------------------------------- state changes


def mark_in_progress(conn: sa.Connection, document_id: str, now: datetime) -> dict[str, Any] | None:
    """000: the worker picked the message up. One more delivery counted; None if no such document.

    A `succeeded` document stays `succeeded` (a duplicate delivery re-matches it, but it already has
    its result); anything else becomes `in-progress`."""
    return mark_deliveries(conn, [document_id], now)[0]


def mark_deliveries(conn: sa.Connection, document_ids: Sequence[str], now: datetime) -> list[dict[str, Any] | None]:
    """`mark_in_progress` for a received batch in one statement; one row per delivery, in order.

    A document delivered twice in the batch counts two deliveries, and each delivery sees the
    attempt number it would have seen alone (the first n - 1, the second n)."""
    deliveries = sa.func.unnest(sa.cast(list(document_ids), ARRAY(sa.Text))).table_valued("id").render_derived(name="u")
    counts = sa.select(deliveries.c.id, sa.func.count().label("n")).group_by(deliveries.c.id).subquery("v")
    keep_succeeded = sa.case((document.c.matching_status == SUCCEEDED, SUCCEEDED), else_=IN_PROGRESS)
    rows = conn.execute(
        sa.update(document)
        .where(document.c.id == counts.c.id)
        .values(matching_status=keep_succeeded, matching_attempts=document.c.matching_attempts + counts.c.n,
                matching_started_at=now, updated_at=now)
        .returning(*document.c, counts.c.n.label("deliveries"))
    ).mappings().all()
    marked = {r["id"]: r for r in rows}
    seen: dict[str, int] = {}
    out: list[dict[str, Any] | None] = []
    for document_id in document_ids:
        row = marked.get(document_id)
        if row is None:
            out.append(None)
            continue
        seen[document_id] = seen.get(document_id, 0) + 1
        doc = _as_doc({k: v for k, v in row.items() if k != "deliveries"})
        assert doc is not None
        doc["matching_attempts"] = row["matching_attempts"] - row["deliveries"] + seen[document_id]
        out.append(doc)
    return out


def lock_status(conn: sa.Connection, document_id: str) -> str | None:
    """The document's status, its row locked until the transaction ends: a concurrent write phase
    (which marks it succeeded) commits before or after this transaction's decision, never between."""
    return conn.execute(sa.select(document.c.matching_status).where(document.c.id == document_id)
                        .with_for_update()).scalar()


def mark_waiting(conn: sa.Connection, document_id: str, error: str, now: datetime) -> None:
    """Transient failure, SQS will deliver again: `pending` with the last error (not left in-progress,
    which would look like a crashed worker for the 5/30 minutes of the visibility step)."""
    conn.execute(sa.update(document).where(document.c.id == document_id)
                 .values(matching_status=PENDING, matching_error=error, updated_at=now))


def mark_failed(conn: sa.Connection, document_id: str, error: str, now: datetime) -> None:
    conn.execute(sa.update(document).where(document.c.id == document_id)
                 .values(matching_status=FAILED, matching_error=error, matching_failed_at=now, updated_at=now))


def save_prepared(conn: sa.Connection, document_id: str, prepared: Prepared) -> None:
    """000: pre-processing writes commit on their own; a retry overwrites them with the same values."""
    conn.execute(
        sa.update(document).where(document.c.id == document_id).values(
            searchable_text=prepared.searchable_text,
            normalized_counterparty=prepared.normalized_counterparty,
            normalized_references=prepared.normalized_references,
            embedding=policy.to_bytes(prepared.embedding),
            embedding_bands=prepared.bands,
        )
    )


def save_prepared_many(conn: sa.Connection, prepared: Sequence[tuple[str, Prepared]]) -> None:
    """`save_prepared` for a received batch, in one statement (one compiled statement for any batch:
    the rows travel as one JSON parameter)."""
    if not prepared:
        return
    rows = [{"id": i, "searchable_text": p.searchable_text, "counterparty": p.normalized_counterparty,
             "refs": list(p.normalized_references), "embedding": policy.to_bytes(p.embedding).hex(),
             "bands": list(p.bands)} for i, p in prepared]
    conn.execute(_SAVE_PREPARED, {"rows": json.dumps(rows)})


_SAVE_PREPARED = sa.text(
    "UPDATE document AS d SET searchable_text = v.searchable_text, normalized_counterparty = v.counterparty, "
    "normalized_references = v.refs, embedding = decode(v.embedding, 'hex'), embedding_bands = v.bands "
    "FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS v(id text, searchable_text text, counterparty text, "
    "refs text[], embedding text, bands integer[]) WHERE d.id = v.id"
)


def get(conn: sa.Connection, document_id: str) -> dict[str, Any] | None:
    row = conn.execute(sa.select(document).where(document.c.id == document_id)).mappings().first()
    return _as_doc(row)


def _as_doc(row: Any) -> dict[str, Any] | None:
    """A row as the policy reads a document (`references` as ingestion named them)."""
    if row is None:
        return None
    doc = dict(row)
    doc["references"] = list(doc.get("reference_numbers") or [])
    return doc


# ------------------------------------------------------------------------------------------ retrieval

# Each signal is a bounded index lookup; the union is re-ranked exactly in numpy (policy.rank_candidates).
BY_COUNTERPARTY, BY_REFERENCES, BY_EMBEDDING = 100, 100, 100
# At most this many documents per LSH band value: a band shared by a whole template-made corpus
# costs a bounded read, not one that grows with the tenant (about 130 per band at 100,000 here).
PER_BAND = 1000

_RETRIEVE = sa.text(
    """
    WITH by_counterparty AS (
        SELECT id FROM document
        WHERE tenant = :tenant AND normalized_counterparty = :counterparty AND id <> :id
        ORDER BY document_date DESC NULLS LAST, id
        LIMIT :k_counterparty
    ), by_references AS (
        SELECT id FROM document
        WHERE normalized_references && CAST(:references AS text[]) AND tenant = :tenant AND id <> :id
        ORDER BY id
        LIMIT :k_references
    ), by_embedding AS (
        -- rows sharing an LSH band, from document_band's primary key only (index-only scans);
        -- more shared bands = smaller angle
        SELECT s.document_id AS id
        FROM unnest(CAST(:bands AS integer[])) AS q(band)
        CROSS JOIN LATERAL (
            SELECT document_id FROM document_band
            WHERE tenant = :tenant AND band = q.band AND document_id <> :id
            LIMIT :per_band
        ) AS s
        GROUP BY s.document_id
        ORDER BY count(*) DESC, s.document_id
        LIMIT :k_embedding
    )
    SELECT d.id, d.doc_type, d.counterparty, d.normalized_counterparty, d.normalized_references,
           d.amount, d.currency, d.document_date, d.text, d.embedding
    FROM document d
    WHERE d.id IN (SELECT id FROM by_counterparty UNION SELECT id FROM by_references
                   UNION SELECT id FROM by_embedding)
      AND d.embedding IS NOT NULL
    """
)


def retrieve_candidates(conn: sa.Connection, document_id: str, tenant: str, prepared: Prepared) -> list[Candidate]:
    """Rows sharing the normalized counterparty, a reference, or an LSH band — never a scan of the tenant."""
    rows = conn.execute(
        _RETRIEVE,
        {
            "id": document_id, "tenant": tenant,
            "counterparty": prepared.normalized_counterparty or "\x00none",
            "references": prepared.normalized_references, "bands": prepared.bands,
            "k_counterparty": BY_COUNTERPARTY, "k_references": BY_REFERENCES, "k_embedding": BY_EMBEDDING,
            "per_band": PER_BAND,
        },
    ).mappings()
    return [
        Candidate(
            id=r["id"], doc_type=r["doc_type"], counterparty=r["counterparty"],
            normalized_counterparty=r["normalized_counterparty"],
            normalized_references=tuple(r["normalized_references"] or ()), amount=r["amount"],
            currency=r["currency"], document_date=r["document_date"], text=r["text"],
            embedding=policy.from_bytes(r["embedding"]),
        )
        for r in rows
    ]


# -------------------------------------------------------------------------------------- write phase


@dataclass
class WriteHooks:
    """Test seams inside the write transaction (each gets the transaction's connection)."""

    after_lock: Callable[[sa.Connection], None] = lambda conn: None
    after_delete: Callable[[sa.Connection], None] = lambda conn: None


@dataclass(frozen=True)
class WriteResult:
    edges: int
    affected: int
    cluster_id: str
    reassigned: int = 0
    clusters: dict[str, str] = field(default_factory=dict)


_LOCK_CLUSTERS = sa.text("SELECT count(pg_advisory_xact_lock(k)) FROM unnest(CAST(:keys AS bigint[])) AS k")
LOCK_ROUNDS = 5


@dataclass(frozen=True)
class Write:
    """One delivery's write phase: the document's new edges (each has the document at one end)."""

    document_id: str
    tenant: str
    edges: Sequence[Edge]


def write_matches(engine: sa.Engine, document_id: str, tenant: str, edges: Sequence[Edge], now: datetime,
                  hooks: WriteHooks | None = None) -> WriteResult:
    """000's write phase, in one transaction:

        BEGIN
        DELETE FROM document_match WHERE document_a_id = ? OR document_b_id = ?
        INSERT INTO document_match (new edges)
        UPDATE document SET cluster_id = ? WHERE id IN (affected cluster members)
        COMMIT

    plus the document's `succeeded` mark, so a delivery either changes everything or nothing
    (`write_matches_many` with one write)."""
    return write_matches_many(engine, [Write(document_id, tenant, edges)], now, hooks)[0]


def write_matches_many(engine: sa.Engine, writes: Sequence[Write], now: datetime, hooks: WriteHooks | None = None,
                       then: Callable[[sa.Connection], None] | None = None) -> list[WriteResult]:
    """Several deliveries' write phases in ONE transaction, with the result of running them one after
    another in the given order (a document written twice keeps its last edges; an edge survives
    unless a later write's document is one of its ends). `then` runs in the same transaction.
    All or nothing: a caller that must isolate one delivery's failure writes it alone.

    Transaction-scoped advisory locks on the clusters it touches come first — the clusters of the
    documents and of their new partners (a lone document is its own cluster), in one sorted order
    (`policy.cluster_lock_keys`). Any change to a cluster's membership is made by a writer that has
    one of its members among its seeds, so holds its lock: two writers touching a common cluster
    serialize, and compute cluster ids from each other's commits (READ COMMITTED, everything read
    after the locks); writers on disjoint clusters of one tenant run in parallel. If the clusters
    changed while this writer waited (a merge or split committed), the affected set needs a lock it
    does not hold: it rolls back and takes the larger set, at most LOCK_ROUNDS times. The locks are
    held for milliseconds: the LLM calls are outside.
    """
    hooks = hooks or WriteHooks()
    tenants = sorted({w.tenant for w in writes})
    seeds = {t: sorted({d for w in writes if w.tenant == t for d in (w.document_id, *_partners(w))})
             for t in tenants}
    keys: dict[str, set[str]] = {}
    for _ in range(LOCK_ROUNDS):
        try:
            with engine.begin() as conn:
                if not keys:  # first round: the clusters as they are now, read before locking
                    keys = {t: set(_cluster_keys(_clusters_by_id(conn, seeds[t])).values()) for t in tenants}
                conn.execute(_LOCK_CLUSTERS, {"keys": sorted({k for t in tenants
                                                               for k in policy.cluster_lock_keys(t, keys[t])})})
                hooks.after_lock(conn)
                results = _write_locked(conn, writes, seeds, now, hooks, keys)
                if then is not None:
                    then(conn)
                return results
        except _NeedsMoreLocks as more:  # rolled back; the locks are released with the transaction
            keys.setdefault(more.tenant, set()).update(more.keys)
    # other writers kept merging or splitting these clusters: a conflict, retried through SQS (000: transient)
    ids = ", ".join(sorted({w.document_id for w in writes}))
    raise ConflictError(Failure.of(Code.CONFLICT, message=f"the clusters around {ids} kept changing",
                                   detail=f"{sum(map(len, keys.values()))} cluster locks wanted "
                                          f"after {LOCK_ROUNDS} rounds"))


def _partners(write: Write) -> list[str]:
    return [e.b if e.a == write.document_id else e.a for e in write.edges]


class _NeedsMoreLocks(Exception):
    def __init__(self, tenant: str, keys: set[str]) -> None:
        super().__init__(f"{len(keys)} more cluster locks needed")
        self.tenant, self.keys = tenant, keys


def _cluster_keys(clusters: dict[str, str | None]) -> dict[str, str]:
    """Document → the key of its cluster's lock: its cluster id, or its own id when it has none yet."""
    return {d: c or d for d, c in clusters.items()}


def surviving_edges(writes: Sequence[Write]) -> list[Edge]:
    """The edges left by running the writes one after another: each deletes every edge of its document,
    then inserts its own; so an edge stays unless a later write's document is one of its ends."""
    later: set[str] = set()
    out: list[Edge] = []
    for w in reversed(writes):
        out.extend(e for e in w.edges if e.a not in later and e.b not in later)
        later.add(w.document_id)
    return sorted(out, key=lambda e: (e.a, e.b))


def _write_locked(conn: sa.Connection, writes: Sequence[Write], seeds: dict[str, list[str]], now: datetime,
                  hooks: WriteHooks, locked: dict[str, set[str]]) -> list[WriteResult]:
    """The write under the locks of `locked`; raises `_NeedsMoreLocks` when it touches another cluster."""
    current: dict[str, dict[str, str | None]] = {}
    for tenant, ids in seeds.items():
        current[tenant] = _cluster_members(conn, tenant, ids)
        for w in writes:
            if w.tenant == tenant and w.document_id not in current[tenant]:
                raise LookupError(f"document {w.document_id} vanished before its matches were written")
        missing = set(_cluster_keys(current[tenant]).values()) - locked.get(tenant, set())
        if missing:  # a merge or split committed while we waited
            raise _NeedsMoreLocks(tenant, missing)

    documents = sorted({w.document_id for w in writes})
    conn.execute(sa.delete(document_match).where(sa.or_(document_match.c.document_a_id.in_(documents),
                                                        document_match.c.document_b_id.in_(documents))))
    hooks.after_delete(conn)
    tenant_of = {w.document_id: w.tenant for w in writes}
    edges = surviving_edges(writes)
    if edges:
        conn.execute(insert(document_match), [
            {"document_a_id": e.a, "document_b_id": e.b, "tenant": tenant_of.get(e.a) or tenant_of[e.b],
             "confidence": e.confidence, "reason": e.reason[:500], "created_at": now} for e in edges])

    clusters: dict[str, str] = {}
    affected: dict[str, set[str]] = {}
    changes: list[tuple[str, str]] = []
    for tenant, found in current.items():
        affected[tenant] = nodes = set(found)
        links = _edges_within(conn, nodes)
        if nodes - set(found):  # the closure reached documents outside the clusters read above
            outside = _clusters_by_id(conn, sorted(nodes - set(found)))
            missing = set(_cluster_keys(outside).values()) - locked.get(tenant, set())
            if missing:  # cluster ids that disagree with the edges (older data): lock those clusters too
                raise _NeedsMoreLocks(tenant, missing)
            found.update(outside)
        components = policy.connected_components(nodes, links)
        clusters.update(components)
        changes.extend((d, c) for d, c in components.items() if found.get(d) != c)
    if changes:
        changes.sort()
        conn.execute(_SET_CLUSTERS, {"ids": [d for d, _ in changes], "clusters": [c for _, c in changes],
                                     "now": now})
    conn.execute(sa.update(document).where(document.c.id.in_(documents))
                 .values(matching_status=SUCCEEDED, updated_at=now))
    return [WriteResult(edges=len(w.edges), affected=len(affected[w.tenant]), cluster_id=clusters[w.document_id],
                        reassigned=len(changes), clusters={d: c for d, c in clusters.items()
                                                            if d in affected[w.tenant]})
            for w in writes]


# One statement for all cluster changes, however large the cluster.
_SET_CLUSTERS = sa.text(
    "UPDATE document AS d SET cluster_id = v.cluster, updated_at = :now "
    "FROM unnest(CAST(:ids AS text[]), CAST(:clusters AS text[])) AS v(id, cluster) WHERE d.id = v.id"
)


def _cluster_members(conn: sa.Connection, tenant: str, seeds: Sequence[str]) -> dict[str, str | None]:
    """The seeds and every member of their current clusters, with their cluster ids, in one query."""
    in_seeds = document.c.id.in_(list(seeds))
    seed_clusters = sa.select(document.c.cluster_id).where(in_seeds, document.c.cluster_id.is_not(None))
    rows = conn.execute(sa.select(document.c.id, document.c.cluster_id).where(
        document.c.tenant == tenant, sa.or_(in_seeds, document.c.cluster_id.in_(seed_clusters))))
    return {r.id: r.cluster_id for r in rows}


def _clusters_by_id(conn: sa.Connection, ids: Sequence[str]) -> dict[str, str | None]:
    rows = conn.execute(sa.select(document.c.id, document.c.cluster_id).where(document.c.id.in_(list(ids))))
    return {r.id: r.cluster_id for r in rows}


def _edges_within(conn: sa.Connection, nodes: set[str]) -> list[tuple[str, str]]:
    """Edges touching the affected set; grows the set to a closure so a component is never cut."""
    seen: set[tuple[str, str]] = set()
    frontier = set(nodes)
    while frontier:
        ids = sorted(frontier)
        rows = conn.execute(sa.select(document_match.c.document_a_id, document_match.c.document_b_id).where(
            sa.or_(document_match.c.document_a_id.in_(ids), document_match.c.document_b_id.in_(ids)))).all()
        new = {(r[0], r[1]) for r in rows} - seen
        seen |= new
        frontier = {n for e in new for n in e} - nodes
        nodes |= frontier
    return sorted(seen)


# ------------------------------------------------------------------------------------------- reading


def edges_of(conn: sa.Connection, tenant: str) -> list[tuple[str, str]]:
    rows = conn.execute(sa.select(document_match.c.document_a_id, document_match.c.document_b_id)
                        .where(document_match.c.tenant == tenant).order_by(document_match.c.document_a_id,
                                                                          document_match.c.document_b_id))
    return [(r[0], r[1]) for r in rows]


def clusters_of(conn: sa.Connection, tenant: str) -> dict[str, str | None]:
    rows = conn.execute(sa.select(document.c.id, document.c.cluster_id).where(document.c.tenant == tenant))
    return {r.id: r.cluster_id for r in rows}


def cluster_inconsistencies(conn: sa.Connection, tenant: str) -> list[str]:
    """Documents whose cluster id disagrees with the components of the edges (empty = consistent)."""
    edges = edges_of(conn, tenant)
    stored = clusters_of(conn, tenant)
    linked = {n for e in edges for n in e}
    expected = policy.connected_components(linked, edges)
    return sorted(d for d, c in expected.items() if stored.get(d) != c)


@dataclass(frozen=True)
class Stuck:
    id: str
    tenant: str
    attempts: int
    started_at: datetime


def stuck_in_progress(conn: sa.Connection, older_than: datetime, limit: int = 100) -> list[Stuck]:
    """000's crashed-worker signal: `in-progress` rows whose delivery started before `older_than`."""
    rows = conn.execute(
        sa.select(document.c.id, document.c.tenant, document.c.matching_attempts, document.c.matching_started_at)
        .where(document.c.matching_status == IN_PROGRESS, document.c.matching_started_at < older_than)
        .order_by(document.c.matching_started_at)
        .limit(limit)
    )
    return [Stuck(r.id, r.tenant, r.matching_attempts, r.matching_started_at) for r in rows]


def status_counts(conn: sa.Connection, ids: Iterable[str]) -> dict[str | None, int]:
    rows = conn.execute(sa.select(document.c.matching_status, sa.func.count()).where(
        document.c.id.in_(list(ids))).group_by(document.c.matching_status))
    return {r[0]: r[1] for r in rows}


# ------------------------------------------------------------------------------------ reconciliation


def failed_for_good(conn: sa.Connection, limit: int, since: datetime | None = None) -> list[FinalFailure]:
    """Documents ``failed`` with no dead letter for that failure (the worker marks the document, then
    dead-letters it in a second transaction; a crash between leaves this). See `redrive.reconcile`."""
    query = (sa.select(document.c.id, document.c.tenant, document.c.matching_error, document.c.matching_attempts,
                       document.c.matching_failed_at)
             .where(document.c.matching_status == FAILED, document.c.matching_failed_at.is_not(None),
                    deadletters.unrecorded(policy.PIPELINE, document.c.id, document.c.matching_failed_at)))
    if since is not None:  # ix_document_failed
        query = query.where(document.c.matching_failed_at >= since)
    rows = conn.execute(query.order_by(document.c.matching_failed_at).limit(limit))
    out = []
    for r in rows:
        code = (r.matching_error or "UNKNOWN").split(":", 1)[0].strip() or "UNKNOWN"
        out.append(FinalFailure(
            pipeline=policy.PIPELINE, stage="match", entity_ref=r.id, attempts=r.matching_attempts,
            at=r.matching_failed_at, tenant=r.tenant,
            failure=Failure(code=code[:64], retryable=False, retry_after=None,
                            message="document matching failed for good", detail=r.matching_error or ""),
            context={"reconciled": True}, payload_ref={"table": "document", "document_id": r.id},
        ))
    return out


def retention_rules(settings: Any) -> list[Any]:
    """Settled documents (with their bands and matches) after the matching-document window, counted from
    their last change: they are the corpus new documents are matched against, so the window is long."""
    from redrive.retention import Entity, Rule

    return [Rule("matching.documents", "document", ("id",), "retention_matching_document_days", "t.updated_at",
                 "t.matching_status IN ('succeeded', 'failed')", "settled documents, their bands and matches",
                 entity=Entity("matching", "t.id"))]
