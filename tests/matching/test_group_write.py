"""Issue 14, matching at speed: the write phases of deliveries that finish together share one transaction
(group commit), with exactly the result of writing them one after another; a failing one fails alone."""

from __future__ import annotations

import random
import threading
import time
from datetime import UTC, datetime

import sqlalchemy as sa

from assets.matching import policy, repository
from assets.matching.policy import Action, Edge
from assets.matching.repository import Write, WriteHooks
from tests.matching.conftest import NO_MATCH, doc, drop_messages, ingest, row

NOW = datetime(2026, 2, 26, 9, 0, tzinfo=UTC)


def edge(a: str, b: str) -> Edge:
    return Edge(*sorted((a, b)), confidence=0.9, reason=f"{a}-{b}")


def state(engine: sa.Engine, tenant: str, prefix: str) -> tuple[list, dict]:
    """Edges and clusters of a tenant with the id prefix removed, to compare two tenants' histories."""
    def strip(x: str | None) -> str | None:
        return None if x is None else x.removeprefix(prefix)
    with engine.connect() as conn:
        edges = sorted((strip(a), strip(b)) for a, b in repository.edges_of(conn, tenant))
        clusters = {strip(d): strip(c) for d, c in repository.clusters_of(conn, tenant).items()}
    return edges, clusters


def test_a_group_write_leaves_what_the_same_writes_one_after_another_leave(engine, queue) -> None:
    """Random histories (documents written twice, edges between documents of the group, existing
    clusters merged and split): one group transaction ends in the state of the sequential writes."""
    rng = random.Random(14)
    names = [f"n{i}" for i in range(8)]
    for round_ in range(6):
        one, group = f"s{round_}-", f"g{round_}-"
        ingest(engine, queue, *[doc(one + n, tenant=f"seq-{round_}") for n in names],
               *[doc(group + n, tenant=f"grp-{round_}") for n in names])
        history = []
        for _ in range(3):  # what was there before
            d = rng.choice(names)
            history.append((d, rng.sample([n for n in names if n != d], rng.randint(0, 2))))
        writes = []
        for _ in range(rng.randint(2, 6)):  # the group; a document may come twice
            d = rng.choice(names)
            writes.append((d, rng.sample([n for n in names if n != d], rng.randint(0, 3))))
        for p, tenant in ((one, f"seq-{round_}"), (group, f"grp-{round_}")):
            for d, others in history:
                repository.write_matches(engine, p + d, tenant, [edge(p + d, p + o) for o in others], NOW)
        for d, others in writes:
            repository.write_matches(engine, one + d, f"seq-{round_}", [edge(one + d, one + o) for o in others], NOW)
        results = repository.write_matches_many(
            engine, [Write(group + d, f"grp-{round_}", [edge(group + d, group + o) for o in others])
                     for d, others in writes], NOW)
        assert state(engine, f"grp-{round_}", group) == state(engine, f"seq-{round_}", one), (history, writes)
        assert [r.edges for r in results] == [len(others) for _, others in writes]
        with engine.connect() as conn:
            assert repository.cluster_inconsistencies(conn, f"grp-{round_}") == []
    drop_messages(queue)


def test_surviving_edges_are_those_no_later_write_of_either_end_replaced() -> None:
    """b written after a drops a's edge to b; a written twice keeps its last edges only."""
    writes = [Write("a", "t", [edge("a", "b"), edge("a", "c")]), Write("b", "t", [edge("b", "d")]),
              Write("a", "t", [edge("a", "c"), edge("a", "e")])]
    assert [(e.a, e.b) for e in repository.surviving_edges(writes)] == [("a", "c"), ("a", "e"), ("b", "d")]
    writes = [Write("a", "t", [Edge("a", "b", 0.9, "a's")]), Write("b", "t", [Edge("a", "b", 0.8, "b's")])]
    assert [(e.a, e.b, e.reason) for e in repository.surviving_edges(writes)] == [("a", "b", "b's")]


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, **_: object) -> None:
        self.lines.append(msg)

    warning = error = info


def test_a_failing_write_in_a_group_fails_alone_and_the_others_commit(engine, queue, sandbox, make_worker) -> None:
    """Three deliveries: the first write goes alone (held until two more wait), the other two leave
    together; one of those two documents vanished, so the group's transaction fails — each is then
    written alone: the other one succeeds, the vanished one is that delivery's failure only."""
    ingest(engine, queue, doc("x"), doc("y", counterparty="Other AG"), doc("w", counterparty="Third KG"))
    sandbox.set_default("llm", content=NO_MATCH)
    in_flight = threading.Event()
    log = Log()
    worker = make_worker(log=log)

    def before_write(document_id: str) -> None:
        if document_id == "w":  # w writes after x or y is already writing, so goes in the second group
            assert in_flight.wait(10)
            with engine.begin() as conn:
                conn.execute(sa.text("DELETE FROM document WHERE id = 'w'"))

    def after_lock(conn: sa.Connection) -> None:
        if not in_flight.is_set():  # the first write: hold it until the two others wait behind it
            in_flight.set()
            deadline = time.monotonic() + 10
            while worker._writes.pending < 2 and time.monotonic() < deadline:
                time.sleep(0.005)

    worker.before_write, worker.hooks = before_write, WriteHooks(after_lock=after_lock)
    report = worker.drain(max_batches=1)
    actions = {o.document_id: o.action for o in report.outcomes}
    assert actions["x"] == actions["y"] == Action.SUCCEEDED
    assert actions["w"] not in (Action.SUCCEEDED, None)
    assert [line for line in log.lines if "a group of 2 write phases failed" in line]
    assert row(engine, "x")["matching_status"] == row(engine, "y")["matching_status"] == "succeeded"


def test_save_prepared_many_writes_what_save_prepared_writes(engine, queue) -> None:
    """The batch's one statement stores the same pre-processing as one update per document, also for
    references with quotes, braces and backslashes, and a document without counterparty."""
    odd = ['PO-"1"', "{DOC},2", "back\\slash", "ü-ß"]
    ingest(engine, queue, doc("p1", references=odd, text="same"), doc("p2", references=odd, text="same"),
           doc("q1", counterparty="", references=[], text="same"), doc("q2", counterparty="", references=[], text="same"))
    drop_messages(queue)
    prepared = {d: policy.prepare(row(engine, d)) for d in ("p1", "p2", "q1", "q2")}
    with engine.begin() as conn:
        repository.save_prepared(conn, "p1", prepared["p1"])
        repository.save_prepared(conn, "q1", prepared["q1"])
        repository.save_prepared_many(conn, [("p2", prepared["p2"]), ("q2", prepared["q2"])])
    columns = ("searchable_text", "normalized_counterparty", "normalized_references", "embedding", "embedding_bands")
    for one, many in (("p1", "p2"), ("q1", "q2")):
        a, b = row(engine, one), row(engine, many)
        assert [a[c] if c != "embedding" else bytes(a[c]) for c in columns] \
            == [b[c] if c != "embedding" else bytes(b[c]) for c in columns]
    assert row(engine, "p2")["normalized_references"] and row(engine, "q2")["embedding"] is not None
