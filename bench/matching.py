"""Matching worker throughput, and candidate retrieval at 10,000 and 100,000 documents.

    python -m bench matching                                   # under the bench stack (make bench runs all)
    BENCH_MATCHING_LARGE=20000 BENCH_MATCHING_SMALL=2000 python -m bench.matching   # smaller, standalone

Two measurements, each with a baseline taken in the same session on the same services:

1. **Documents matched per second** by `Worker.drain` (receive from moto SQS, mark in-progress,
   pre-process, retrieve, ask the sandbox LLM — answering at once —, write phase, delete), against
   the **raw LLM call rate** with the same concurrency and the same prompts: the ratio is how much
   of the LLM's pace the whole per-message flow keeps.
2. **Candidate retrieval** (`retrieve_candidates` + exact re-ranking) for the same query documents,
   with the tenant at N_small and then N_large documents (bulk-loaded with COPY; embeddings computed
   by the production embedder). The ratio large/small says how retrieval grows with the corpus;
   the baseline is an exact scan in numpy over every embedding of the tenant (what "scanning every
   document in Python" costs) at both sizes, and recall@10 says how many of that scan's ten nearest
   the indexed retrieval also returns.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import date, timedelta
from typing import Any

import numpy as np
import sqlalchemy as sa

from assets.matching import ingestion, policy, repository
from assets.matching.worker import Worker, WorkerConfig
from bench._support import machine_cpu, scratch_database
from devstack.sandbox import SandboxClient
from redrive.db import engine_for
from redrive.reliability import Reliability
from redrive.settings import Settings
from resources.llm import LlmResource
from resources.matching import MatchingResource

BENCH_DB = "redrive_bench_matching"
SMALL = int(os.environ.get("BENCH_MATCHING_SMALL", "10000"))
LARGE = int(os.environ.get("BENCH_MATCHING_LARGE", "100000"))
THROUGHPUT_DOCS = int(os.environ.get("BENCH_MATCHING_DOCS", "300"))
QUERIES = int(os.environ.get("BENCH_MATCHING_QUERIES", "200"))
SCAN_QUERIES = int(os.environ.get("BENCH_MATCHING_SCAN_QUERIES", "10"))
BATCH = int(os.environ.get("BENCH_MATCHING_BATCH", "10"))  # issue 14 sets the target at batch size 10
TENANT = "bench-tenant"

_SYLLABLES = "ka lo mi ne ru ta vo ser dan pel tor gin mas bel fur qua zen lin rox dar".split()
_VOCABULARY = ["".join(np.random.default_rng(w).choice(_SYLLABLES, size=2 + w % 2)) for w in range(3000)]
_TYPES = ("invoice", "purchase_order", "delivery_note", "credit_note", "receipt")


def synthetic(i: int, rng: np.random.Generator) -> dict[str, Any]:
    """A corpus where the 3 documents of an order share its number and counterparty (~20 per counterparty)."""
    order = i // 3
    vendor = (order * 7919) % max(1, LARGE // 20)
    words = " ".join(rng.choice(_VOCABULARY, size=8))
    name = f"{_VOCABULARY[vendor % 3000].title()} {_VOCABULARY[(vendor * 31 + 11) % 3000].title()}"
    return {
        "id": f"bench-{i:07d}", "tenant": TENANT, "doc_type": _TYPES[i % len(_TYPES)],
        "counterparty": f"{name} {vendor} GmbH", "references": [f"PO-{order}", f"DOC-{i}"],
        "amount": f"{rng.integers(100, 100000) / 100:.2f}", "currency": "EUR",
        "document_date": date(2025, 1, 1) + timedelta(days=int(rng.integers(0, 400))),
        "text": f"{words} for order {order}",
    }


def _array(values: list[Any]) -> str:
    return "{" + ",".join(str(v) for v in values) + "}"


def bulk_load(engine: sa.Engine, start: int, stop: int) -> float:
    """COPY documents [start, stop) with their pre-processed fields; returns the seconds it took."""
    rng = np.random.default_rng(start)
    began = time.perf_counter()
    buf = io.StringIO()
    for i in range(start, stop):
        d = synthetic(i, rng)
        p = policy.prepare(d)
        fields = [d["id"], d["tenant"], d["doc_type"], d["counterparty"], _array(d["references"]), d["amount"],
                  d["currency"], d["document_date"].isoformat(), d["text"], p.searchable_text,
                  p.normalized_counterparty or "", _array(p.normalized_references),
                  "\\\\x" + policy.to_bytes(p.embedding).hex(), _array(p.bands), "succeeded"]
        buf.write("\t".join(fields) + "\n")
    buf.seek(0)
    raw = engine.raw_connection()
    try:
        with raw.cursor() as cur:
            cur.copy_expert(
                "COPY document (id, tenant, doc_type, counterparty, reference_numbers, amount, currency, "
                "document_date, text, searchable_text, normalized_counterparty, normalized_references, "
                "embedding, embedding_bands, matching_status) FROM STDIN", buf)
        raw.commit()
    finally:
        raw.close()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM ANALYZE document"))
        conn.execute(sa.text("VACUUM ANALYZE document_band"))  # filled by the insert trigger (0302)
    return time.perf_counter() - began


def query_docs(engine: sa.Engine, n: int) -> list[dict[str, Any]]:
    ids = [f"bench-{i:07d}" for i in np.random.default_rng(7).choice(SMALL, size=min(n, SMALL), replace=False)]
    with engine.connect() as conn:
        return [repository.get(conn, i) for i in ids]  # type: ignore[misc]


def time_retrieval(engine: sa.Engine, docs: list[dict[str, Any]]
                   ) -> tuple[list[float], dict[str, set[str]], dict[str, list[str]]]:
    """Per query: seconds for retrieve + exact re-rank, every row retrieved, and the top 10 the LLM would see."""
    prepared = {d["id"]: policy.prepare(d) for d in docs}  # the embedding does not depend on the corpus size
    times, found, shown = [], {}, {}
    with engine.connect() as conn:
        for d in docs:
            began = time.perf_counter()
            rows = repository.retrieve_candidates(conn, d["id"], TENANT, prepared[d["id"]])
            ranked = policy.rank_candidates(prepared[d["id"]], rows, 10)
            times.append(time.perf_counter() - began)
            found[d["id"]] = {c.id for c in rows}
            shown[d["id"]] = [c.id for c in ranked]
    return times, found, shown


def siblings(doc_id: str, size: int) -> set[str]:
    """The other documents of the same order (the true matches of the synthetic corpus)."""
    i = int(doc_id.split("-")[1])
    return {f"bench-{j:07d}" for j in range(3 * (i // 3), 3 * (i // 3) + 3) if j != i and j < size}


def near_duplicate_recall(engine: sa.Engine, docs: list[dict[str, Any]]) -> float:
    """A re-typed copy with a misspelled counterparty and no shared reference: only the LSH path can find it."""
    hits = 0
    with engine.connect() as conn:
        for d in docs:
            typo = (d["counterparty"][:2] + d["counterparty"][3:]).replace(" GmbH", ", Ltd")  # a letter lost
            variant = {**d, "id": f"variant-{d['id']}", "counterparty": typo, "references": [f"X-{d['id']}"]}
            rows = repository.retrieve_candidates(conn, variant["id"], TENANT, policy.prepare(variant))
            hits += d["id"] in {c.id for c in rows}
    return hits / len(docs)


def time_scan(engine: sa.Engine, docs: list[dict[str, Any]]) -> tuple[list[float], dict[str, list[str]]]:
    """Baseline: every embedding of the tenant into Python, exact cosine, top 10."""
    times, nearest = [], {}
    for d in docs:
        query = policy.prepare(d).embedding
        began = time.perf_counter()
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT id, embedding FROM document WHERE tenant = :t AND id <> :id"),
                                {"t": TENANT, "id": d["id"]}).all()
        matrix = np.frombuffer(b"".join(bytes(r.embedding) for r in rows), dtype="<f4").reshape(len(rows), -1)
        scores = matrix @ query
        top = np.argsort(-scores)[:10]
        times.append(time.perf_counter() - began)
        nearest[d["id"]] = [rows[i].id for i in top]
    return times, nearest


def ms(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return f"median {statistics.median(values) * 1000:7.2f} ms, p95 {p95 * 1000:7.2f} ms"


ROUNDS = int(os.environ.get("BENCH_MATCHING_ROUNDS", "3"))


def _stack_cpu() -> dict[str, float]:
    """CPU seconds so far of this process and of its moto and sandbox (PostgreSQL's backends come and go)."""
    import psutil

    me = psutil.Process()
    cpu = {"worker": sum(me.cpu_times()[:2]), "moto": 0.0, "sandbox": 0.0}
    for child in me.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            name = "moto" if "moto" in cmd else "sandbox" if "devstack.sandbox" in cmd else None
            if name:
                cpu[name] += sum(child.cpu_times()[:2])
        except psutil.Error:
            pass
    return cpu


def throughput(url: str, settings: Settings) -> None:
    """ROUNDS interleaved rounds of (raw LLM, moto floor, worker), each on a fresh backlog; medians."""
    engine = engine_for(url)
    sandbox = SandboxClient(os.environ["SANDBOX_URL"])
    sandbox.reset()
    sandbox.set_default("llm", content='{"matches": [{"candidate": 1, "confidence": 0.9, "reason": "bench"}]}')
    llm = LlmResource(base_url=settings.llm_url or "", api_key="bench", timeout_seconds=10)
    runtime = Reliability(engine=engine)
    config = WorkerConfig(batch_size=BATCH)
    in_flight = config.in_flight or 2 * config.batch_size  # what Worker.drain keeps in flight
    import httpx

    rates: dict[str, list[float]] = {"llm": [], "floor": [], "worker": []}
    machine: dict[str, list[float]] = {"llm": [], "worker": []}  # machine CPU ms per LLM call / per document
    cpu_per_doc: dict[str, list[float]] = {}
    calls = matched = 0
    for r in range(ROUNDS):
        session = uuid.uuid4().hex[:8]  # a fresh queue pair: nothing left over from an earlier round
        matching = MatchingResource(endpoint_url=os.environ["AWS_ENDPOINT_URL"],
                                    queue_name=f"bench-matching-{session}", dlq_name=f"bench-matching-{session}-dlq")
        queue = matching.queue()
        queue.ensure()
        rng = np.random.default_rng(11 + r)
        docs = [{**synthetic(i, rng), "id": f"tp{r}-{i:05d}", "tenant": f"bench-throughput-{r}"}
                for i in range(THROUGHPUT_DOCS)]

        # baseline: the same number of LLM calls, the drain's concurrency, prompts of the same shape
        sample = [policy.build_messages(d, []) for d in docs]
        schema = policy.decision_schema(10)
        limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
        with httpx.Client(timeout=10, limits=limits) as http, ThreadPoolExecutor(max_workers=in_flight) as pool:
            began, cpu = time.perf_counter(), machine_cpu()
            list(pool.map(lambda m: llm.chat_json(m, schema, client=http), sample))
            rates["llm"].append(len(sample) / (time.perf_counter() - began))
            machine["llm"].append((machine_cpu() - cpu) / len(sample) * 1000)

        # floor: the same backlog on moto, only received (batch size) and deleted in one batch call, no work
        for i in range(THROUGHPUT_DOCS):
            queue.publish(f"floor-{i}")
        began = time.perf_counter()
        floor = 0
        while batch := queue.receive(config.batch_size, 0):
            queue.client.delete_message_batch(QueueUrl=queue.url, Entries=[
                {"Id": str(k), "ReceiptHandle": m.receipt_handle} for k, m in enumerate(batch)])
            floor += len(batch)
        rates["floor"].append(floor / (time.perf_counter() - began))

        ingestion.ingest(engine, queue, docs)
        worker = Worker(runtime=runtime, queue=queue, llm=llm, config=config, sleep=lambda s: None, log=_Quiet())
        cpu0, machine0 = _stack_cpu(), machine_cpu()
        began = time.perf_counter()
        report = worker.drain(max_batches=10**6, wait_seconds=0)
        elapsed = time.perf_counter() - began
        cpu1, machine1 = _stack_cpu(), machine_cpu()
        done = report.counts.get("succeeded", 0)
        machine["worker"].append((machine1 - machine0) / max(1, done) * 1000)
        matched += done
        calls += sum(o.llm_calls for o in report.outcomes)
        rates["worker"].append(done / elapsed)
        for k in cpu0:
            cpu_per_doc.setdefault(k, []).append((cpu1[k] - cpu0[k]) / max(1, done) * 1000)

    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"throughput: {THROUGHPUT_DOCS} documents per round, {ROUNDS} interleaved rounds, medians "
          f"({matched} matched, {calls} LLM calls, batch size {config.batch_size}, {in_flight} in flight, "
          "one receive at a time)")
    print(f"  worker: {med['worker']:.1f} docs/s  (rounds: {', '.join(f'{v:.1f}' for v in rates['worker'])})")
    print(f"  baseline: raw sandbox LLM calls, same concurrency: {med['llm']:.1f} calls/s  "
          f"(rounds: {', '.join(f'{v:.1f}' for v in rates['llm'])})")
    print(f"  ratio worker docs/s ÷ raw LLM calls/s: {med['worker'] / med['llm']:.2f}  (issue 14 target ≥ 0.5; "
          f"per round: {', '.join(f'{w / b:.2f}' for w, b in zip(rates['worker'], rates['llm'], strict=True))})")
    print(f"  floor: moto SQS alone, receive {config.batch_size} + one DeleteMessageBatch, no work: "
          f"{med['floor']:.1f} msgs/s = {med['floor'] / med['llm']:.2f} × the raw LLM rate; "
          f"worker = {med['worker'] / med['floor']:.2f} × the floor")
    print("  CPU ms per document matched (median of rounds): "
          + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in cpu_per_doc.items()))
    per_call, per_doc = statistics.median(machine["llm"]), statistics.median(machine["worker"])
    cores = os.cpu_count() or 1
    bound = cores * 1000 / per_doc  # docs/s if every core of the machine did nothing but this flow
    print(f"  machine CPU (every process, PostgreSQL, moto and the sandbox included): {per_call:.2f} ms per raw LLM "
          f"call, {per_doc:.2f} ms per document matched; all {cores} cores on the flow would give at most "
          f"{bound:.0f} docs/s = {bound / med['llm']:.2f} × the raw LLM rate")


