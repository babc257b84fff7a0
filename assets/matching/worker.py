"""000's per-message flow, to the letter, on the reliability core.

    Receive message (SQS tracks ApproximateReceiveCount)
    → mark document in-progress (matching_attempts + 1: deliveries, not LLM retries)
    → run matching: pre-process (own commit) → retrieve candidates → LLM decision with in-process
      retries (3 attempts, 2 s → 4 s → 8 s, this call only) → write phase (one transaction)
    → SUCCESS       → succeeded, delete message
    → NON-TRANSIENT → failed, notify admins, delete message
    → TRANSIENT     → receive count 1: visibility 5 min; 2: 30 min;
                      3: failed, notify admins, do not delete → SQS moves it to the DLQ

Classification is the core's (`redrive.vocabularies.MATCHING`: 000's table), the LLM retry loop
is `redrive.retrying.call_with_retries`, the visibility steps `MATCHING_VISIBILITY_BACKOFF` through
the core's settlement (`redrive.settle`: the document's state and, when it failed, its dead letter +
Slack/email alert with document id, tenant, error, attempt count and admin link, in one transaction). Nothing here
returns an empty result on failure: the LLM's answer is a valid decision or an exception.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import sqlalchemy as sa
from pydantic import ValidationError

from assets.matching import policy, repository
from assets.matching.policy import PIPELINE, Action, Embedder, MatchDecision, MatchingMessage, Prepared
from assets.matching.repository import WriteHooks, WriteResult
from redrive import aio, logs, observations, upstreams
from redrive.backoff import MATCHING_LLM_BACKOFF, MATCHING_VISIBILITY_BACKOFF
from redrive.failures import Code, Failure, RetryableError, classify_exception
from redrive.group_commit import GroupCommit
from redrive.engine import Engine
from redrive.reliability import Reliability
from redrive.retrying import acall_with_retries
from redrive.sanitize import sanitize_exception
from redrive.upstream_policy import RetryDeferred
from redrive.settle import Budget, Settled, Verdict, Write, settle
from redrive.vocabularies import MATCHING
from resources.llm import LlmResource
from resources.matching import MatchingQueue, ReceivedMessage

_log = logging.getLogger(__name__)
STAGE = "match"
MAX_HOLDS = 6  # a retry held back by the LLM's retry budget waits about this many budget windows in the worker


def classify(exc: BaseException) -> Failure:
    """000's table: 429/5xx/timeouts/refused/parse/schema transient; context window, 401/403 not."""
    return MATCHING.apply(classify_exception(exc))


@dataclass(frozen=True)
class WorkerConfig:
    max_receive_count: int = 3
    visibility_timeout: int = 60
    visibility_scale: float = 1.0  # multiplies the 5 / 30 minute steps
    llm_max_attempts: int = 3
    candidate_limit: int = 10
    batch_size: int = 5
    in_flight: int | None = None  # documents a drain works at once (a task each, no thread); None: two batches


class _Write(NamedTuple):
    write: repository.Write
    started: float  # perf_counter when the delivery's match began (the stage's latency)


class Retrieved(NamedTuple):
    prepared: Prepared
    candidates: list[policy.Candidate]


@dataclass(frozen=True)
class Outcome:
    """What one delivery did; `action` None means the flow itself broke and the message was left alone."""

    message_id: str
    document_id: str | None
    action: Action | None
    receive_count: int
    code: str | None = None
    visibility: int | None = None  # seconds set with ChangeMessageVisibility
    deleted: bool = False
    llm_calls: int = 0
    edges: int = 0
    dead_letter_id: int | None = None


@dataclass(frozen=True)
class DrainReport:
    outcomes: list[Outcome]
    batches: int

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(str(o.action) if o.action else "unhandled" for o in self.outcomes))

    @property
    def unhandled(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.action is None]


Delivery = Callable[[], Awaitable[Outcome]]


