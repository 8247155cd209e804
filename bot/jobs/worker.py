"""The worker loop: claim jobs from the store, run each through the features, record it done or
failed. Up to ``workers`` jobs run at once in a process; the claim itself keeps one job per issue
and at most ``repo_workers`` per repository running over every process, so a repository whose
GitHub calls hang cannot take every slot. A failed job is retried with backoff. A job whose
process died is taken over by the next claim on PostgreSQL (its database session, and the lock
that said it was alive, ended with it) and requeued at start on SQLite (one worker per
directory); a job whose worker is alive is taken only after its lease, which the worker itself
never reaches: it cuts every attempt off at half the lease.

A worker also watches its own side: when the database session its jobs are held under is lost
(a network cut, a restart of the database), those jobs are other workers' to take, so it cancels
them at once rather than run them beside their new worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from typing import Any

import gidgethub
from gidgethub.sansio import Event

from bot.db.store import TAKEOVER_REASONS, Job, Store
from bot.features.context import Context, Services
from bot.features.installs import BACKFILL_EVENT, all_records, run_slice
from bot.github.client import CALLS, CallTally, DryRunRepoClient, OfflineRepoClient, RepoClient
from bot.github.payloads import parse_json
from bot.jobs.dispatch import HandlerFailures, dispatch
from bot.logs import issue_number, log_context
from bot.metrics import Metrics, event_label, metrics_scope

log = logging.getLogger("dejafix.worker")

POLL_SECONDS = 1.0
PRUNE_EVERY = 3600.0
# Finished deliveries are kept this long; a redelivery within it is recognised and not redone.
KEEP_DONE_SECONDS = 14 * 24 * 3600.0
# After the store could not be read, wait this long before asking again.
STORE_RETRY_SECONDS = 1.0
# Events about an installation rather than one repository (GitHub names none in them).
REPOSITORY_LESS = frozenset({"installation", "installation_repositories"})
# Seconds between checks of this worker's database session (and refreshes of the queue's
# gauges). Its jobs stay its own only while the session lives.
WATCH_SECONDS = 2.0


def retry_delay(attempts: int, base: float = 5.0) -> float:
    """Capped exponential backoff with jitter, so a GitHub outage does not end in a stampede."""
    return float(min(600.0, base * 3.0 ** (attempts - 1)) * random.uniform(0.8, 1.2))


def _refused(exc: BaseException) -> bool:
    errors = exc.errors if isinstance(exc, HandlerFailures) else [exc]
    return any(isinstance(e, gidgethub.BadRequest | gidgethub.BadGraphQLRequest)
               and e.status_code in (401, 403) for e in errors)


def _parse(payload: bytes) -> dict[str, Any] | None:
    try:
        data = parse_json(payload)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


class Worker:
    def __init__(self, services: Services, *, metrics: Metrics | None = None,
                 poll_seconds: float = POLL_SECONDS) -> None:
        config = services.config
        self.services = services
        self.store: Store = services.store
        self.metrics = metrics if metrics is not None else Metrics()
        self.concurrency = config.workers
        self.per_repo = config.repo_workers
        self.lease_seconds = config.lease_seconds
        # Cut off well inside the lease: no job is ever claimed again while it still runs.
        self.job_timeout = config.lease_seconds / 2
        self.retry_base = config.retry_base
        self.poll_seconds = poll_seconds
        self.name = f"worker-{uuid.uuid4().hex[:8]}"
        self.wakeup = asyncio.Event()
        # The running jobs' tasks; empty when there is nothing to do (tests wait for that).
        self.running: dict[asyncio.Task[None], Job] = {}
        self._last_prune = 0.0
        self._task: asyncio.Task[Any] | None = None
        self.watch_seconds = WATCH_SECONDS
        # The store's takeover counts already added to the metrics.
        self._taken_counted: dict[str, int] = {}
        self.alive = True
        self.stopping = False

    def wake(self) -> None:
        """A job may be waiting (one was queued, or a slot came free). Thread-unsafe: call on
        the loop."""
        self.wakeup.set()

    def retry_delay(self, attempts: int) -> float:
        return retry_delay(attempts, self.retry_base)

    async def run(self) -> None:
        """Claim while there are free slots; sleep until woken or the next poll (retries come
        due, leases run out)."""
        self._task = asyncio.current_task()
        watch = asyncio.create_task(self._watch(), name="dejafix-worker-watch")
        try:
            while not self.stopping:
                self.wakeup.clear()
                free = self.concurrency - len(self.running)
                claimed = await self._claim(free) if free > 0 else 0
                with contextlib.suppress(Exception):
                    await self._maybe_prune()
                if claimed:
                    # Claim again at once: there may be more, and a claim that left a
                    # repository at its bound may find another repository's jobs next.
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), timeout=self.poll_seconds)
        finally:
            self.alive = False
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def _watch(self) -> None:
        # Read at scrape time (an attribute, no query): always current.
        self.metrics.listen_connected.set_function(
            lambda: 0.0 if self.store.listening is False else 1.0)
        while True:
            with contextlib.suppress(Exception):
                await self.check_session()
            with contextlib.suppress(Exception):
                await self.refresh_gauges()
            await asyncio.sleep(self.watch_seconds)

    async def check_session(self) -> int:
        """Cancel the running jobs claimed under a database session that is gone: other
        workers may already be running them. Returns how many were cancelled."""
        held = [(task, job) for task, job in self.running.items() if job.owner is not None]
        if not held:
            return 0
        key = await asyncio.to_thread(self.store.check_owner)
        lost = [(task, job) for task, job in held if job.owner != key and not task.done()]
        for task, job in lost:
            log.warning("delivery %s: cancelled: the database session it was claimed under "
                        "was lost, so another worker may be running it", job.delivery_id)
            task.cancel()
        return len(lost)

    async def refresh_gauges(self) -> None:
        """The queue's gauges, read from the store (also between scrapes: the worker's own
        /metrics need no query of their own)."""
        health = await asyncio.to_thread(self.store.queue_health)
        self.metrics.observe_queue(health.pending, health.failed, health.oldest_due_seconds,
                                   self.store.listening)
        records = await asyncio.to_thread(all_records, self.store)
        self.metrics.observe_backfills(records, time.time())

    async def _claim(self, free: int) -> int:
        try:
            jobs = await asyncio.to_thread(self.store.claim_jobs, self.lease_seconds, free,
                                           per_repo=self.per_repo)
        except Exception as exc:
            # A locked or unreachable database must not end the worker: ask again soon.
            log.warning("worker: cannot read the queue (%s: %s); retrying", type(exc).__name__,
                        exc)
            await asyncio.sleep(STORE_RETRY_SECONDS)
            return 0
        self._count_takeovers()
        if self.stopping:
            # Claimed while SIGTERM came: back to the queue, never started.
            await self._release(jobs)
            return 0
        for job in jobs:
            task = asyncio.create_task(self._run_job(job), name=f"dejafix-job-{job.id}")
            self.running[task] = job
            task.add_done_callback(self._finished)
        return len(jobs)

    def _count_takeovers(self) -> None:
        for reason in TAKEOVER_REASONS:
            total = self.store.taken_over.get(reason, 0)
            new = total - self._taken_counted.get(reason, 0)
            if new > 0:
                self.metrics.taken_over.inc(new, reason=reason)
                self._taken_counted[reason] = total

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.running.pop(task, None)
        self.wakeup.set()

    async def _release(self, jobs: list[Job]) -> int:
        if not jobs:
            return 0
        try:
            return await asyncio.to_thread(self.store.release_jobs, jobs)
        except Exception as exc:
            log.warning("worker: could not give back %d unfinished jobs (%s); they run again "
                        "after their lease", len(jobs), exc)
            return 0

    async def stop(self, drain_seconds: float = 0.0) -> int:
        """Stop claiming (a claim under way ends first), let the running jobs finish for up to
        ``drain_seconds``, cancel the rest and give them back to the queue (another worker, or
        the next start, runs them). Returns how many were given back. A second call finds
        nothing left to do."""
        self.stopping = True
        self.wakeup.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_seconds
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            await asyncio.wait([task], timeout=max(drain_seconds, 1.0))
        while self.running and (remaining := deadline - loop.time()) > 0:
            await asyncio.wait(list(self.running), timeout=remaining)
        left = list(self.running.items())
        for running, _ in left:
            running.cancel()
        await asyncio.gather(*(running for running, _ in left), return_exceptions=True)
        await self._release([job for _, job in left])
        return len(left)

    async def _maybe_prune(self) -> None:
        now = time.monotonic()
        if now - self._last_prune < PRUNE_EVERY:
            return
        self._last_prune = now
        removed = await asyncio.to_thread(self.store.prune, KEEP_DONE_SECONDS)
        if removed:
            log.info("store: pruned %d finished deliveries", removed)

    async def _run_job(self, job: Job) -> None:
        data = _parse(job.payload)
        # Every line logged for the job (in this task, the tasks and the threads it starts)
        # carries its delivery, repo and issue; the features count into this app's metrics.
        with log_context(delivery=job.delivery_id, repo=job.repo,
                         issue=issue_number(data) if data is not None else None), \
                metrics_scope(self.metrics):
            await self._run_logged(job, data)

    async def _run_logged(self, job: Job, data: dict[str, Any] | None) -> None:
        store = self.store
        metrics = self.metrics
        try:
            attempts = await asyncio.to_thread(store.start_job, job.id, job.claim)
        except Exception as exc:
            log.warning("delivery %s: cannot start (%s); it runs after its lease",
                        job.delivery_id, exc)
            return
        if not attempts:
            return  # no longer ours
        started = time.perf_counter()
        # The API calls of this attempt, counted by the client, by what the delivery was.
        # Each job runs in a task of its own, whose context this is.
        tally = CallTally(kind=event_label(job.event))
        CALLS.set(tally)
        try:
            async with asyncio.timeout(self.job_timeout):
                await self.process(job, data, attempts)
        except asyncio.CancelledError:
            raise  # shutdown: stop() gives the job back
        except Exception as exc:
            metrics.job_seconds.observe(time.perf_counter() - started)
            self._count_calls(tally)  # a failed attempt spent the budget too
            last = store.gives_up(attempts)
            metrics.jobs.inc(event=event_label(job.event),
                             outcome="failed" if last else "retried")
            if _refused(exc) and job.installation_id is not None:
                # The token may have been revoked; mint a fresh one for the retry.
                self.services.github.forget_token(job.installation_id)
            delay = self.retry_delay(attempts)
            reason = f"{type(exc).__name__}: {exc}"
            if last:
                log.error("delivery %s: attempt %d of %d failed, giving up: %s",
                          job.delivery_id, attempts, store.max_attempts, reason,
                          exc_info=exc)
            else:
                # One line while it will be retried; the traceback only when it gives up.
                log.warning("delivery %s: attempt %d of %d failed (%s); retry in %.0fs",
                            job.delivery_id, attempts, store.max_attempts, reason, delay)
            try:
                if not await asyncio.to_thread(store.fail_job, job.id, reason, delay,
                                               job.claim):
                    log.warning("delivery %s: this attempt's failure is not recorded: the job "
                                "was taken over (its lease ran out, or this worker's database "
                                "session was lost) and is another worker's", job.delivery_id)
            except Exception as record_exc:
                log.warning("delivery %s: could not record the failure (%s); it runs again "
                            "after its lease", job.delivery_id, record_exc)
        else:
            metrics.job_seconds.observe(time.perf_counter() - started)
            metrics.jobs.inc(event=event_label(job.event), outcome="done")
            self._count_calls(tally)
            try:
                if not await asyncio.to_thread(store.complete_job, job.id, job.claim):
                    log.warning("delivery %s: done, but not recorded: the job was taken over "
                                "(its lease ran out, or this worker's database session was "
                                "lost) and is another worker's", job.delivery_id)
            except Exception as exc:
                log.warning("delivery %s: done, but could not record it (%s); it runs again "
                            "after its lease and finds its comment", job.delivery_id, exc)

    def _count_calls(self, tally: CallTally) -> None:
        self.metrics.github_calls.labels(kind=tally.kind).observe(tally.calls)
        if tally.conditional:
            self.metrics.github_conditional.inc(tally.conditional, kind=tally.kind)

    async def process(self, job: Job, data: dict[str, Any] | None = None,
                      attempt: int = 1) -> None:
        if data is None:
            data = parse_json(job.payload)
        event = Event(data, event=job.event, delivery_id=job.delivery_id)
        repo_name = job.repo or ""
        installation_id = job.installation_id
        if not repo_name:
            if job.event not in REPOSITORY_LESS:
                log.info("delivery %s: no repository in payload, nothing to do",
                         job.delivery_id)
                return
            # About the installation, not one repository: its handlers call no repository
            # (no token is minted for them).
            installation_id = None
        gh = await self.services.github.for_installation(installation_id)
        client_cls: type[RepoClient] = RepoClient
        if self.services.dry_run:
            authenticated = self.services.github.authenticated
            client_cls = DryRunRepoClient if authenticated else OfflineRepoClient
        ctx = Context(delivery_id=job.delivery_id, repo_name=repo_name,
                      repo=client_cls(gh, repo_name), services=self.services, payload=data,
                      attempt=attempt)
        if job.event == BACKFILL_EVENT:
            # The bot's own job (a backfill's slice), never a webhook's: no router takes it.
            await run_slice(ctx)
            return
        await dispatch(event, ctx)
