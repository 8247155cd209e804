"""The aiohttp application: routes, and the services that live as long as the process (the
store, one HTTP session, the cluster index, the worker), started and stopped in cleanup_ctx.

``serve`` runs the receiver and a worker in one process; ``worker`` runs jobs only (its HTTP
server, if any, answers /healthz and /metrics). With PostgreSQL any number of either share the
database; with SQLite there is one worker per data directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from bot import __version__
from bot.db import open_store
from bot.db.sqlite import SQLiteStore
from bot.db.store import CHANGES, JOBS, Store
from bot.features import installs
from bot.features.context import Services
from bot.features.repo_sources import FOLDER, RepoSources
from bot.features.repo_sources import materialise as materialise_repo_sources
from bot.github.app import GitHubApp
from bot.jobs.dispatch import wants
from bot.jobs.feeds import FeedPoller, materialise
from bot.jobs.worker import Worker
from bot.logs import quiet_bad_requests
from bot.matching.builds import IndexDir
from bot.matching.index import IndexHolder
from bot.matching.repo_indexes import RepoIndexes
from bot.metrics import CONTENT_TYPE, Metrics
from bot.settings import ServiceConfig, Settings, SettingsError
from bot.web.pages import Pages, install_templates
from bot.web.setup import add_setup_routes
from bot.web.webhook import Receiver

log = logging.getLogger("dejafix")


@dataclass
class Runtime:
    """What the routes and the shutdown read: set up in ``services_ctx``."""

    store: Store | None = None
    services: Services | None = None
    # Its per-repository indexes of learned clusters (``services.index`` holds them too).
    learned: RepoIndexes | None = None
    worker: Worker | None = None
    # The process's one HTTP session (GitHub), for the page's sign-in.
    http: aiohttp.ClientSession | None = None
    draining: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


SERVICES = web.AppKey("services", Services)
WORKER = web.AppKey("worker", Worker)
METRICS = web.AppKey("metrics", Metrics)
RUNTIME = web.AppKey("runtime", Runtime)


# A connection has this long to send a request's head, from its opening or the end of its last
# response (aiohttp's keep-alive timer, which also closes an idle connection), and a request
# this long to send its body once its head is in. Slow clients cannot hold connections longer;
# a proxy in front keeping connections to Dejafix open must idle them out sooner than this.
HEADER_TIMEOUT = 30.0
BODY_TIMEOUT = 60.0


def create_app(settings: Settings, config: ServiceConfig, *, dry_run: bool = False,
               receive: bool = True, work: bool = True,
               body_timeout: float = BODY_TIMEOUT) -> web.Application:
    if receive and settings.webhook_secret is None and not dry_run:
        raise SettingsError(
            "DEJAFIX_WEBHOOK_SECRET is not set: refusing to accept unsigned deliveries "
            "(start with --dry-run to try the bot without one)"
        )
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[body_deadline(body_timeout)])
    quiet_bad_requests()
    # One registry per application: nothing is shared between two apps in one process.
    metrics = app[METRICS] = Metrics()
    runtime = app[RUNTIME] = Runtime()
    database_url = (settings.database_url.get_secret_value()
                    if settings.database_url is not None else None)

    def current_store() -> Store:
        if runtime.store is None:
            raise RuntimeError("the store is not open yet")
        return runtime.store

    secret = settings.webhook_secret.get_secret_value() if settings.webhook_secret else None
    receiver = Receiver(secret=secret, wants=wants, store=current_store, metrics=metrics)

    async def services_ctx(app: web.Application) -> AsyncIterator[None]:
        store = await asyncio.to_thread(open_store, settings.data_dir, database_url,
                                        max_attempts=config.max_attempts)
        runtime.store = store
        try:
            if work:
                async with run_worker(store):
                    yield
            else:
                log.info("dejafix %s ready: web only (%s), store %s; jobs are run by worker "
                         "processes", __version__, "DRY-RUN" if dry_run else "live",
                         store.describe())
                yield
        finally:
            await asyncio.to_thread(store.close)
            log.info("shutdown complete")

    @contextlib.asynccontextmanager
    async def run_worker(store: Store) -> AsyncIterator[None]:
        if isinstance(store, SQLiteStore):
            # This process holds the data directory (``lock_data_dir``): every job left
            # running was a dead process's.
            requeued = await asyncio.to_thread(store.recover)
            if requeued:
                log.info("store: %d unfinished job(s) from the last run requeued", requeued)
        index_dir, index_lock = await asyncio.to_thread(own_index_dir, settings.data_dir)
        paths = config.resolved_cluster_paths()
        feeds_dir = settings.data_dir / "feeds"
        if config.cluster_feeds:
            # The feeds' stored versions, as files the index reads like any cluster folder:
            # written before the first build, so a restart starts with them, unfetched.
            await asyncio.to_thread(materialise, store, config.cluster_feeds, feeds_dir)
            paths = [*paths, feeds_dir]
        # Large builds run in a process: it writes its arrays under the data directory and is
        # handed a repository's learned clusters in a file. One directory for both indexes.
        builds = IndexDir(index_dir)
        # Learned clusters are indexed per repository, on its first issue, within a budget.
        learned = runtime.learned = RepoIndexes(
            store.learned_state,
            store.learned_records,
            budget_bytes=int(config.index_memory_mb * (1 << 20)),
            root=builds,
            on_build=metrics.repo_index_builds.inc,
            on_evict=metrics.repo_index_evictions.inc,
        )
        # Repositories' own ``clusters:``, as stored: written before the first build too.
        repo_dir = settings.data_dir / FOLDER
        await asyncio.to_thread(materialise_repo_sources, store, repo_dir)
        paths = [*paths, repo_dir]
        index = IndexHolder(paths, index_dir=builds, learned=learned)
        await index.refresh(force=True)
        session = aiohttp.ClientSession(
            headers={"User-Agent": f"dejafix/{__version__}"},
            timeout=aiohttp.ClientTimeout(total=config.github_timeout),
        )
        runtime.http = session
        github = GitHubApp(session, base_url=settings.github_url, app_id=settings.app_id,
                           private_key=settings.private_key, metrics=metrics)
        slug = config.app_slug
        if slug is None and github.authenticated:
            try:
                slug = await github.app_slug()
            except Exception as exc:  # the bot still works; it only cannot spot its own events
                log.warning("could not read the App's slug from GET /app: %s", exc)
        poller = FeedPoller(config.cluster_feeds, store, feeds_dir, session,
                            on_change=index.refresh)
        sources = RepoSources(repo_dir, store, index,
                              private_feeds=config.repo_feeds_private)
        services = Services(config=config, store=store, github=github, index=index,
                            dry_run=dry_run, app_slug=slug, docs_url=config.docs_url,
                            repo_sources=sources)
        runtime.services = app[SERVICES] = services
        worker = Worker(services, metrics=metrics)
        runtime.worker = app[WORKER] = worker
        loop = asyncio.get_running_loop()
        refreshing: list[asyncio.Task[None]] = []

        def refresh_index(repo: str) -> None:
            # A resident index is rebuilt now, so the next issue does not wait; any other is
            # built when needed (each delivery reads its repository's learned version).
            if learned.resident(repo):
                refreshing[:] = [t for t in refreshing if not t.done()]
                refreshing.append(loop.create_task(index.learned_changed(repo)))

        feeding: list[asyncio.Task[object]] = []

        def refresh_feeds() -> None:
            feeding[:] = [t for t in feeding if not t.done()]
            if config.cluster_feeds:
                feeding.append(loop.create_task(poller.refresh()))
            # A repository's own sources are stored as feeds are (``repo:`` keys).
            feeding.append(loop.create_task(sources.refresh()))

        def on_note(channel: str, payload: str) -> None:
            if channel == JOBS:
                worker.wake()
            elif channel == CHANGES:
                kind, _, repo = payload.partition(":")
                if kind == "config" and repo:
                    services.forget_repo_config(repo)
                elif kind == "learned" and repo:
                    refresh_index(repo)
                elif kind == "feed":
                    refresh_feeds()
            elif channel == "reconnected":
                # Notifications may have been missed: drop every cached config, look again.
                services.forget_all_configs()
                worker.wake()

        # SQLite notifies from the writing thread, PostgreSQL's listener on the loop.
        def notified(channel: str, payload: str) -> None:
            loop.call_soon_threadsafe(on_note, channel, payload)

        store.subscribe(notified)
        runtime.tasks.append(asyncio.create_task(worker.run(), name="dejafix-worker"))
        runtime.tasks.append(asyncio.create_task(store.listen(), name="dejafix-listen"))
        if config.cluster_feeds:
            runtime.tasks.append(asyncio.create_task(poller.run(), name="dejafix-feeds"))
        if config.cluster_reload > 0:
            runtime.tasks.append(asyncio.create_task(index.watch(config.cluster_reload),
                                                     name="dejafix-reload"))
        log.info(
            "dejafix %s ready: %s%s, app id %s, key %s, GitHub %s, store %s",
            __version__, "DRY-RUN (nothing is posted)" if dry_run else "live",
            "" if receive else ", worker only",
            settings.app_id or "-",
            settings.private_key.fingerprint if settings.private_key else "-",
            settings.github_url, store.describe(),
        )
        try:
            yield
        finally:
            released = await worker.stop(config.drain_seconds)
            for task in runtime.tasks:
                task.cancel()
            await asyncio.gather(*runtime.tasks, *refreshing, *feeding, return_exceptions=True)
            if released:
                log.warning("shutdown: %d delivery(ies) unfinished, given back to the queue",
                            released)
            await session.close()
            if index_lock is not None:
                index_lock.close()

    async def healthz(request: web.Request) -> web.Response:
        store = current_store()
        queue = await asyncio.to_thread(store.queue_health)
        body: dict[str, object] = {
            "version": __version__, "dry_run": dry_run, "store": store.backend,
            "queued": queue.pending, "failed": queue.failed, "draining": runtime.draining,
            # Reported, not a 503: a lost LISTEN costs latency (the poll still runs), not work.
            "listen": {True: "up", False: "down", None: "n/a"}[store.listening],
            "oldest_queued_seconds": round(queue.oldest_due_seconds, 1),
            "taken_over": queue.taken_over,
        }
        ok = not runtime.draining
        if runtime.worker is not None and runtime.services is not None:
            alive = runtime.worker.alive
            ok = ok and alive
            holder = runtime.services.index
            index = holder.current
            body.update({
                "worker": "running" if alive else "stopped",
                # The curated clusters (files and feeds); learned ones are in the store.
                "clusters": index.size,
                "clusters_version": index.version,
                # How many repositories, not which: anyone may ask /healthz, and a private
                # repository's name is not theirs to learn (the page lists them, signed in).
                "clusters_repos": len(index.repos),
            })
            if runtime.learned is not None:
                stats = runtime.learned.stats()
                body["repo_indexes"] = {
                    "resident": stats.resident, "mb": round(stats.resident_bytes / 2**20, 1),
                    "budget_mb": round(stats.budget_bytes / 2**20, 1), "builds": stats.builds,
                    "evictions": stats.evictions}
        else:
            body["worker"] = "external"
        body["ok"] = ok
        # 503 while draining: a load balancer stops sending here; deliveries that still come
        # are accepted.
        return web.json_response(body, status=200 if ok else 503)

    async def metrics_endpoint(request: web.Request) -> web.Response:
        store = current_store()
        # Read from the store at scrape time, not kept up to date between scrapes.
        queue = await asyncio.to_thread(store.queue_health)
        metrics.observe_queue(queue.pending, queue.failed, queue.oldest_due_seconds,
                              store.listening)
        # A --no-worker process refreshes nothing between scrapes: read the backfills here too.
        metrics.observe_backfills(await asyncio.to_thread(installs.all_records, store),
                                  time.time())
        if runtime.services is not None:
            holder = runtime.services.index
            metrics.clusters.set(holder.current.size)
            metrics.learned_clusters.set(await asyncio.to_thread(store.learned_count))
            if runtime.learned is not None:
                stats = runtime.learned.stats()
                metrics.repo_indexes.set(stats.resident)
                metrics.repo_index_bytes.set(stats.resident_bytes)

        return web.Response(body=metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    app.cleanup_ctx.append(services_ctx)
    if receive:
        app.router.add_post("/webhook", receiver.handle)
        app.router.add_post("/", receiver.handle)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_endpoint)
    if receive:
        # The page is the receiver's: a worker-only process serves health and metrics only.
        install_templates(app, settings)
        Pages(settings, lambda: runtime.services, lambda: runtime.http).add_routes(app)
        add_setup_routes(app, settings)
    return app


def server_runner(app: web.Application, *, header_timeout: float = HEADER_TIMEOUT
                  ) -> web.AppRunner:
    """The runner ``serve`` starts the app with: no access log, signals left to the caller, and
    the head of each request due within ``header_timeout`` seconds of the connection's opening
    or its previous response (else the connection is closed)."""
    return web.AppRunner(app, handle_signals=False, access_log=None,
                         keepalive_timeout=header_timeout)


def body_deadline(seconds: float) -> Middleware:
    """A request whose body is still arriving ``seconds`` after its head is answered 408 and
    its connection closed; once the body is in, the handler runs as long as it needs. aiohttp
    bounds the head (``server_runner``) but never the body: a client trickling one byte at a
    time would otherwise hold its connection and its handler for ever."""

    @web.middleware
    async def deadline(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.body_exists or request.content.is_eof():
            return await handler(request)
        task = asyncio.current_task()
        assert task is not None
        expired = False

        def expire() -> None:
            nonlocal expired
            if not request.content.is_eof():
                expired = True
                task.cancel()

        timer = asyncio.get_running_loop().call_later(seconds, expire)
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if not expired or task.uncancel() > 0:
                raise
            log.warning("web: %s %s: the body did not arrive within %gs (408)",
                        request.method, request.path, seconds)
            timeout = web.HTTPRequestTimeout(text="The request's body did not arrive in time.")
            timeout.force_close()
            raise timeout from None
        finally:
            timer.cancel()

    return deadline


def own_index_dir(data_dir: Path) -> tuple[Path | None, IO[str] | None]:
    """Where this process's large index builds go: ``index/`` under the data directory, for the
    first worker process on this disk (the lock file says so; a restart maps its saved build),
    or a temporary directory of its own for any other (several workers on one host share a
    PostgreSQL database, not their builds: one would delete the other's)."""
    import fcntl

    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle = (data_dir / "index.lock").open("a+")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None, None  # IndexDir makes a temporary directory, removed with it
    return data_dir / "index", handle


async def drain(app: web.Application, config: ServiceConfig) -> None:
    """SIGTERM: /healthz turns 503 and the worker stops claiming and finishes what it runs
    (up to ``drain_seconds``, the rest back to the queue), while the receiver keeps accepting
    deliveries, for at least ``stop_grace`` seconds. The caller then closes the server."""
    runtime = app[RUNTIME]
    runtime.draining = True
    loop = asyncio.get_running_loop()
    started = loop.time()
    log.info("SIGTERM: draining (up to %gs)%s", config.drain_seconds,
             "; deliveries are still accepted"
             if any(r.method == "POST" for r in app.router.routes()) else "")
    if runtime.worker is not None:
        released = await runtime.worker.stop(config.drain_seconds)
        if released:
            log.warning("shutdown: %d delivery(ies) unfinished, given back to the queue",
                        released)
    rest = config.stop_grace - (loop.time() - started)
    if rest > 0:
        await asyncio.sleep(rest)
