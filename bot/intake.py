"""The hot path's one writer: group commit for the receiver's deliveries, the worker's finished
jobs and its claims, all in one SQLite transaction per round.

Everything that arrives while a round is being written goes into the next one. A request still
gets its 202 only after its delivery is durably in SQLite, and a job is leased before it runs
and recorded done after; but under load one commit serves many requests and many jobs, instead
of each kind of write taking its turn at the store's lock. The worker's claim rides along in
every round, so a delivery is usually leased in the very transaction that records it, and its
job gets the payload the receiver parsed rather than parsing it again.

The rounds are written one after the other by one thread (which hands each to the writer
process of ``bot/round_writer.py`` when there is one, and waits for it without the GIL), and it
starts the next round as soon as one is committed: the event loop only hands items over and
takes the results back (one callback per round), so a busy loop does not hold up the commits
that its requests wait for. It hands them over once per pass of the loop, not one by one:
whatever the loop's callbacks submitted in one pass (a dozen requests under load) is one round,
rather than a round for each request that happens to come while the thread holds the GIL.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Protocol

from bot.round_writer import RoundWriter, WriterGone
from bot.store import Claim, Delivery, Job, Store

log = logging.getLogger("dejafix.intake")

__all__ = ["Claimer", "Delivery", "Intake"]

Parsed = dict[str, Any] | None


class Claimer(Protocol):
    """The worker, as the intake sees it."""

    def claim_request(self) -> Claim | None:
        """What to lease in the round about to be written (None: nothing now). Called in the
        intake's thread; ``leased`` follows in that thread once the round is committed."""

    def leased(self, count: int) -> None:
        """``count`` jobs were leased for the claim just requested (in the intake's thread)."""

    def take(self, jobs: list[tuple[Job, Parsed]]) -> None:
        """Jobs leased for it, each with its payload when the receiver parsed it (on the
        loop)."""

    def claim_failed(self, exc: Exception) -> None:
        """The claim could not be written; it is asked again in a later round (on the loop)."""


_Round = tuple[list[tuple[Delivery, Parsed, asyncio.Future[bool]]],
               list[tuple[int, asyncio.Future[bool]]]]