class _Batch:
    """A received batch, admitted once (parsed, marked in one statement, pre-processed and retrieved) on an I/O
    thread by the first of its deliveries to start, while the engine receives the next batch."""

    def __init__(self, worker: Worker, messages: list[ReceivedMessage]) -> None:
        self.worker, self.messages = worker, messages
        self._admitted: asyncio.Future[list[Delivery]] | None = None

    async def delivery(self, index: int) -> Delivery:
        if self._admitted is None:
            self._admitted = asyncio.ensure_future(asyncio.to_thread(self.worker.admit_safely, self.messages))
        return (await asyncio.shield(self._admitted))[index]


class _Received(NamedTuple):
    batch: _Batch
    index: int


class _Queue:
    """The matching queue as the core engine's source: a claim is a ReceiveMessage of a batch, once a batch's worth of
    slots is free (a batch budget counts receives, so a run's `max_batches` are whole batches).

    Short polls while messages come; after an empty one, long polls. The queue empty after a long poll with
    nothing in flight, or `max_batches` received, and the drain claims no more: while documents are in flight
    it keeps polling, so a producer's pause shorter than the run's work ends no run (each run's start costs the
    sensor's interval and a process). Nothing to keep: a delivery waiting on the LLM's retries extends its own
    message's visibility (`decide`), and SQS, not this run, decides when a message is due again."""

    def __init__(self, worker: Worker, max_batches: int, wait_seconds: int) -> None:
        self.worker, self.max_batches, self.wait_seconds = worker, max_batches, wait_seconds
        self.batches, self.poll, self.empty = 0, 0, False

    def claim(self, limit: int, held: list[_Received]) -> list[_Received]:
        size = self.worker.config.batch_size
        if self.stopped() or limit < size:  # a batch's worth of slots, or no receive: batches stay whole
            return []
        while not (messages := self.worker.queue.receive(size, self.poll)):
            if self.poll == self.wait_seconds:  # empty after the long poll: done, once what it holds is
                self.empty = not held
                return []
            self.poll = self.wait_seconds
        self.poll, self.batches = 0, self.batches + 1
        batch = _Batch(self.worker, messages)
        return [_Received(batch, i) for i in range(len(messages))]

    def keep(self, held: list[_Received]) -> None:
        return None

    def next_due_in(self) -> float | None:
        return None

    def stopped(self) -> bool:
        return self.empty or self.batches >= self.max_batches

    def released(self, item: _Received) -> None:
        return None


