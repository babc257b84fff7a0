"""One partition's run: claim → score → write, chunk by chunk, with each user's failure handled alone.

ADR-0004 runs one job per user; at 100,000 users a statement per user is the cost, so a chunk of
users shares each statement while every user keeps its own job row, outcome and dead letter:

* **claim** — the ADR's upsert for the whole chunk; completed users are not returned, so they are
  never recomputed (their `completed_at` never moves); failed or interrupted ones are retried.
* **score** — vectorized over the chunk (policy.compute_offers); a user with an invalid profile is a
  *data inconsistency*, a user whose offers break an invariant a *logic error*: neither is retried.
* **write** — offers and `completed` in one transaction, so a kill leaves a user either done or
  untouched, never half-written.

Transient database errors and timeouts are retried in-process through the core's loop
(`call_with_retries`) at 30 s, 2 min, 5 min (× `time_scale`). A chunk that fails permanently is
split to find the users it belongs to; one that keeps failing transiently fails all its users. A
user that fails for good gets its job marked `failed` and exactly one dead letter and alert, settled
by the core in one transaction (`redrive.settle`, entity `{date}:{timezone}:{user_id}`). No Dagster here: the asset,
the tests and the benchmark drive the same code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import sqlalchemy as sa

from assets.matchmaking import policy, repository
from assets.matchmaking.policy import Offers, Partition, Pool, ScoringWeights
from redrive import logs, observations
from redrive.backoff import MATCHMAKING_BACKOFF
from redrive.clock import Sleep
from redrive.failures import Code, Failure, RedriveError
from redrive.reliability import Reliability
from redrive.retrying import call_with_retries
from redrive.sanitize import sanitize_exception
from redrive.settle import settle
from redrive.stages import StagePolicy
from redrive.vocabularies import MATCHMAKING

T = TypeVar("T")

# 001 "Retry Policy": transient DB errors and timeouts 3 retries at 30 s, 2 min, 5 min (4 attempts in
# all); logic errors and data inconsistencies none. A unique or foreign-key violation is data here
# (a second set of offers, a vanished candidate), never a race to retry: the upsert has no race.
POLICY = StagePolicy(max_attempts=4, backoff=MATCHMAKING_BACKOFF, vocabulary=MATCHMAKING, integrity="data")


@dataclass(frozen=True)
class Knobs:
    """The settings a partition run needs (from `MatchmakingSettings`)."""

    daily_offer_count: int = 3
    seed: str = "yoked-matchmaking"
    offer_hour: int = 9
    chunk_size: int = 2000
    pair_budget: int = 262_144
    batch_pause_seconds: float = 0.0
    lock_timeout_ms: int = 10_000
    statement_timeout_ms: int = 120_000

    @classmethod
    def from_settings(cls, settings: Any) -> Knobs:
        return cls(**{f: getattr(settings, f) for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class UserFailure:
    user_id: str
    stage: str
    failure: Failure
    attempts: int
    stack: str = ""


@dataclass
class Outcome:
    """What one run did to its partition: the ADR's metrics and who failed."""

    partition: Partition
    algorithm_version: str
    pool_size: int = 0
    invalid_profiles: int = 0
    targeted: int = 0
    claimed: int = 0
    completed: int = 0
    completed_elsewhere: int = 0  # another run of the partition finished them first
    already_completed: int = 0  # completed before this run: returned, not recomputed
    offers_written: int = 0
    retries: int = 0
    failed: dict[str, str] = field(default_factory=dict)  # user id -> error code
    dead_letters_created: int = 0
    dead_letters_closed: int = 0
    chunk_seconds: list[tuple[float, int]] = field(default_factory=list)  # (duration, users claimed)
    duration_seconds: float = 0.0

    @property
    def job_p95_seconds(self) -> float:
        """A user's job lasts as long as its chunk: p95 over users, not over chunks."""
        return policy.p95([s for s, n in self.chunk_seconds for _ in range(n)])

    def metadata(self) -> dict[str, Any]:
        codes: dict[str, int] = {}
        for code in self.failed.values():
            codes[code] = codes.get(code, 0) + 1
        return {
            "date": self.partition.date.isoformat(),
            "timezone": self.partition.timezone,
            "algorithm_version": self.algorithm_version,
            "eligible_users": self.pool_size,
            "invalid_profiles": self.invalid_profiles,
            "users_processed": self.claimed,
            "jobs_completed": self.completed,
            "jobs_failed": len(self.failed),
            "jobs_already_completed": self.already_completed,
            "jobs_completed_by_another_run": self.completed_elsewhere,
            "failures_by_code": codes,
            "offers_written": self.offers_written,
            "retries": self.retries,
            "dead_letters_created": self.dead_letters_created,
            "dead_letters_closed": self.dead_letters_closed,
            "duration_seconds": round(self.duration_seconds, 3),
            "job_duration_p95_seconds": round(self.job_p95_seconds, 3),
        }


