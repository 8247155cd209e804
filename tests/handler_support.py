"""A feature's handler called directly: its ``Context`` built from a real SQLite store under
tmp_path, the sample clusters' index and a repository client talking to the fake GitHub on
loopback, with no webhook server, no queue and no worker in between. A handler test then says
what one call did (the requests the fake recorded, the rows the store holds), and a failure
points at the handler, not at the receiver or the worker.

Exposed to every test module by ``pytest_plugins`` in tests/conftest.py: the ``handlers``
fixture (default service config) and ``make_handlers`` (a ``ServiceConfig`` of the test's own).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gidgethub.sansio import Event

from bot.db import open_store
from bot.db.store import Store
from bot.features.context import Context, Services
from bot.github.app import GitHubApp
from bot.github.client import RepoClient
from bot.matching.builds import IndexDir
from bot.matching.index import IndexHolder
from bot.matching.repo_indexes import RepoIndexes
from bot.settings import PrivateKey, ServiceConfig
from tests.conftest import APP_ID, SAMPLE_CLUSTERS
from tests.fake_github import FakeGitHub

Handler = Callable[[Event, Context], Awaitable[None]]


@dataclass
class Handlers:
    """One process's services, as the worker would hold them, for handlers called by hand."""

    fake: FakeGitHub
    services: Services

    @property
    def store(self) -> Store:
        return self.services.store

    async def context(self, payload: dict[str, Any], *, delivery_id: str | None = None,
                      attempt: int = 1) -> Context:
        """The context the worker would build for a delivery of ``payload``: a client for its
        repository acting as its installation (a token minted by the fake)."""
        repo = payload.get("repository")
        repo_name = repo.get("full_name") if isinstance(repo, dict) else None
        assert isinstance(repo_name, str), "a handler's payload names its repository"
        inst = payload.get("installation")
        installation = inst.get("id") if isinstance(inst, dict) else None
        gh = await self.services.github.for_installation(installation)
        return Context(delivery_id=delivery_id or f"handler-{uuid.uuid4().hex[:12]}",
                       repo_name=repo_name, repo=RepoClient(gh, repo_name),
                       services=self.services, payload=payload, attempt=attempt)

    async def call(self, handler: Handler, event: str, payload: dict[str, Any], *,
                   delivery_id: str | None = None, attempt: int = 1) -> Context:
        """Run ``handler`` once on ``payload`` as a delivery of ``event``; returns its context."""
        ctx = await self.context(payload, delivery_id=delivery_id, attempt=attempt)
        await handler(Event(payload, event=event, delivery_id=ctx.delivery_id), ctx)
        return ctx


HandlersFactory = Callable[..., Awaitable[Handlers]]


@pytest.fixture
async def make_handlers(github: tuple[FakeGitHub, str], key_pair: tuple[str, str],
                        tmp_path: Path) -> AsyncIterator[HandlersFactory]:
    """``await make_handlers(config=..., dry_run=...)``: services on a store of their own (one
    data directory per call), all closed at teardown."""
    fake, url = github
    made: list[tuple[Services, aiohttp.ClientSession]] = []

    async def factory(*, config: ServiceConfig | None = None,
                      dry_run: bool = False) -> Handlers:
        config = config or ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)])
        data_dir = tmp_path / f"handler-data-{len(made) + 1}"
        # Opening migrates the schema: blocking, like the app does it, off the loop.
        store = await asyncio.to_thread(open_store, data_dir, None)
        try:
            # As the app wires it: the store's learned clusters indexed per repository.
            builds = IndexDir(data_dir / "index")
            learned = RepoIndexes(store.learned_state, store.learned_records,
                                  budget_bytes=int(config.index_memory_mb * (1 << 20)),
                                  root=builds)
            index = IndexHolder(config.resolved_cluster_paths(), index_dir=builds,
                                learned=learned)
            await index.refresh(force=True)
        except BaseException:
            store.close()
            raise
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=config.github_timeout))
        github_app = GitHubApp(session, base_url=url, app_id=APP_ID,
                               private_key=PrivateKey(key_pair[0], source="test"))
        # The slug the app would read from GET /app, known here without the call, so the
        # fake's request log holds only what the handler did.
        services = Services(config=config, store=store, github=github_app, index=index,
                            dry_run=dry_run, app_slug=config.app_slug or fake.slug,
                            docs_url=config.docs_url)
        made.append((services, session))
        return Handlers(fake=fake, services=services)

    try:
        yield factory
    finally:
        for services, session in made:
            await session.close()
            await asyncio.to_thread(services.store.close)


@pytest.fixture
async def handlers(make_handlers: HandlersFactory) -> Handlers:
    """Services with the sample clusters and the default service config."""
    return await make_handlers()
