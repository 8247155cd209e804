"""The worker: takes jobs from the durable queue and runs the handlers for each, up to
``workers`` at once. A failed job is retried with backoff; a job whose process died is picked up
again after its lease (``Store.recover`` at startup does it at once)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import weakref
from typing import Any

import gidgethub
from gidgethub.sansio import Event

from bot.github import DryRunRepoClient, OfflineRepoClient, RepoClient
from bot.handlers import HandlerFailures, dispatch
from bot.handlers.context import Context, Services
from bot.metrics import Metrics, event_label, issue_number, log_context, metrics_scope
from bot.store import Job

log = logging.getLogger("dejafix.worker")

LEASE_SECONDS = 300.0
# A job is cut off well inside its lease, so no job is ever handed out twice while still running.
JOB_TIMEOUT = LEASE_SECONDS / 2
POLL_SECONDS = 1.0
PRUNE_EVERY = 3600.0
# Finished deliveries are kept this long; a redelivery within it is recognised and not redone.
KEEP_DONE_SECONDS = 14 * 24 * 3600.0


def retry_delay(attempts: int, base: float = 5.0) -> float:
    """Capped exponential backoff with jitter, so a GitHub outage does not end in a stampede."""
    return float(min(600.0, base * 3.0 ** (attempts - 1)) * random.uniform(0.8, 1.2))


def _refused(exc: BaseException) -> bool:
    errors = exc.errors if isinstance(exc, HandlerFailures) else [exc]
    return any(isinstance(e, gidgethub.BadRequest) and e.status_code in (401, 403)
               for e in errors)


def _payload(job: Job) -> dict[str, Any] | None:
    """The job's payload, parsed once for the log context and the handlers; None when it does
    not parse (``process`` then fails on it as before)."""
    try:
        data = json.loads(job.payload)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


class Worker:
    def __init__(self, services: Services, wakeup: asyncio.Event, concurrency: int,
                 metrics: Metrics | None = None) -> None:
        self.services = services
        self.metrics = metrics if metrics is not None else Metrics()
        self.wakeup = wakeup
        self.slots = asyncio.Semaphore(concurrency)
        self.running: set[asyncio.Task[None]] = set()
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

    async def run(self) -> None:
        try:
            while not self.stopping:
                await self.slots.acquire()
                if self._stopped():
                    self.slots.release()
                    break
                try:
                    job = await asyncio.to_thread(self.services.store.claim_job, LEASE_SECONDS)
                    await self._maybe_prune()
                except Exception:
                    # A locked or full database must not end the worker: log, wait, try again.
                    self.slots.release()
                    log.exception("worker: cannot read the queue; retrying in 5s")
                    await asyncio.sleep(5)
                    continue
                if job is None:
                    self.slots.release()
                    self.wakeup.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wakeup.wait(), timeout=POLL_SECONDS)
                    continue
                task = asyncio.create_task(self._run_job(job))
                self.running.add(task)
                task.add_done_callback(self._finished)
        finally:
            self.alive = False

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self.slots.release()
        self.wakeup.set()

    async def stop(self, drain_seconds: float = 0.0) -> int:
        """Stop taking jobs, let the running ones finish for up to ``drain_seconds``, cancel the
        rest (their jobs stay leased and run again after the next start). Returns how many
        were cancelled."""
        self.stopping = True
        self.wakeup.set()
        if self.running and drain_seconds > 0:
            await asyncio.wait(list(self.running), timeout=drain_seconds)
        left = list(self.running)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        return len(left)

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

    async def _run_job(self, job: Job) -> None:
        data = _payload(job)
        # The handlers count into this app's metrics, and every line logged for the job (in
        # this task, the tasks and the threads it starts) carries its delivery, repo and issue.
        with metrics_scope(self.metrics), log_context(
                delivery=job.delivery_id, repo=job.repo,
                issue=issue_number(data) if data is not None else None):
            await self._run_job_logged(job, data)

    async def _run_job_logged(self, job: Job, data: dict[str, Any] | None) -> None:
        store = self.services.store
        metrics = self.metrics
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self.process(job, data), timeout=JOB_TIMEOUT)
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
        else:
            metrics.job_seconds.observe(time.perf_counter() - started)
            metrics.jobs.inc(event=event_label(job.event), outcome="done")
            try:
                await asyncio.to_thread(store.complete_job, job.id)
            except Exception:
                log.exception("delivery %s: done, but could not record it", job.delivery_id)

    async def process(self, job: Job, data: dict[str, Any] | None = None) -> None:
        if data is None:
            data = json.loads(job.payload)
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