@dataclass
class Worker:
    runtime: Reliability
    queue: MatchingQueue
    llm: LlmResource
    config: WorkerConfig = field(default_factory=WorkerConfig)
    admin_link: Callable[[str, str | None], str] = lambda doc, tenant: f"/admin/documents/{doc}"
    # the in-process LLM backoff, awaited (a coroutine function) or a test's recorder; the caller scales it
    sleep: Callable[[float], Awaitable[None] | None] = asyncio.sleep
    embedder: Embedder = policy.DEFAULT_EMBEDDER
    hooks: WriteHooks = field(default_factory=WriteHooks)
    before_write: Callable[[str], None] = lambda document_id: None  # test seam, outside the transaction
    run_id: str | None = None
    log: Any = _log
    _writes: GroupCommit[_Write, WriteResult] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # the write phases of the deliveries that finish together leave in one transaction (group commit)
        self._writes = GroupCommit(self._write_group, limit=max(1, self.config.in_flight or 2 * self.config.batch_size))

    # -- the drain loop --------------------------------------------------------------------

    def drain(self, *, max_batches: int, wait_seconds: int = 0) -> DrainReport:
        """Receive batches until the queue answers empty (after its long poll) or the batch budget is spent.

        The core's engine (`redrive.engine`) over the queue: up to `config.in_flight` documents at once, each a
        task that holds no thread while it waits on the LLM, its database and SQS calls on the run's I/O threads.
        A batch is received only when a batch's worth of slots is free, so no message waits in a buffer while
        its 60 s visibility runs, and none waits out its visibility behind another's LLM retries. Each batch's
        documents are marked in one statement; deletes and visibility changes of concurrent deliveries leave in
        batch calls (`MatchingQueue`). A receive that fails (SQS down) fails the drain, after the work in flight.
        """
        size = self.config.batch_size
        outcomes: list[Outcome] = []

        async def work(received: _Received) -> None:
            deliver = await received.batch.delivery(received.index)
            outcomes.append(await deliver())

        engine: Engine[_Received] = Engine(name="matching", concurrency=max(size, self.config.in_flight or 2 * size),
                                           batch_size=size, linger_seconds=0, max_seconds=math.inf)
        batches = asyncio.run(engine.drain(_Queue(self, max_batches, wait_seconds), work))
        return DrainReport(outcomes, batches)

    def handle_safely(self, message: ReceivedMessage) -> Outcome:
        """The flow's own bookkeeping failed (database or SQS down): leave the message; SQS redelivers it."""
        return _once(lambda: self.admit_safely([message])[0]())

    def admit_safely(self, messages: list[ReceivedMessage]) -> list[Delivery]:
        """`admit`, with each delivery's bookkeeping failure reported as an outcome (message left for SQS)."""
        def left(message: ReceivedMessage, exc: Exception) -> Outcome:
            failure = classify(exc)
            self.log.error(f"matching: message {message.message_id} left for redelivery: "
                           f"{failure.code}: {failure.message}")
            return Outcome(message.message_id, None, None, message.receive_count, code=failure.code)

        def safely(message: ReceivedMessage, deliver: Delivery) -> Delivery:
            async def run() -> Outcome:
                try:
                    return await deliver()
                except Exception as exc:  # noqa: BLE001 - reported in the run's outcome and log
                    return left(message, exc)
            return run

        try:
            admitted = self.admit(messages)
        except Exception as exc:  # noqa: BLE001 - the batch's mark failed: every message stays in SQS
            return [_now(lambda m=m, e=exc: left(m, e)) for m in messages]
        return [safely(m, d) for m, d in zip(messages, admitted, strict=True)]

    # -- one delivery ------------------------------------------------------------------------

    def handle(self, message: ReceivedMessage) -> Outcome:
        """One delivery start to finish, on a loop of its own (tests, tools)."""
        return _once(lambda: self.admit([message])[0]())

    def admit(self, messages: list[ReceivedMessage]) -> list[Delivery]:
        """Parse a received batch, mark its documents in progress (one statement, committed), then
        pre-process them (one statement, committed on its own as 000 says) and retrieve their
        candidates on the same connection; one delivery each (a coroutine), which asks the LLM and writes."""
        bodies: list[MatchingMessage | ValidationError] = []
        for message in messages:
            try:
                bodies.append(MatchingMessage.model_validate_json(message.body))
            except ValidationError as exc:
                bodies.append(exc)
        ids = [b.document_id for b in bodies if isinstance(b, MatchingMessage)]
        marked: list[dict[str, Any] | None] = []
        if ids:
            with self.runtime.engine.begin() as conn:
                marked = repository.mark_deliveries(conn, ids, self.runtime.now())
        ready = self._prepare_and_retrieve([d for d in marked if d is not None])
        docs = iter(marked)
        out: list[Delivery] = []
        for message, body in zip(messages, bodies, strict=True):
            if isinstance(body, ValidationError):
                out.append(_blocking(lambda m=message, e=body: self._quarantine(m, e)))
            else:
                doc = next(docs)
                out.append(lambda m=message, b=body, d=doc, r=ready.get(doc["id"]) if doc else None:
                           self._deliver(m, b, d, r))
        return out

    def _prepare_and_retrieve(self, docs: list[dict[str, Any]]) -> dict[str, Retrieved]:
        """The batch's pre-processing and retrieval on one connection. A document whose pre-processing
        fails, or all of them if the database does, is left out: its delivery does both itself (and
        meets the failure there, where it is classified and decided on)."""
        prepared: dict[str, Prepared] = {}
        for doc in docs:
            try:
                prepared[doc["id"]] = policy.prepare(doc, self.embedder)
            except Exception:  # noqa: BLE001 - raised again by the document's own delivery
                continue
        if not prepared:
            return {}
        try:
            with self.runtime.engine.connect() as conn:
                with conn.begin():
                    repository.save_prepared_many(conn, sorted(prepared.items()))
                return {doc_id: Retrieved(p, repository.retrieve_candidates(conn, doc_id, doc["tenant"], p))
                        for doc in docs if (p := prepared.get(doc_id := doc["id"])) is not None}
        except Exception as exc:  # noqa: BLE001 - each delivery retries it alone
            self.log.warning(f"matching: batch pre-processing failed ({classify(exc).code}); per document instead")
            return {}

    async def _deliver(self, message: ReceivedMessage, body: MatchingMessage, doc: dict[str, Any] | None,
                       ready: Retrieved | None = None) -> Outcome:
        """000's flow from `in-progress` on: match, then delete, or decide on the failure. Only the LLM is
        awaited on the loop; the database and SQS are called on the run's I/O threads."""
        if doc is None:
            return await asyncio.to_thread(self._not_found, message, body)
        calls = [0]
        started = time.perf_counter()
        try:
            edges = await self.match(doc, message, calls, ready, started=started)
        except Exception as exc:  # noqa: BLE001 - every failure is classified and decided on
            return await asyncio.to_thread(self._after_failure, message, doc, classify(exc), exc, calls[0],
                                           time.perf_counter() - started)
        return await asyncio.to_thread(self._succeeded, message, doc, edges, calls[0])

    def _not_found(self, message: ReceivedMessage, body: MatchingMessage) -> Outcome:
        failure = MATCHING.apply(Failure.of(Code.NOT_FOUND, message="document not found"))
        letter = self._settle(body.document_id, None, failure, message, attempts=message.receive_count,
                              stack="").dead_letter_id
        deleted = self._sqs(lambda: self.queue.delete(message.receipt_handle), f"delete of {body.document_id}")
        return Outcome(message.message_id, body.document_id, Action.FAILED, message.receive_count,
                       code=failure.code, deleted=deleted, dead_letter_id=letter)

    def _succeeded(self, message: ReceivedMessage, doc: dict[str, Any], edges: int, llm_calls: int) -> Outcome:
        # the process's log, as the drain's "done" line: in the run's own log (Dagster's event log) a line per
        # document was a row and a new PostgreSQL connection each, and 10,000 lines hid its failures
        _log.info(f"matching: {doc['id']} matched ({edges} edges)", extra=self._fields(doc, message.receive_count))
        if doc["matching_error"] is not None:  # it failed before: close its (replayed) dead letter, if any
            self.runtime.succeeded(PIPELINE, doc["id"])
        deleted = self._sqs(lambda: self.queue.delete(message.receipt_handle), f"delete after success of {doc['id']}")
        return Outcome(message.message_id, doc["id"], Action.SUCCEEDED, message.receive_count,
                       deleted=deleted, llm_calls=llm_calls, edges=edges)

    async def match(self, doc: dict[str, Any], message: ReceivedMessage | None, calls: list[int],
                    ready: Retrieved | None = None, *, started: float | None = None) -> int:
        """Pre-process (committed on its own), retrieve, decide, write; returns the number of edges.
        `ready`: pre-processing and retrieval already done for the batch (`admit`). The write phase
        goes with those of the other deliveries writing at the same moment (`_write_group`), and
        with the stage's observations (timed from `started`)."""
        prepared, found = ready if ready is not None else await asyncio.to_thread(self._prepare, doc)
        candidates = policy.rank_candidates(prepared, found, self.config.candidate_limit)
        decision = await self.decide(doc, candidates, message, calls) if candidates else MatchDecision(matches=[])
        edges = policy.edges_from(doc["id"], decision, candidates)
        write = _Write(repository.Write(doc["id"], doc["tenant"], edges),
                       time.perf_counter() if started is None else started)
        await asyncio.to_thread(self._write, doc["id"], write)
        return len(edges)

    def _prepare(self, doc: dict[str, Any]) -> Retrieved:
        """One document's pre-processing (committed on its own) and retrieval, when its batch's failed."""
        prepared = policy.prepare(doc, self.embedder)
        with self.runtime.engine.begin() as conn:
            repository.save_prepared(conn, doc["id"], prepared)
        with self.runtime.engine.connect() as conn:
            return Retrieved(prepared, repository.retrieve_candidates(conn, doc["id"], doc["tenant"], prepared))

    def _write(self, document_id: str, write: _Write) -> None:
        self.before_write(document_id)
        self._writes(write)

    def _write_group(self, writes: list[_Write]) -> list[WriteResult | Exception]:
        """000's write phases of several deliveries in one transaction, with their `ok` and `done`
        observations (one upsert each). If that transaction fails, each write goes alone, so one
        delivery's failure (a vanished document, clusters that keep changing, a database error) is
        its own and the others commit as they would have alone."""
        def observe(conn: sa.Connection, group: list[_Write]) -> None:
            now = time.perf_counter()
            observations.observe_many(conn, PIPELINE, STAGE, observations.OK, [now - w.started for w in group])
            observations.observe(conn, PIPELINE, STAGE, observations.DONE, count=len(group))

        if len(writes) > 1:
            try:
                return list(repository.write_matches_many(
                    self.runtime.engine, [w.write for w in writes], self.runtime.now(), self.hooks,
                    then=lambda conn: observe(conn, writes)))
            except Exception as exc:  # noqa: BLE001 - each write again alone, where its failure is its own
                self.log.info(f"matching: a group of {len(writes)} write phases failed ({classify(exc).code}); "
                              "each alone")
        out: list[WriteResult | Exception] = []
        for w in writes:
            try:
                out.extend(repository.write_matches_many(self.runtime.engine, [w.write], self.runtime.now(),
                                                         self.hooks, then=lambda conn, w=w: observe(conn, [w])))
            except Exception as exc:  # noqa: BLE001 - raised to its own delivery
                out.append(exc)
        return out

    async def decide(self, doc: dict[str, Any], candidates: list[policy.Candidate], message: ReceivedMessage | None,
                     calls: list[int]) -> MatchDecision:
        """llm-match-decision: a valid decision or an exception, with 000's in-process retries; the call and the
        waits between calls are awaited, so a document waiting on the LLM holds no thread."""
        messages = policy.build_messages(doc, candidates)
        schema = policy.decision_schema(len(candidates))

        async def ask() -> MatchDecision:
            calls[0] += 1
            return await self.llm.achat_json(messages, schema)

        async def heartbeat() -> None:
            if message is not None:  # keep the message hidden while we wait
                try:
                    await asyncio.to_thread(self.queue.change_visibility, message.receipt_handle,
                                            self.config.visibility_timeout)
                except Exception:  # noqa: BLE001 - a missed heartbeat costs a duplicate delivery, not data
                    self.log.warning(f"matching: visibility heartbeat for {doc['id']} failed")

        async def on_retry(failure: Failure, attempt: int, delay: float) -> None:
            self.log.info(f"matching: {doc['id']} LLM attempt {attempt}/{self.config.llm_max_attempts} "
                          f"{failure.code}; retrying in {delay:g}s (unscaled)")
            await heartbeat()

        rng = self.runtime.rng_for(f"{PIPELINE}:{doc['id']}:llm:{doc['matching_attempts']}")
        holds = [0]

        async def hold(deferred: RetryDeferred) -> None:
            """The LLM's retry budget is spent: this retry waits here, the message kept hidden, and spends
            neither an LLM attempt nor a delivery (SQS would count a delivery toward the DLQ). Held MAX_HOLDS
            times (a budget that stays spent), it ends the in-process retries as a long Retry-After does, and
            000's visibility step takes over."""
            calls[0] -= 1  # nothing was sent
            holds[0] += 1
            if holds[0] > MAX_HOLDS:
                raise RetryableError(Failure.of(
                    Code.RATE_LIMITED, message="the LLM's retry budget stayed spent",
                    retry_after=MATCHING_LLM_BACKOFF.retry_after_ceiling + deferred.wait)) from deferred
            self.log.info(f"matching: {doc['id']} retry held back by the LLM's retry budget")
            await heartbeat()
            await self._pause(deferred.due_after(rng))

        # 000 as written: a Retry-After longer than the in-process backoff honours ends these retries;
        # the visibility step (5 / 30 min) takes over. A redelivery's first call is a retry to the LLM too.
        with upstreams.retrying(doc["matching_attempts"] > 1):
            return await acall_with_retries(ask, classify=classify, policy=MATCHING_LLM_BACKOFF,
                                            max_attempts=self.config.llm_max_attempts, sleep=self._pause, rng=rng,
                                            on_retry=on_retry, max_server_delay=MATCHING_LLM_BACKOFF.retry_after_ceiling,
                                            on_deferred=hold)

    async def _pause(self, seconds: float) -> None:
        """The in-process backoff through `sleep`: awaited, or a test's recorder that returns at once."""
        waited = self.sleep(seconds)
        if inspect.isawaitable(waited):
            await waited

    # -- after a failure -----------------------------------------------------------------------

    def _fields(self, doc: dict[str, Any], attempt: int, failure: Failure | None = None) -> dict[str, Any]:
        """What every line about one document carries (JSON logs, `redrive.logs`)."""
        return logs.fields(pipeline=PIPELINE, entity=doc["id"], stage=STAGE, attempt=attempt, run_id=self.run_id,
                           error_class=failure.code if failure is not None else None)

    def _after_failure(self, message: ReceivedMessage, doc: dict[str, Any], failure: Failure,
                       exc: BaseException, llm_calls: int, seconds: float | None = None) -> Outcome:
        """The core settles the delivery; the document's state is decided on its status as it is now
        (row locked) and recorded with the dead letter in one transaction, then SQS carries it out."""
        base = dict(message_id=message.message_id, document_id=doc["id"], receive_count=message.receive_count,
                    code=failure.code, llm_calls=llm_calls)
        deliveries: list[policy.Delivery] = []

        def record(conn: sa.Connection, verdict: Verdict) -> bool:
            delivery = policy.delivery(verdict.decision, status=repository.lock_status(conn, doc["id"]))
            deliveries.append(delivery)
            if delivery.action is Action.DUPLICATE:
                return False  # the result stays; no retry, no dead letter
            mark = repository.mark_waiting if delivery.action is Action.RETRY_LATER else repository.mark_failed
            mark(conn, doc["id"], verdict.error[:500], verdict.now)
            return True

        settled = self._settle(doc["id"], doc["tenant"], failure, message, attempts=doc["matching_attempts"],
                               stack=sanitize_exception(exc), llm_calls=llm_calls, record=record,
                               outcome=lambda: str(deliveries[0].action))
        delivery = deliveries[0]
        if delivery.action is Action.DUPLICATE:
            deleted = self._sqs(lambda: self.queue.delete(message.receipt_handle),
                                f"delete of a duplicate of {doc['id']}")
            self.log.info(f"matching: {doc['id']} already succeeded; a duplicate delivery failed ({failure.code}), "
                          "result kept, message deleted")
            return Outcome(action=Action.DUPLICATE, deleted=deleted, **base)
        if delivery.action is Action.RETRY_LATER:
            self.runtime.observe(PIPELINE, STAGE, observations.RETRY, error_class=failure.code, seconds=seconds)
            visible = policy.visibility_seconds(delivery.delay, self.config.visibility_scale)
            self._sqs(lambda: self.queue.change_visibility(message.receipt_handle, visible),
                      f"visibility step of {doc['id']}")
            self.log.info(f"matching: {doc['id']} delivery {message.receive_count} {failure.code}; "
                          f"visible again in {visible}s", extra=self._fields(doc, message.receive_count, failure))
            return Outcome(action=Action.RETRY_LATER, visibility=visible, **base)

        letter = settled.dead_letter_id
        if delivery.action is Action.FAILED:
            deleted = self._sqs(lambda: self.queue.delete(message.receipt_handle),
                                f"delete after failure of {doc['id']}")
            self.log.warning(f"matching: {doc['id']} failed ({failure.code}, non-transient); alerted, message deleted",
                             extra=self._fields(doc, message.receive_count, failure))
            return Outcome(action=Action.FAILED, deleted=deleted, dead_letter_id=letter, **base)
        # Last delivery: keep the message. Visible at once, so the next receive moves it to the DLQ
        # (redrive policy) instead of 60 s from now.
        self._sqs(lambda: self.queue.change_visibility(message.receipt_handle, 0), f"release of {doc['id']}")
        self.log.warning(f"matching: {doc['id']} failed after {message.receive_count} deliveries ({failure.code}); "
                         "alerted, message left for the DLQ", extra=self._fields(doc, message.receive_count, failure))
        return Outcome(action=Action.LEFT_FOR_DLQ, visibility=0, dead_letter_id=letter, **base)

    def _sqs(self, call: Callable[[], None], what: str) -> bool:
        """Carry out the decision on the message. The document's state is already recorded; if SQS refuses
        (a receipt handle gone stale after a long delivery), the message comes back and the next delivery
        repeats an idempotent outcome, so a failure here is logged, not raised."""
        try:
            call()
            return True
        except Exception as exc:  # noqa: BLE001 - at-least-once covers it
            failure = classify(exc)
            self.log.warning(f"matching: SQS {what} failed ({failure.code}); the message will be delivered again")
            return False

    def _settle(self, document_id: str, tenant: str | None, failure: Failure, message: ReceivedMessage, *,
                attempts: int, stack: str, llm_calls: int = 0, record: Write | None = None,
                outcome: Callable[[], str] = lambda: "failed") -> Settled:
        """One delivery of a document settled by the core under 000's visibility steps (the receive count is
        the attempt); without `record`, failed for good now. The final case is one dead letter and one
        Slack/email alert with document id, tenant, error, attempt count and admin link."""
        return settle(
            self.runtime, pipeline=PIPELINE, stage=STAGE, entity_ref=document_id, failure=failure,
            attempt=message.receive_count, budget=Budget(self.config.max_receive_count, MATCHING_VISIBILITY_BACKOFF),
            jitter_key=f"{PIPELINE}:{document_id}:delivery:{message.receive_count}",
            on_retry=record, on_final=record or _nothing_to_write, link=self.admin_link(document_id, tenant),
            final=lambda verdict: verdict.final_failure(
                attempts=attempts, tenant=tenant, stack=stack,
                context={"receive_count": message.receive_count, "sqs_message_id": message.message_id,
                         "llm_calls": llm_calls, "outcome": outcome(), "queue": self.queue.queue_name},
                payload_ref={"table": "document", "document_id": document_id, "sqs_message_id": message.message_id},
                stage_attempts={"match": attempts}, run_id=self.run_id),
        )

    def _quarantine(self, message: ReceivedMessage, exc: ValidationError) -> Outcome:
        """Not a matching message at all: no delivery can fix it. Kept in the DLQ now, dead letter + alert."""
        failure = MATCHING.apply(Failure.of(
            Code.DATA_ERROR, message="malformed matching message (expected {\"document_id\": …})", detail=str(exc)))
        self.queue.move_to_dlq(message, f"{failure.code}: malformed matching message")
        settled = settle(
            self.runtime, pipeline=PIPELINE, stage="receive", entity_ref=f"sqs-message:{message.message_id}",
            failure=failure, attempt=message.receive_count, budget=Budget(1, MATCHING_VISIBILITY_BACKOFF),
            on_retry=None, on_final=_nothing_to_write,
            final=lambda verdict: verdict.final_failure(
                context={"queue": self.queue.queue_name, "moved_to": self.queue.dlq_name},
                payload_ref={"queue": self.queue.dlq_name, "sqs_message_id": message.message_id},
                run_id=self.run_id),
        )
        return Outcome(message.message_id, None, Action.QUARANTINED, message.receive_count, code=failure.code,
                       deleted=True, dead_letter_id=settled.dead_letter_id)


def _nothing_to_write(conn: sa.Connection, verdict: Verdict) -> bool:
    """No state of its own to write: the dead letter is the record."""
    return True


def _blocking(fn: Callable[[], Outcome]) -> Delivery:
    """A delivery that is only database and SQS calls (a malformed message): on an I/O thread."""
    async def run() -> Outcome:
        return await asyncio.to_thread(fn)
    return run


def _now(fn: Callable[[], Outcome]) -> Delivery:
    """A delivery already decided (its batch's mark failed): nothing to wait for."""
    async def run() -> Outcome:
        return fn()
    return run


def _once(deliver: Callable[[], Awaitable[Outcome]]) -> Outcome:
    """One delivery on a loop of its own, whose clients close with it."""
    async def run() -> Outcome:
        try:
            return await deliver()
        finally:
            await aio.close_loop_locals()
    return asyncio.run(run())