class _Quiet:
    """The worker's log with info and warning off (the worker passes `extra=` fields, as to a Logger)."""

    def info(self, *_: Any, **__: Any) -> None: ...

    def warning(self, *_: Any, **__: Any) -> None: ...

    def error(self, msg: str, **_: Any) -> None:
        print(msg, file=sys.stderr)


def retrieval(url: str) -> None:
    engine = engine_for(url)
    load_small = bulk_load(engine, 0, SMALL)
    docs = query_docs(engine, QUERIES)
    small_times, _, _ = time_retrieval(engine, docs)
    scan_small, _ = time_scan(engine, docs[:SCAN_QUERIES])
    load_large = bulk_load(engine, SMALL, LARGE)
    large_times, large_found, shown = time_retrieval(engine, docs)
    scan_large, nearest = time_scan(engine, docs[:SCAN_QUERIES])
    recall = statistics.mean(len(set(nearest[i]) & large_found[i]) / 10 for i in nearest)
    sibling_recall = statistics.mean(len(siblings(i, LARGE) & set(top)) / max(1, len(siblings(i, LARGE)))
                                     for i, top in shown.items())
    fuzzy = near_duplicate_recall(engine, docs)
    sizes = [len(f) for f in large_found.values()]
    print(f"bulk load (COPY, embeddings included): {SMALL} docs {load_small:.1f}s; "
          f"{LARGE - SMALL} more {load_large:.1f}s")
    print(f"retrieval at {SMALL:>7,} documents: {ms(small_times)}  ({QUERIES} queries)")
    print(f"retrieval at {LARGE:>7,} documents: {ms(large_times)}  (median {statistics.median(sizes):.0f} "
          f"rows re-ranked)")
    ratio = statistics.median(large_times) / statistics.median(small_times)
    print(f"  ratio {LARGE:,} / {SMALL:,}: {ratio:.2f}× for {LARGE / SMALL:.0f}× the documents  "
          "(issue 14 target ≤ 2.0)")
    scan_ratio = statistics.median(scan_large) / statistics.median(scan_small)
    print(f"  baseline exact scan in numpy: {ms(scan_small)} at {SMALL:,}; {ms(scan_large)} at {LARGE:,} "
          f"(ratio {scan_ratio:.2f}×)")
    print(f"  indexed retrieval vs scan at {LARGE:,}: "
          f"{statistics.median(scan_large) / statistics.median(large_times):.0f}× faster")
    print(f"  quality at {LARGE:,}: same-order documents in the LLM's top 10: {sibling_recall:.2f}; "
          f"near-duplicates found by the LSH path alone: {fuzzy:.2f}; "
          f"scan's 10 nearest by cosine among the retrieved rows: {recall:.2f}")


def main() -> int:
    settings = Settings()
    with scratch_database(BENCH_DB) as url:
        throughput(url, settings)
        retrieval(url)
    return 0


if __name__ == "__main__":
    from devstack.stack import local_stack

    with local_stack("bench", migrate=False):
        sys.exit(main())