class Intake:
    def __init__(self, store: Store, max_batch: int = 256,
                 writer: RoundWriter | None = None, min_interval: float = 0.0) -> None:
        self.store = store
        # Seconds from the start of one round to the start of the next. A worker process
        # beside a receiver process shares the database's write lock with it: fewer, larger
        # rounds leave the lock to the rounds that GitHub's requests wait for.
        self.min_interval = min_interval
        # The rounds' writer process (bot/round_writer.py); None: this process writes them.
        self.writer = writer
        self.max_batch = max_batch
        self.claimer: Claimer | None = None
        # Shared with the writer thread: everything below, under _lock.
        self._lock = threading.Lock()
        self._deliveries: list[tuple[Delivery, Parsed, asyncio.Future[bool]]] = []
        self._completions: list[tuple[int, asyncio.Future[bool]]] = []
        self._kicked = False
        self._writing = False
        # Loop side: what was submitted since the last hand-over, and whether one is scheduled.
        self._new_deliveries: list[tuple[Delivery, Parsed, asyncio.Future[bool]]] = []
        self._new_completions: list[tuple[int, asyncio.Future[bool]]] = []
        self._new_kick = False
        self._handover_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None

    async def accept(self, delivery: Delivery, parsed: Parsed = None) -> bool:
        """True if the delivery is new (now recorded with its job), False for a redelivery.
        ``parsed``: the payload parsed from the delivery's body, for its job."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._new_deliveries.append((delivery, parsed, future))
        self._schedule()
        # A caller that is cancelled (a client that hangs up) cancels only its own future:
        # the delivery is still recorded (and a redelivery of it will be recognised).
        return await future

    def complete(self, job_id: int) -> asyncio.Future[bool]:
        """Record a job done in the next round; the future says whether it was still open."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._new_completions.append((job_id, future))
        self._schedule()
        return future

    def kick(self) -> None:
        """Write a round even with nothing else to write: the claimer wants jobs."""
        self._new_kick = True
        self._schedule()

    async def flush(self) -> None:
        """Wait until everything submitted so far is written and its results handed back (at
        shutdown, before the store closes)."""
        while self._handover_scheduled or (self._idle is not None and not self._idle.is_set()):
            if self._handover_scheduled:
                await asyncio.sleep(0)
            else:
                assert self._idle is not None
                await self._idle.wait()

    def _schedule(self) -> None:
        if not self._handover_scheduled:
            self._handover_scheduled = True
            asyncio.get_running_loop().call_soon(self._hand_over)

    def _hand_over(self) -> None:
        self._handover_scheduled = False
        with self._lock:
            self._deliveries += self._new_deliveries
            self._completions += self._new_completions
            self._kicked = self._kicked or self._new_kick
            start = not self._writing
            self._writing = True
        self._new_deliveries = []
        self._new_completions = []
        self._new_kick = False
        if start:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
                self._idle = asyncio.Event()
            assert self._idle is not None
            self._idle.clear()
            self._loop.run_in_executor(None, self._write_rounds)

    # -- in the writer thread ---------------------------------------------------------------

    def _write_rounds(self) -> None:
        loop = self._loop
        assert loop is not None
        last = 0.0
        try:
            while True:
                if self.min_interval > 0:
                    wait = last + self.min_interval - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)  # this thread's own; the loop is not waiting on it
                with self._lock:
                    deliveries = self._deliveries[: self.max_batch]
                    del self._deliveries[: self.max_batch]
                    completions = self._completions[: self.max_batch]
                    del self._completions[: self.max_batch]
                    kicked, self._kicked = self._kicked, False
                    if not deliveries and not completions and not kicked:
                        self._writing = False
                        break
                claim = self._claim_request()
                if not deliveries and not completions and claim is None:
                    continue
                last = time.monotonic()
                try:
                    self._write_round((deliveries, completions), claim, loop)
                except Exception as exc:
                    # Whatever went wrong, no request may be left waiting for its answer.
                    log.exception("intake: a round could not be written")
                    loop.call_soon_threadsafe(self._hand_back, (deliveries, completions),
                                              [exc] * len(deliveries), [exc] * len(completions),
                                              [])
        except BaseException:
            with self._lock:
                self._writing = False
            log.exception("intake: the writer stopped")
            raise
        finally:
            loop.call_soon_threadsafe(self._went_idle)

    def _claim_request(self) -> Claim | None:
        if self.claimer is None:
            return None
        try:
            return self.claimer.claim_request()
        except Exception:
            log.exception("intake: no jobs leased in this round")
            return None

    def _write_round(self, batch: _Round, claim: Claim | None,
                     loop: asyncio.AbstractEventLoop) -> None:
        deliveries, completions = batch
        commit = self.writer.commit_round if self.writer is not None else self.store.commit_round
        try:
            accepted, done, jobs = commit(
                [d for d, _, _ in deliveries], [job_id for job_id, _ in completions], claim)
        except WriterGone as exc:
            log.error("intake: %s; this process writes the rounds from now on", exc)
            self.writer = None
            self._one_by_one(batch, claim, loop)
            return
        except Exception:
            # One bad row must not fail the others: write each part on its own.
            log.warning("intake: a round of %d deliveries and %d finished jobs failed; "
                        "writing them one by one", len(deliveries), len(completions))
            self._one_by_one(batch, claim, loop)
            return
        if claim is not None and self.claimer is not None:
            self.claimer.leased(len(jobs))
        loop.call_soon_threadsafe(self._hand_back, batch, accepted, done,
                                  self._pair(jobs, deliveries))

    @staticmethod
    def _pair(jobs: list[Job], deliveries: list[tuple[Delivery, Parsed, asyncio.Future[bool]]]
              ) -> list[tuple[Job, Parsed]]:
        # A job recorded in this round carries the very body object of its delivery: only then
        # is what the receiver parsed from that body its payload (a redelivery under the same
        # id, with whatever body, never stands in for the delivery that was recorded). Both
        # objects are alive here, so their ids cannot collide.
        parsed = {id(d[5]): p for d, p, _ in deliveries if p is not None}
        return [(job, parsed.get(id(job.payload))) for job in jobs]

    def _one_by_one(self, batch: _Round, claim: Claim | None,
                    loop: asyncio.AbstractEventLoop) -> None:
        deliveries, completions = batch
        accepted: list[bool | BaseException] = []
        for delivery, _, _ in deliveries:
            try:
                accepted.append(self.store.accept_delivery(*delivery))
            except Exception as exc:
                accepted.append(exc)
        done: list[bool | BaseException] = []
        for job_id, _ in completions:
            try:
                done.append(self.store.complete_job(job_id))
            except Exception as exc:
                done.append(exc)
        jobs: list[Job] = []
        failure: Exception | None = None
        if claim is not None:
            try:
                jobs = self.store.claim_jobs(claim.lease_seconds, claim.limit,
                                             fresh_extra=claim.fresh_extra,
                                             exclude=claim.exclude)
            except Exception as exc:
                failure = exc
            if self.claimer is not None:
                self.claimer.leased(len(jobs))
        unparsed: list[tuple[Job, Parsed]] = [(job, None) for job in jobs]
        loop.call_soon_threadsafe(self._hand_back, batch, accepted, done, unparsed, failure)

    # -- back on the loop -------------------------------------------------------------------

    def _hand_back(self, batch: _Round, accepted: list[Any], done: list[Any],
                   jobs: list[tuple[Job, Parsed]], failure: Exception | None = None) -> None:
        deliveries, completions = batch
        for (_, _, future), result in zip(deliveries, accepted, strict=True):
            _settle(future, result)
        for (_, future), result in zip(completions, done, strict=True):
            _settle(future, result)
        if self.claimer is not None:
            if failure is not None:
                self.claimer.claim_failed(failure)
            if jobs:
                self.claimer.take(jobs)

    def _went_idle(self) -> None:
        with self._lock:
            writing = self._writing
        if not writing and self._idle is not None:
            self._idle.set()


def _settle(future: asyncio.Future[bool], result: bool | BaseException) -> None:
    if future.done():  # its caller went away (a client that hung up)
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
