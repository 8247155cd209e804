"""The worker: takes jobs from the durable queue and runs the handlers for each, one delivery
per task, up to ``workers`` at once. A failed job is retried with backoff; a job whose process
died is picked up again after its lease (``Store.recover`` at startup does it at once)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import gidgethub
from gidgethub.sansio import Event

from bot.github import DryRunRepoClient, OfflineRepoClient, RepoClient
from bot.handlers import dispatch
from bot.handlers.context import Context, Services
from bot.store import Job

log = logging.getLogger("dejafix.worker")

LEASE_SECONDS = 300.0
POLL_SECONDS = 1.0


def retry_delay(attempts: int) -> float:
    return float(min(600, 5 * 3 ** (attempts - 1)))


class Worker:
    def __init__(self, services: Services, wakeup: asyncio.Event, concurrency: int) -> None:
        self.services = services
        self.wakeup = wakeup
        self.slots = asyncio.Semaphore(concurrency)
        self.running: set[asyncio.Task[None]] = set()
        self.idle = asyncio.Event()
        self.idle.set()

    async def run(self) -> None:
        store = self.services.store
        while True:
            await self.slots.acquire()
            job = await asyncio.to_thread(store.claim_job, LEASE_SECONDS)
            if job is None:
                self.slots.release()
                if not self.running:
                    self.idle.set()
                self.wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), timeout=POLL_SECONDS)
                continue
            self.idle.clear()
            task = asyncio.create_task(self._run_job(job))
            self.running.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self.slots.release()
        self.wakeup.set()

    async def stop(self) -> None:
        for task in list(self.running):
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)

    async def _run_job(self, job: Job) -> None:
        store = self.services.store
        try:
            await self.process(job)
        except asyncio.CancelledError:
            # Shutdown: leave the job running; recover() at the next start requeues it.
            raise
        except Exception as exc:
            refused = isinstance(exc, gidgethub.BadRequest) and exc.status_code in (401, 403)
            if refused and job.installation_id is not None:
                # The token may have been revoked; mint a fresh one for the retry.
                self.services.github.forget_token(job.installation_id)
            delay = retry_delay(job.attempts)
            log.warning("delivery %s: attempt %s failed (%s: %s); retry in %.0fs",
                        job.delivery_id, job.attempts, type(exc).__name__, exc, delay)
            await asyncio.to_thread(store.fail_job, job.id, f"{type(exc).__name__}: {exc}", delay)
        else:
            await asyncio.to_thread(store.complete_job, job.id)

    async def process(self, job: Job) -> None:
        data: dict[str, Any] = json.loads(job.payload)
        event = Event(data, event=job.event, delivery_id=job.delivery_id)
        repo_name = job.repo or ""
        if not repo_name:
            log.info("delivery %s: no repository in payload, nothing to do", job.delivery_id)
            return
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
