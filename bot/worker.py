"""The worker: takes jobs from the durable queue and runs the handlers for each, up to
``workers`` at once. A failed job is retried with backoff; a job whose process died is picked up
again after its lease (``Store.recover`` at startup does it at once).

Under load most jobs need no waiting at all (a repository without clusters, a config already
cached), so the per-job costs that are not the handlers' are shared: jobs are leased in batches
(one transaction for many), each of the ``workers`` lanes runs job after job without a new task
for each, and finished jobs are recorded done by a group commit."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import threading
import time
import weakref
from typing import Any

import gidgethub
from gidgethub.sansio import Event

from bot.github import DryRunRepoClient, OfflineRepoClient, RepoClient
from bot.handlers import HandlerFailures, dispatch
from bot.handlers.context import Context, Services
from bot.intake import Intake
from bot.metrics import Metrics, event_label, issue_number, log_context, metrics_scope
from bot.payloads import parse_json
from bot.store import Claim, Job

log = logging.getLogger("dejafix.worker")

LEASE_SECONDS = 300.0
# A job is cut off well inside its lease, so no job is ever handed out twice while still running.
JOB_TIMEOUT = LEASE_SECONDS / 2
POLL_SECONDS = 1.0
# A worker process without a receiver beside it (``serve --role worker``) is not handed the
# jobs its receiver records: it asks the queue this often instead, so a delivery waits at most
# this long for a free lane.
WORKER_POLL_SECONDS = 0.2
PRUNE_EVERY = 3600.0
# Finished deliveries are kept this long; a redelivery within it is recognised and not redone.
KEEP_DONE_SECONDS = 14 * 24 * 3600.0
# Jobs leased ahead of a free lane, all never run before (``Store.claim_jobs``): one claim
# serves a burst. They wait in memory as they would have waited in the queue, and are given
# back (``Store.release_jobs``) if the worker stops first.
MAX_AHEAD = 256
# A lane running job after job without waiting yields to the event loop after this long, so
# that the receiver keeps answering while a burst is worked off.
LANE_SLICE = 0.001


def retry_delay(attempts: int, base: float = 5.0) -> float:
    """Capped exponential backoff with jitter, so a GitHub outage does not end in a stampede."""
    return float(min(600.0, base * 3.0 ** (attempts - 1)) * random.uniform(0.8, 1.2))


def _refused(exc: BaseException) -> bool:
    errors = exc.errors if isinstance(exc, HandlerFailures) else [exc]
    return any(isinstance(e, gidgethub.BadRequest) and e.status_code in (401, 403)
               for e in errors)


def _parse(job: Job) -> dict[str, Any] | None:
    """The job's payload, parsed once for the log context and the handlers; None when it does
    not parse (``process`` then fails on it as before)."""
    try:
        data = parse_json(job.payload)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


class Worker:
    def __init__(self, services: Services, wakeup: asyncio.Event, concurrency: int,
                 metrics: Metrics | None = None, intake: Intake | None = None,
                 poll_seconds: float = POLL_SECONDS) -> None:
        self.services = services
        self.poll_seconds = poll_seconds
        self.metrics = metrics if metrics is not None else Metrics()
        self.wakeup = wakeup
        self.concurrency = concurrency
        # Claims and completions go through the same group commit as the receiver's
        # deliveries (one transaction per round for all three).
        self.intake = intake if intake is not None else Intake(services.store)
        self.intake.claimer = self
        # The lanes: at most ``concurrency`` tasks, each running one job at a time, taken from
        # ``_ready``. Empty when there is nothing to do (tests wait for that).
        self.running: set[asyncio.Task[None]] = set()
        # The intake's thread asks what to lease (claim_request) while the loop runs jobs: what
        # both read is changed under this lock.
        self._claim_lock = threading.Lock()
        self._ready: collections.deque[tuple[Job, dict[str, Any] | None]] = collections.deque()
        self._lanes = 0  # lanes started and not yet finished
        self._busy = 0  # lanes in the middle of a job
        self._in_flight = 0  # leased in a round whose jobs have not reached take() yet
        self._asked = (0, 0)  # (limit, ahead) of the claim being written
        self._maybe_more = True  # the queue may hold due jobs that no claim has taken
        # Jobs leased and not yet recorded finished: never claimed again by this worker.
        self._held: set[int] = set()
        # Two deliveries for one issue (opened and edited in the same second) must not both
        # find "no comment yet" and both post: they run one after the other.
        self._issue_locks: weakref.WeakValueDictionary[tuple[str, int], asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )
        self._last_prune = 0.0
        self.alive = True
        self.stopping = False
        self.retry_base = services.config.retry_base

    def _stopped(self) -> bool:
        # A method, not the attribute inline: stop() flips it while run() awaits.
        return self.stopping

    def retry_delay(self, attempts: int) -> float:
        return retry_delay(attempts, self.retry_base)

    # -- leasing jobs (called by the intake, around each round it writes) --------------------

    def claim_request(self) -> Claim | None:
        with self._claim_lock:
            if self.stopping:
                return None
            waiting = len(self._ready) + self._in_flight
            # Lanes without a job waiting for them may take any job (retries too); beyond
            # that, only jobs never run before are leased ahead (Store.claim_jobs says why).
            limit = max(0, self.concurrency - self._busy - waiting)
            ahead = max(0, MAX_AHEAD - waiting - limit)
            if limit + ahead == 0:
                self._maybe_more = True
                return None
            self._asked = (limit, ahead)
            return Claim(LEASE_SECONDS, limit, ahead, frozenset(self._held))

    def leased(self, count: int) -> None:
        with self._claim_lock:
            self._in_flight += count
            limit, ahead = self._asked
            # Due jobs may have been left: as many came as were asked for, or retries could
            # not come at all (no lane free for them).
            self._maybe_more = count >= limit + ahead or limit == 0

    def take(self, jobs: list[tuple[Job, dict[str, Any] | None]]) -> None:
        with self._claim_lock:
            self._in_flight -= len(jobs)
            self._held.update(job.id for job, _ in jobs)
            self._ready.extend(jobs)
        if not self.stopping:  # stop() gives them back
            self._start_lanes()

    def claim_failed(self, exc: Exception) -> None:
        # A locked or full database must not end the worker: the next poll asks again.
        log.error("worker: cannot read the queue (%s: %s); retrying", type(exc).__name__, exc)

    def _want_jobs(self, poll: bool = False) -> None:
        """Ask for a round that leases jobs when lanes are free and the queue may hold due
        jobs that no round has leased yet (or on the periodic poll, for retries come due)."""
        if (not self.stopping and (poll or self._maybe_more)
                and self._busy + len(self._ready) + self._in_flight < self.concurrency):
            self.intake.kick()

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Poll for due jobs (retries, and any the rounds did not lease) every second. Leased
        jobs arrive through ``take``."""
        try:
            while not self._stopped():
                self.wakeup.clear()
                self._want_jobs(poll=True)
                try:
                    await self._maybe_prune()
                except Exception:
                    log.exception("worker: could not prune finished deliveries")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), timeout=self.poll_seconds)
        finally:
            self.alive = False

    def _start_lanes(self) -> None:
        # Counted by _lanes, not len(running): a lane that has just found nothing more to do
        # is gone for this purpose even before its task is discarded from ``running``.
        idle = self._lanes - self._busy
        for _ in range(min(self.concurrency - self._lanes, len(self._ready) - idle)):
            self._lanes += 1
            lane = asyncio.create_task(self._lane())
            self.running.add(lane)
            lane.add_done_callback(self.running.discard)

    async def _lane(self) -> None:
        try:
            # The handlers count into this app's metrics: set once for all the lane's jobs (a
            # task's context is its own, and tasks the handlers start inherit it).
            with metrics_scope(self.metrics):
                await self._run_lane()
        finally:
            self._lanes -= 1
        self._want_jobs()

    async def _run_lane(self) -> None:
        slice_started = time.perf_counter()
        while self._ready and not self.stopping:
            with self._claim_lock:
                job, data = self._ready.popleft()
                self._busy += 1
            try:
                await self._run_job(job, data)
            finally:
                with self._claim_lock:
                    self._busy -= 1
            if time.perf_counter() - slice_started > LANE_SLICE:
                await asyncio.sleep(0)
                slice_started = time.perf_counter()

    async def stop(self, drain_seconds: float = 0.0) -> int:
        """Stop taking jobs, let the running ones finish for up to ``drain_seconds``, cancel the
        rest (their jobs stay leased and run again after the next start). Returns how many
        were left unfinished, counting the jobs leased but not started, which are given back
        at once."""
        self.stopping = True
        self.wakeup.set()
        # A round in flight may still lease jobs (take() does not start them).
        await self.intake.flush()
        with self._claim_lock:
            unstarted = [job for job, _ in self._ready]
            self._ready.clear()
        released = await self._release(unstarted)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_seconds
        while self.running and (remaining := deadline - loop.time()) > 0:
            await asyncio.wait(list(self.running), timeout=remaining)
        left = self._busy
        for lane in list(self.running):
            lane.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)
        # Jobs whose handlers are done only wait for their commit: it is not cancelled.
        await self.intake.flush()
        return left + released

    async def _release(self, jobs: list[Job]) -> int:
        """Give back jobs leased but never started."""
        if not jobs:
            return 0
        with self._claim_lock:
            self._held.difference_update(job.id for job in jobs)
        try:
            await asyncio.to_thread(self.services.store.release_jobs, [job.id for job in jobs])
        except Exception:
            log.exception("worker: could not give back %d unstarted jobs; they run at the "
                          "next start", len(jobs))
        return len(jobs)

    async def _maybe_prune(self) -> None:
        now = time.monotonic()
        if now - self._last_prune < PRUNE_EVERY:
            return
        self._last_prune = now
        removed = await asyncio.to_thread(self.services.store.prune, KEEP_DONE_SECONDS)
        if removed:
            log.info("store: pruned %d finished deliveries", removed)

    def _lock_for(self, job: Job, data: dict[str, Any]) -> asyncio.Lock:
        issue = data.get("issue") or data.get("pull_request") or {}
        number = issue.get("number") if isinstance(issue, dict) else None
        key = ((job.repo or "").lower(), number if isinstance(number, int) else -1)
        lock = self._issue_locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self._issue_locks[key] = lock
        return lock

    async def _run_job(self, job: Job, data: dict[str, Any] | None = None) -> None:
        if data is None:
            data = _parse(job)
        # Every line logged for the job (in this task, the tasks and the threads it starts)
        # carries its delivery, repo and issue.
        with log_context(delivery=job.delivery_id, repo=job.repo,
                         issue=issue_number(data) if data is not None else None):
            await self._run_job_logged(job, data)

    async def _run_job_logged(self, job: Job, data: dict[str, Any] | None) -> None:
        store = self.services.store
        metrics = self.metrics
        started = time.perf_counter()
        try:
            async with asyncio.timeout(JOB_TIMEOUT):
                await self.process(job, data)
        except asyncio.CancelledError:
            # Shutdown: leave the job running; recover() at the next start requeues it.
            raise
        except Exception as exc:
            metrics.job_seconds.observe(time.perf_counter() - started)
            metrics.jobs.inc(event=event_label(job.event),
                             outcome="failed" if job.attempts >= store.max_attempts
                             else "retried")
            if _refused(exc) and job.installation_id is not None:
                # The token may have been revoked; mint a fresh one for the retry.
                self.services.github.forget_token(job.installation_id)
            delay = self.retry_delay(job.attempts)
            log.warning("delivery %s: attempt %s failed (%s: %s); retry in %.0fs",
                        job.delivery_id, job.attempts, type(exc).__name__, exc, delay)
            try:
                await asyncio.to_thread(store.fail_job, job.id,
                                        f"{type(exc).__name__}: {exc}", delay)
            except Exception:
                log.exception("delivery %s: could not record the failure", job.delivery_id)
            finally:
                self._forget(job)
        else:
            metrics.job_seconds.observe(time.perf_counter() - started)
            metrics.jobs.inc(event=event_label(job.event), outcome="done")
            # Not awaited: the lane goes on with the next job while the commit is shared with
            # others. Once the handlers are done, a shutdown does not undo the record; stop()
            # waits for it before the store closes.
            self.intake.complete(job.id).add_done_callback(
                lambda done: self._recorded(job, done))

    def _forget(self, job: Job) -> None:
        with self._claim_lock:
            self._held.discard(job.id)

    def _recorded(self, job: Job, done: asyncio.Future[bool]) -> None:
        self._forget(job)
        if not done.cancelled() and done.exception() is not None:
            log.error("delivery %s: done, but could not record it: %s", job.delivery_id,
                      done.exception())

    async def process(self, job: Job, data: dict[str, Any] | None = None) -> None:
        if data is None:
            data = parse_json(job.payload)
        event = Event(data, event=job.event, delivery_id=job.delivery_id)
        repo_name = job.repo or ""
        if not repo_name:
            log.info("delivery %s: no repository in payload, nothing to do", job.delivery_id)
            return
        async with self._lock_for(job, data):
            gh = await self.services.github.for_installation(job.installation_id)
            client_cls: type[RepoClient] = RepoClient
            if self.services.dry_run:
                authenticated = self.services.github.authenticated
                client_cls = DryRunRepoClient if authenticated else OfflineRepoClient
            ctx = Context(
                delivery_id=job.delivery_id,
                repo_name=repo_name,
                repo=client_cls(gh, repo_name),
                services=self.services,
                payload=data,
            )
            await dispatch(event, ctx)