class PartitionRun:
    """Runs one partition (or some of its users) against the database, through the reliability core."""

    def __init__(self, runtime: Reliability, partition: Partition, knobs: Knobs, weights: ScoringWeights, *,
                 run_id: str | None = None, log: logging.Logger | Any | None = None, sleep: Sleep = time.sleep,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.runtime = runtime
        self.partition = partition
        self.knobs = knobs
        self.weights = weights
        self.run_id = run_id
        self.log = log or logging.getLogger(__name__)
        self.sleep = sleep
        self.monotonic = monotonic
        self.backoff = POLICY.backoff.scaled(runtime.time_scale)
        self.offered_at, self.expires_at = partition.offer_window(knobs.offer_hour)

    # ------------------------------------------------------------------------------------ the run

    def run(self, pool: Pool, only_users: Sequence[str] | None = None) -> Outcome:
        """Offers for every user of the pool not yet done (or for `only_users`, a replay's)."""
        started = self.monotonic()
        out = Outcome(self.partition, self.weights.algorithm_version, pool_size=len(pool),
                      invalid_profiles=len(pool.problems))
        index = pool.index()
        if only_users is None:
            targets = list(range(len(pool)))
        else:
            wanted = sorted(set(only_users))
            targets = sorted(index[u] for u in wanted if u in index)
            self._not_in_pool(out, [u for u in wanted if u not in index])
        out.targeted = len(targets)
        size = self.knobs.chunk_size
        for start in range(0, len(targets), size):
            if start and self.knobs.batch_pause_seconds:
                self.sleep(self.knobs.batch_pause_seconds)
            self._chunk(out, pool, index, targets[start:start + size], replay=only_users is not None)
        out.duration_seconds = self.monotonic() - started
        return out

    def _chunk(self, out: Outcome, pool: Pool, index: dict[str, int], rows: list[int], *, replay: bool) -> None:
        started = self.monotonic()
        ids = [str(pool.ids[i]) for i in rows]
        claimed, failures = self._batch(out, "claim", ids, self._claim)
        untouched = set(ids) - {c.user_id for c in claimed} - {f.user_id for f in failures}  # completed before
        out.claimed += len(claimed)
        out.already_completed += len(untouched)

        good = []
        for i in sorted(index[c.user_id] for c in claimed):
            if pool.valid[i]:
                good.append(i)
            else:
                failure = MATCHMAKING.apply(Failure.of(Code.DATA_ERROR,
                                                       message=f"profile invalid: {pool.problems[i]}"))
                failures.append(UserFailure(str(pool.ids[i]), "validate", failure, 1))
        offers, broken = self._score(pool, good)
        failures.extend(broken)
        broken_rows = {index[f.user_id] for f in broken}
        good = [i for i in good if i not in broken_rows]

        rows_by_user = policy.offer_rows(pool, offers.only(good), self.partition.date)
        documents = {u: policy.offers_document(rows_by_user.get(u, ())) for u in (str(pool.ids[i]) for i in good)}
        done, write_failures = self._batch(out, "write", sorted(documents),
                                           lambda users: self._write(users, rows_by_user, documents))
        failures.extend(write_failures)
        self.runtime.observe(policy.PIPELINE, "chunk", observations.OK, seconds=self.monotonic() - started)
        self.runtime.observe(policy.PIPELINE, "write", observations.DONE, count=len(done))
        self.log.info(f"{self.partition.entity_ref}: chunk of {len(ids)} users, {len(done)} completed",
                      extra=logs.fields(pipeline=policy.PIPELINE, entity=self.partition.entity_ref, stage="chunk",
                                        run_id=self.run_id))
        out.completed += len(done)
        out.completed_elsewhere += len(documents) - len(done) - len(write_failures)
        out.offers_written += sum(len(rows_by_user.get(u, ())) for u in done)
        self._settle(out, failures)

        # Work that completed closes its dead letter: users that had failed before, and replayed users found done.
        closing = {c.user_id for c in claimed if c.previous_error is not None} & set(done)
        if replay:
            closing |= untouched
        for user_id in sorted(closing):
            if self.runtime.succeeded(policy.PIPELINE, self.partition.user_ref(user_id)) is not None:
                out.dead_letters_closed += 1
        out.chunk_seconds.append((self.monotonic() - started, len(claimed)))

    # ----------------------------------------------------------------------------------- the stages

    def _claim(self, users: Sequence[str]) -> list[repository.Claimed]:
        with self.runtime.engine.begin() as conn:
            repository.set_timeouts(conn, self.knobs.lock_timeout_ms, self.knobs.statement_timeout_ms)
            return repository.claim(conn, self.partition.date, self.partition.timezone, users)

    def _score(self, pool: Pool, rows: list[int]) -> tuple[Offers, list[UserFailure]]:
        """Vectorized offers for the chunk; if that raises, user by user to find whom it is about."""
        def compute(targets: list[int]) -> Offers:
            return policy.compute_offers(pool, targets, day=self.partition.date, seed=self.knobs.seed,
                                         weights=self.weights, k=self.knobs.daily_offer_count,
                                         pair_budget=self.knobs.pair_budget)

        broken: list[UserFailure] = []
        try:
            offers = compute(rows)
        except Exception:  # noqa: BLE001 - a bug met someone's data: isolate it, keep the others
            parts = []
            for i in rows:
                try:
                    parts.append(compute([i]))
                except Exception as exc:  # noqa: BLE001 - classified below, never retried
                    broken.append(UserFailure(str(pool.ids[i]), "score", POLICY.classify(exc), 1,
                                              sanitize_exception(exc)))
            offers = Offers.concat(parts)
        violations = policy.offer_invariant_violations(pool, offers, self.knobs.daily_offer_count)
        for i, why in sorted(violations.items()):
            failure = MATCHMAKING.apply(Failure.of(Code.INVARIANT_VIOLATION,
                                                   message=f"offers break an invariant: {why}"))
            broken.append(UserFailure(str(pool.ids[i]), "score", failure, 1))
        return offers, broken

    def _write(self, users: Sequence[str], rows_by_user: dict[str, list[policy.OfferRow]],
               documents: dict[str, str]) -> list[str]:
        with self.runtime.engine.begin() as conn:
            repository.set_timeouts(conn, self.knobs.lock_timeout_ms, self.knobs.statement_timeout_ms)
            return repository.complete(
                conn, self.partition.date, self.partition.timezone,
                {u: rows_by_user.get(u, []) for u in users}, {u: documents[u] for u in users},
                algorithm_version=self.weights.algorithm_version, offered_at=self.offered_at,
                expires_at=self.expires_at)

    # ----------------------------------------------------------------------------- failure handling

    def _retrying(self, out: Outcome, stage: str, users: Sequence[str], fn: Callable[[], T]) -> T:
        def on_retry(failure: Failure, attempt: int, delay: float) -> None:
            out.retries += 1
            self.runtime.observe(policy.PIPELINE, stage, observations.RETRY, error_class=failure.code)
            self.log.warning(f"{self.partition.entity_ref} {stage} of {len(users)} users, attempt "
                             f"{attempt}/{POLICY.max_attempts}: {failure.code}: {failure.message}; "
                             f"retrying in {delay:.3f}s", extra=logs.fields(
                                 pipeline=policy.PIPELINE, entity=self.partition.entity_ref, stage=stage,
                                 attempt=attempt, error_class=failure.code, run_id=self.run_id))

        return call_with_retries(fn, classify=POLICY.classify, policy=self.backoff, max_attempts=POLICY.max_attempts,
                                 sleep=self.sleep, on_retry=on_retry,
                                 rng=self.runtime.rng_for(f"{self.partition.entity_ref}:{stage}:{users[0]}"))

    def _batch(self, out: Outcome, stage: str, users: Sequence[str],
               fn: Callable[[Sequence[str]], list[T]]) -> tuple[list[T], list[UserFailure]]:
        """`fn` over the chunk under the retry policy; a permanent failure is split user by user."""
        if not users:
            return [], []
        try:
            return self._retrying(out, stage, users, lambda: fn(users)), []
        except RedriveError as exc:
            if exc.failure.retryable or len(users) == 1:  # retries exhausted: every user of the chunk
                stack = sanitize_exception(exc.__cause__ or exc)
                return [], [UserFailure(u, stage, exc.failure, exc.attempts or 1, stack) for u in users]
        self.log.warning(f"{self.partition.entity_ref} {stage}: a permanent error in a chunk of {len(users)} "
                         f"users; isolating it user by user")
        results: list[T] = []
        failures: list[UserFailure] = []
        for user in users:
            try:
                results.extend(self._retrying(out, stage, [user], lambda u=user: fn([u])))
            except RedriveError as exc:
                failures.append(UserFailure(user, stage, exc.failure, exc.attempts or 1,
                                            sanitize_exception(exc.__cause__ or exc)))
        return results, failures

    def _not_in_pool(self, out: Outcome, users: list[str]) -> None:
        """Replayed users that are not active in this timezone any more: done already, or a data problem."""
        if not users:
            return
        with self.runtime.engine.connect() as conn:
            status = repository.job_statuses(conn, self.partition.date, users)
        failures = []
        for user_id in users:
            if status.get(user_id) == "completed":
                if self.runtime.succeeded(policy.PIPELINE, self.partition.user_ref(user_id)) is not None:
                    out.dead_letters_closed += 1
                continue
            failure = MATCHMAKING.apply(Failure.of(
                Code.NOT_FOUND, message="user is not an active user of this timezone any more"))
            failures.append(UserFailure(user_id, "claim", failure, 1))
        self._settle(out, failures, mark=False)  # no job row in a timezone the user is not in

    def _settle(self, out: Outcome, failures: list[UserFailure], *, mark: bool = True) -> None:
        """Each user failed for good through the core: its job `failed`, one dead letter and alert, in one
        transaction (the core dedupes repeats); a job completed meanwhile gets neither."""
        for f in failures:
            ref = self.partition.user_ref(f.user_id)
            settled = settle(
                self.runtime, pipeline=policy.PIPELINE, stage=f.stage, entity_ref=ref, failure=f.failure,
                attempt=f.attempts, budget=POLICY, on_retry=None,  # the in-process retries are spent
                on_final=lambda conn, verdict, user=f.user_id: not mark or user in repository.mark_failed(
                    conn, self.partition.date, self.partition.timezone, {user: verdict.error}),
                final=lambda verdict, f=f: verdict.final_failure(
                    stack=f.stack, stage_attempts={f.stage: f.attempts}, run_id=self.run_id,
                    context={"date": self.partition.date.isoformat(), "timezone": self.partition.timezone,
                             "user_id": f.user_id, "dagster_run_id": self.run_id},
                    payload_ref={"table": "matchmaking_jobs", "date": self.partition.date.isoformat(),
                                 "user_id": f.user_id}),
            )
            if settled.recorded is None:  # completed meanwhile by another run, or deleted: nothing to redo
                self.log.info(f"{ref} {f.stage}: {f.failure.code}, but the job is completed by another run or the "
                              f"user was deleted; no dead letter")
                continue
            out.failed[f.user_id] = f.failure.code
            out.dead_letters_created += int(settled.recorded.created)
            self.log.error(f"{ref} {f.stage}: {f.failure.code}: {f.failure.message}; "
                           f"dead letter {settled.dead_letter_id}", extra=logs.fields(
                               pipeline=policy.PIPELINE, entity=ref, stage=f.stage, attempt=f.attempts,
                               error_class=f.failure.code, run_id=self.run_id))


def load_pool(engine: sa.Engine, partition: Partition) -> Pool:
    """The partition's user pool as policy arrays."""
    with engine.connect() as conn:
        frame = repository.load_pool(conn, partition.date, partition.timezone)
    return policy.build_pool(frame)
