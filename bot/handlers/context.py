"""What a handler gets: the delivery, a client for its repository, and the process's services."""

from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import cachetools

from bot.github import GitHubApp, RepoClient
from bot.index import IndexHolder
from bot.matching import Boilerplate, learn_boilerplate
from bot.repo_config import CONFIG_PATH, RepoConfig, RepoConfigError, parse_repo_config
from bot.settings import ServiceConfig
from bot.store import Store

log = logging.getLogger("dejafix.handlers")

TEMPLATE_DIR = ".github/ISSUE_TEMPLATE"


@dataclass
class Services:
    """Long-lived, shared by every delivery in the process."""

    config: ServiceConfig
    store: Store
    github: GitHubApp
    index: IndexHolder
    dry_run: bool = False
    app_slug: str | None = None
    docs_url: str | None = None
    repo_configs: cachetools.TTLCache[str, RepoConfig | RepoConfigError] = field(
        init=False
    )
    boilerplates: cachetools.TTLCache[str, Boilerplate] = field(init=False)
    # One fetch per repository at a time: deliveries for several issues of one repository arrive
    # together, and without it each would miss the cache and read the same files.
    fetch_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = field(
        init=False, default_factory=weakref.WeakValueDictionary)

    def fetch_lock(self, key: str) -> asyncio.Lock:
        lock = self.fetch_locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self.fetch_locks[key] = lock
        return lock

    def __post_init__(self) -> None:
        ttl = max(self.config.repo_config_ttl, 0.001)
        self.repo_configs = cachetools.TTLCache(maxsize=4096, ttl=ttl)
        # Templates change rarely; an hour is plenty and saves a folder listing per issue.
        self.boilerplates = cachetools.TTLCache(maxsize=4096, ttl=3600)


@dataclass
class Context:
    delivery_id: str
    repo_name: str
    repo: RepoClient
    services: Services
    payload: dict[str, Any]

    async def repo_config(self) -> RepoConfig:
        """The repository's config; raises RepoConfigError (cached as well, so a broken file is
        reported once per TTL, not once per delivery)."""
        key = self.repo_name.lower()
        cached = self.services.repo_configs.get(key)
        if cached is None:
            async with self.services.fetch_lock("config:" + key):
                cached = self.services.repo_configs.get(key)
                if cached is None:
                    text = await self.repo.read_file(CONFIG_PATH)
                    try:
                        cached = parse_repo_config(text,
                                                   source=f"{self.repo_name}:{CONFIG_PATH}")
                    except RepoConfigError as exc:
                        cached = exc
                    self.services.repo_configs[key] = cached
        if isinstance(cached, RepoConfigError):
            raise cached
        return cached

    async def boilerplate(self) -> Boilerplate:
        key = self.repo_name.lower()
        cached = self.services.boilerplates.get(key)
        if cached is not None:
            return cached
        async with self.services.fetch_lock("templates:" + key):
            cached = self.services.boilerplates.get(key)
            if cached is not None:
                return cached
            return await self._fetch_boilerplate(key)

    async def _fetch_boilerplate(self, key: str) -> Boilerplate:
        texts: list[str] = []
        for path in await self.repo.list_dir(TEMPLATE_DIR):
            if path.lower().endswith((".md", ".yml", ".yaml")):
                text = await self.repo.read_file(path)
                if text:
                    texts.append(text)
        learned = await asyncio.to_thread(learn_boilerplate, texts)
        self.services.boilerplates[key] = learned
        return learned
