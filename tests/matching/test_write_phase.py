"""000's write phase: one transaction (delete → insert → clusters), safe under concurrent deliveries."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from assets.matching import repository
from assets.matching.policy import Action, Edge
from assets.matching.repository import WriteHooks
from tests.matching.conftest import MATCH_FIRST, TENANT, doc, drop_messages, ingest, prepare, receive_one, row

NOW = datetime(2026, 2, 26, 9, 0, tzinfo=UTC)


class InjectedFailure(RuntimeError):
    """Raised by the test seam between the DELETE and the INSERT."""


def edge(a: str, b: str) -> Edge:
    return Edge(*sorted((a, b)), confidence=0.9, reason="test")


def state(engine) -> tuple[list, dict]:
    with engine.connect() as conn:
        return repository.edges_of(conn, TENANT), repository.clusters_of(conn, TENANT)


@pytest.fixture
def documents(engine, queue):
    """a, b, c, d of one tenant, with the cluster {a, b, c} already written (a–b, b–c)."""
    ingest(engine, queue, *[doc(x) for x in "abcd"])
    drop_messages(queue)
    repository.write_matches(engine, "b", TENANT, [edge("a", "b"), edge("b", "c")], NOW)
    return engine


def fail_after_delete(conn: sa.Connection) -> None:
    # the DELETE ran inside this transaction: the edges are gone as seen from here…
    assert conn.execute(sa.text("SELECT count(*) FROM document_match WHERE 'b' IN (document_a_id, document_b_id)")
                        ).scalar() == 0
    raise InjectedFailure("between delete and insert")


def test_failure_between_delete_and_insert_leaves_previous_state(documents) -> None:
    """The seam raises after the DELETE: edges and cluster ids are exactly as before, status untouched."""
    before = state(documents)
    assert before == ([("a", "b"), ("b", "c")], {"a": "a", "b": "a", "c": "a", "d": None})
    with documents.begin() as conn:
        repository.mark_pending(conn, ["b"])  # re-queued (a succeeded document would stay succeeded)
        repository.mark_in_progress(conn, "b", NOW)  # a new delivery of b is being written
    with pytest.raises(InjectedFailure):
        repository.write_matches(documents, "b", TENANT, [edge("b", "d")], NOW,
                                 WriteHooks(after_delete=fail_after_delete))
    assert state(documents) == before
    assert row(documents, "b")["matching_status"] == "in-progress"  # not marked succeeded either


def test_injected_db_failure_in_the_flow_retries_through_sqs_with_state_intact(
        engine, queue, sandbox, make_worker) -> None:
    """Through the worker: a transient DB error mid-write → previous edges kept, message hidden 5 min."""
    ingest(engine, queue, doc("a"), doc("b"), doc("c"))
    prepare(engine, "a", "c")
    drop_messages(queue)
    repository.write_matches(engine, "b", TENANT, [edge("a", "b")], NOW)
    with engine.begin() as conn:
        repository.mark_pending(conn, ["b"])  # re-queued: a new match of b is wanted
    before = state(engine)

    def deadlock(conn: sa.Connection) -> None:
        conn.execute(sa.text("SELECT 1"))
        raise sa.exc.OperationalError("DELETE …", {}, Exception("deadlock detected"))

    queue.publish("b")
    sandbox.set_default("llm", content=MATCH_FIRST)
    outcome = make_worker(hooks=WriteHooks(after_delete=deadlock)).handle(receive_one(queue))
    assert (outcome.action, outcome.code, outcome.visibility) == (Action.RETRY_LATER, "DB_TRANSIENT", 300)
    assert state(engine) == before
    assert row(engine, "b")["matching_status"] == "pending"


def test_removing_an_edge_splits_the_cluster(documents) -> None:
    """b is re-matched to nothing: a and c lose their link through b, each becomes its own cluster."""
    result = repository.write_matches(documents, "b", TENANT, [], NOW)
    assert result.cluster_id == "b"
    assert state(documents) == ([], {"a": "a", "b": "b", "c": "c", "d": None})


def test_matching_into_a_cluster_merges_it(documents) -> None:
    """d matched to c: the whole cluster {a, b, c} and d share the smallest id."""
    repository.write_matches(documents, "d", TENANT, [edge("c", "d")], NOW)
    edges, clusters = state(documents)
    assert clusters == {"a": "a", "b": "a", "c": "a", "d": "a"}
    with documents.connect() as conn:
        assert repository.cluster_inconsistencies(conn, TENANT) == []


def run_together(*jobs) -> list[BaseException]:
    errors: list[BaseException] = []

    def wrap(job):
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - surfaced to the test
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors


def wait_for_lock_waiter(conn: sa.Connection, timeout: float = 10.0) -> None:
    """Inside the lock holder: block until another session waits for an advisory lock (pg_locks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        waiting = conn.execute(sa.text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())")).scalar()
        if waiting:
            return
        time.sleep(0.01)
    raise AssertionError("the second writer never waited for a cluster lock")


def test_two_documents_joining_one_cluster_concurrently_stay_consistent(documents, engine) -> None:
    """d joins c's cluster while b drops its link to a: the second writer waits for the cluster lock and
    computes clusters from the first one's commit, so d follows c into b's new cluster."""
    entered = threading.Event()

    def first_holds_lock(conn: sa.Connection) -> None:
        if not entered.is_set():
            entered.set()
            wait_for_lock_waiter(conn)  # the second writer is provably blocked while we write

    def first() -> None:
        repository.write_matches(engine, "d", TENANT, [edge("c", "d")], NOW, WriteHooks(after_lock=first_holds_lock))

    def second() -> None:
        entered.wait(10)
        repository.write_matches(engine, "b", TENANT, [edge("b", "c")], NOW)  # b drops its link to a

    assert run_together(first, second) == []
    edges, clusters = state(engine)
    assert edges == [("b", "c"), ("c", "d")]
    assert clusters == {"a": "a", "b": "b", "c": "b", "d": "b"}
    with engine.connect() as conn:
        assert repository.cluster_inconsistencies(conn, TENANT) == []


def test_two_deliveries_of_the_same_document_at_once(engine, queue, sandbox, make_worker) -> None:
    """SQS at-least-once: the same document handled by two threads concurrently ends consistent, succeeded."""
    ingest(engine, queue, doc("x"), doc("y"), doc("z"))
    prepare(engine, "y", "z")
    drop_messages(queue)
    queue.publish("x")
    queue.publish("x")
    sandbox.set_default("llm", content=MATCH_FIRST)
    barrier = threading.Barrier(2, timeout=10)
    worker = make_worker(before_write=lambda document_id: barrier.wait())  # both decided, racing to write
    messages = queue.receive(2, 0)
    assert len(messages) == 2
    outcomes: list = []
    assert run_together(*[lambda m=m: outcomes.append(worker.handle(m)) for m in messages]) == []
    assert sorted(o.action for o in outcomes) == [Action.SUCCEEDED, Action.SUCCEEDED]
    x = row(engine, "x")
    assert (x["matching_status"], x["matching_attempts"]) == ("succeeded", 2)
    with engine.connect() as conn:
        edges = repository.edges_of(conn, TENANT)
        assert len(edges) == 1 and "x" in edges[0]
        assert repository.cluster_inconsistencies(conn, TENANT) == []


def test_writes_on_disjoint_clusters_of_one_tenant_proceed_in_parallel(documents, engine, queue) -> None:
    """The first writer holds its cluster locks until the second, on another cluster of the same tenant,
    has committed: the second never waits (a tenant-wide lock would block it until the guard fails)."""
    ingest(engine, queue, doc("e"))
    second_done = threading.Event()

    def hold_until_second_commits(conn: sa.Connection) -> None:
        if not second_done.wait(20):  # liveness guard only: the second writer is blocked
            raise AssertionError("the write on a disjoint cluster waited for this one's lock")

    def first() -> None:
        repository.write_matches(engine, "d", TENANT, [edge("d", "e")], NOW,
                                 WriteHooks(after_lock=hold_until_second_commits))

    def second() -> None:
        repository.write_matches(engine, "b", TENANT, [edge("a", "b")], NOW)  # b drops its link to c
        second_done.set()

    assert run_together(first, second) == []
    edges, clusters = state(engine)
    assert edges == [("a", "b"), ("d", "e")]
    assert clusters == {"a": "a", "b": "a", "c": "c", "d": "d", "e": "d"}
    with engine.connect() as conn:
        assert repository.cluster_inconsistencies(conn, TENANT) == []


def test_a_split_committed_while_the_other_writer_waits_makes_it_take_the_new_clusters(documents, engine) -> None:
    """b leaves {a, b, c} (a, b, c become three clusters) while d, matched to c, waits for the lock of c's old
    cluster; after the split d's writer locks c's new cluster too and ends consistent: d joins c alone."""
    entered = threading.Event()
    rounds: list[int] = []

    def first_holds_lock(conn: sa.Connection) -> None:
        if not entered.is_set():
            entered.set()
            wait_for_lock_waiter(conn)

    def first() -> None:
        repository.write_matches(engine, "b", TENANT, [], NOW, WriteHooks(after_lock=first_holds_lock))

    def second() -> None:
        entered.wait(10)
        repository.write_matches(engine, "d", TENANT, [edge("c", "d")], NOW,
                                 WriteHooks(after_lock=lambda conn: rounds.append(1)))

    assert run_together(first, second) == []
    edges, clusters = state(engine)
    assert edges == [("c", "d")]
    assert clusters == {"a": "a", "b": "b", "c": "c", "d": "c"}
    assert len(rounds) == 2  # locked {a, d}, found c now in cluster c, rolled back, locked {a, c, d}
    with engine.connect() as conn:
        assert repository.cluster_inconsistencies(conn, TENANT) == []
