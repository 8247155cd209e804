"""The aiohttp application: routes, and the services that live as long as the process (one
HTTP session, the store, the cluster index, the worker), started and stopped in cleanup_ctx."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from bot import __version__
from bot.github import GitHubApp
from bot.handlers import wants
from bot.handlers.context import Services
from bot.index import IndexHolder
from bot.intake import Intake
from bot.journal import ReceiverIntake
from bot.metrics import CONTENT_TYPE, Metrics
from bot.round_writer import RoundWriter, WriterGone
from bot.settings import ROLES, ServiceConfig, Settings, SettingsError
from bot.store import Store
from bot.webhook import Receiver
from bot.worker import POLL_SECONDS, WORKER_POLL_SECONDS, Worker

log = logging.getLogger("dejafix")

SERVICES = web.AppKey("services", Services)
WORKER = web.AppKey("worker", Worker)
INTAKE = web.AppKey("intake", Intake)
JOURNAL = web.AppKey("journal", ReceiverIntake)
STORE = web.AppKey("store", Store)
# A worker process's rounds (finished jobs, new leases) at most this often: see Intake.
WORKER_ROUND_SECONDS = 0.02
METRICS = web.AppKey("metrics", Metrics)


def create_app(settings: Settings, config: ServiceConfig, *, dry_run: bool = False,
               role: str = "all") -> web.Application:
    if role not in ROLES:
        raise SettingsError(f"role {role!r} is not one of {', '.join(ROLES)}")
    receives = role in ("all", "receiver")
    works = role in ("all", "worker")
    if receives and settings.webhook_secret is None and not dry_run:
        raise SettingsError(
            "DEJAFIX_WEBHOOK_SECRET is not set: refusing to accept unsigned deliveries "
            "(start with --dry-run to try the bot without one)"
        )
    app = web.Application(client_max_size=config.max_body_bytes)
    # One registry per application: nothing is shared between two apps in one process.
    metrics = app[METRICS] = Metrics()
    wakeup = asyncio.Event()

    async def enqueue(delivery: str, event: str, action: str | None, repo: str | None,
                      installation_id: int | None, body: bytes, payload: dict[str, Any]
                      ) -> bool:
        if not works:
            return await app[JOURNAL].accept(
                (delivery, event, action, repo, installation_id, body))
        return await app[INTAKE].accept(
            (delivery, event, action, repo, installation_id, body), parsed=payload)

    secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else None
    receiver = Receiver(secret=secret, wants=wants, enqueue=enqueue,
                        metrics=metrics)

    async def services_ctx(app: web.Application) -> AsyncIterator[None]:
        store = await asyncio.to_thread(Store, settings.data_dir,
                                        max_attempts=config.max_attempts)
        app[STORE] = store
        if works:
            # Every job left running was leased by a worker that is gone: only a worker may
            # say so (a receiver starting beside a live worker must not take its jobs).
            requeued = await asyncio.to_thread(store.recover)
            if requeued:
                log.info("store: %d unfinished job(s) from the last run requeued", requeued)
        if not works:
            # A receiver alone appends to its journal and answers; its ingester process
            # records the deliveries in the store (bot/journal.py).
            journal = app[JOURNAL] = ReceiverIntake(settings.data_dir, store.path,
                                                    config.max_attempts)
            try:
                await journal.start()
                log.info("dejafix %s ready: receiver only (%s), journal slot %s; the jobs are "
                         "run by a worker process on %s", __version__,
                         "DRY-RUN" if dry_run else "live", journal.journal.slot,
                         settings.data_dir)
                yield
            finally:
                await journal.stop()
                log.info("shutdown complete")
                await asyncio.to_thread(store.close)
            return
        writer = await asyncio.to_thread(_start_writer, settings, config)
        app[INTAKE] = Intake(store, writer=writer,
                             min_interval=0.0 if receives else WORKER_ROUND_SECONDS)
        try:
            async with run_worker(store):
                yield
        finally:
            await app[INTAKE].flush()
            if writer is not None:
                await asyncio.to_thread(writer.close)
            log.info("shutdown complete")
            await asyncio.to_thread(store.close)

    @contextlib.asynccontextmanager
    async def run_worker(store: Store) -> AsyncIterator[None]:
        """The worker's services (index, GitHub session, worker), for roles that run jobs."""
        index = IndexHolder(
            config.resolved_cluster_paths(),
            learned=lambda: (store.learned_version(), store.learned_clusters()),
            learned_version=store.learned_version,
            semantic=config.matching.semantic,
            # Large builds run in a process: it writes its arrays under the data directory and
            # reads the learned clusters from the database itself rather than through the loop.
            index_dir=settings.data_dir / "index",
            learned_db=store.path,
            learned_count=store.learned_count,
        )
        await index.refresh(force=True)
        session = aiohttp.ClientSession(
            headers={"User-Agent": f"dejafix/{__version__}"},
            timeout=aiohttp.ClientTimeout(total=config.github_timeout),
        )
        github = GitHubApp(session, base_url=settings.github_url, app_id=settings.app_id,
                           private_key=settings.private_key, metrics=metrics)
        slug = config.app_slug
        if slug is None and github.authenticated:
            try:
                slug = await github.app_slug()
            except Exception as exc:  # the bot still works; it only cannot spot its own events
                log.warning("could not read the App's slug from GET /app: %s", exc)
        services = Services(config=config, store=store, github=github, index=index,
                            dry_run=dry_run, app_slug=slug, docs_url=config.docs_url)
        app[SERVICES] = services
        # A worker on its own finds new jobs only by asking the queue: more often than the
        # retry poll a worker beside its receiver needs (that one is handed them).
        worker = Worker(services, wakeup, config.workers, metrics, intake=app[INTAKE],
                        poll_seconds=POLL_SECONDS if receives else WORKER_POLL_SECONDS)
        app[WORKER] = worker
        task = asyncio.create_task(worker.run(), name="dejafix-worker")
        watcher = (asyncio.create_task(index.watch(config.cluster_reload), name="dejafix-reload")
                   if config.cluster_reload > 0 else None)
        log.info(
            "dejafix %s ready: %s%s, app id %s, key %s, GitHub %s, data %s",
            __version__, "DRY-RUN (nothing is posted)" if dry_run else "live",
            "" if receives else ", worker only",
            settings.app_id or "-",
            settings.private_key.fingerprint if settings.private_key else "-",
            settings.github_url, settings.data_dir,
        )
        try:
            yield
        finally:
            # The site has stopped accepting by now; finish what is in hand, within a bound.
            cancelled = await worker.stop(config.drain_seconds)
            for background in (task, watcher):
                if background is not None:
                    background.cancel()
            await asyncio.gather(task, *([watcher] if watcher else []), return_exceptions=True)
            if cancelled:
                log.warning("shutdown: %d delivery(ies) unfinished; they run at the next start",
                            cancelled)
            await session.close()

    async def healthz(request: web.Request) -> web.Response:
        store = request.app[STORE]
        pending = await asyncio.to_thread(store.pending_count)
        failed = await asyncio.to_thread(store.failed_count)
        if not works:
            journal = request.app[JOURNAL].status()
            # Deliveries are still journaled without an ingester, but reach no worker.
            ingesting = journal["ingester"] == "running"
            return web.json_response({
                "ok": ingesting, "role": role, "worker": "external", "version": __version__,
                "dry_run": dry_run, "queued": pending, "failed": failed, "journal": journal,
            }, status=200 if ingesting else 503)
        services = request.app[SERVICES]
        alive = request.app[WORKER].alive
        index = services.index.current
        return web.json_response({
            "ok": alive,
            "role": role,
            "worker": "running" if alive else "stopped",
            "version": __version__,
            "dry_run": services.dry_run,
            "clusters": index.size,
            "clusters_version": index.version,
            # count, not clusters(): the latter rebuilds every cluster from its stored record.
            "clusters_by_repo": {repo: index.count(repo) for repo in index.repos},
            "queued": pending,
            "failed": failed,
        }, status=200 if alive else 503)

    async def metrics_endpoint(request: web.Request) -> web.Response:
        store = request.app[STORE]
        # Read from the store at scrape time, not kept up to date between scrapes.
        metrics.queue_depth.set(await asyncio.to_thread(store.pending_count))
        metrics.failed_jobs.set(await asyncio.to_thread(store.failed_count))
        if works:
            metrics.clusters.set(request.app[SERVICES].index.current.size)
        return web.Response(body=metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    app.cleanup_ctx.append(services_ctx)
    if receives:
        app.router.add_post("/webhook", receiver.handle)
        app.router.add_post("/", receiver.handle)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_endpoint)
    return app


def _start_writer(settings: Settings, config: ServiceConfig) -> RoundWriter | None:
    """The intake's writer process; without one (a platform with no forkserver, a child that
    cannot open the store) the rounds are written in this process, only slower under load."""
    try:
        return RoundWriter(settings.data_dir, config.max_attempts)
    except (WriterGone, OSError, ValueError) as exc:
        log.warning("intake: no writer process (%s); rounds are written in this process", exc)
        return None
