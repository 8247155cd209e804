"""What a handler gets: the delivery, a client for its repository, and the process's services."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import cachetools

from bot.db.store import Store
from bot.github.app import GitHubApp
from bot.github.client import RepoClient, RepoFiles, Visibility
from bot.matching import Boilerplate, learn_boilerplate
from bot.matching.index import IndexHolder
from bot.repo_config import (
    CONFIG_PATH,
    ConfigFile,
    ConfigProblem,
    RepoConfig,
    RepoConfigError,
    extends_target,
    merge_config_files,
    read_config_file,
)
from bot.settings import ServiceConfig

if TYPE_CHECKING:
    from bot.features.repo_sources import RepoSources

_V = TypeVar("_V")

log = logging.getLogger("dejafix.handlers")

TEMPLATE_DIR = ".github/ISSUE_TEMPLATE"
# Where an organisation (or user) keeps defaults for every repository without its own file.
ORG_CONFIG_REPO = ".github"


@dataclass(frozen=True)
class ResolvedConfig:
    """A repository's config (or why it cannot be used) and every repository whose file it was
    read from or looked for: a push changing any of them drops it from the cache."""

    result: RepoConfig | RepoConfigError
    sources: frozenset[str]
    # The line of ``_extends`` in the file read, where problems of the extended file are shown.
    extends_line: int | None = None


async def resolve_repo_config(repo: RepoClient, repo_name: str, *,
                              ref: str | None = None,
                              read_org: Callable[[str], Awaitable[str | None]] | None = None,
                              read_own: Callable[[], Awaitable[str | None]] | None = None
                              ) -> ResolvedConfig:
    """``.github/dejafix.yml`` of ``repo_name`` (at ``ref``, else the default branch); when the
    default branch has none, the one of ``{owner}/.github``. ``_extends: repo`` (same owner) or
    ``owner/repo`` is read from that repository's default branch and merged underneath; one
    level is followed and a cycle is refused."""
    sources = {repo_name.lower()}
    name = repo_name
    text = await (read_own() if read_own is not None and ref is None
                  else repo.read_file_from(repo_name, CONFIG_PATH, ref))
    if text is None and ref is None:
        owner = repo_name.split("/", 1)[0]
        org_repo = f"{owner}/{ORG_CONFIG_REPO}"
        if org_repo.lower() != repo_name.lower():
            sources.add(org_repo.lower())
            text = await (read_org(org_repo) if read_org is not None
                          else repo.read_file_from(org_repo, CONFIG_PATH))
            name = org_repo
    if text is None:
        return ResolvedConfig(RepoConfig(), frozenset(sources))
    return await resolve_config_text(repo, name, text, sources)


async def resolve_config_text(repo: RepoClient, name: str, text: str,
                              sources: set[str] | None = None) -> ResolvedConfig:
    """``text``, the config file of repository ``name``, validated, with its ``_extends``
    (read from the default branch of the repository it names) merged underneath."""
    sources = set(sources or ()) | {name.lower()}
    own = None
    try:
        own = read_config_file(text, source=f"{name}:{CONFIG_PATH}")
        return ResolvedConfig(await _extend(repo, name, own, sources), frozenset(sources),
                              own.extends_line)
    except RepoConfigError as exc:
        return ResolvedConfig(exc, frozenset(sources), own.extends_line if own else None)


async def _extend(repo: RepoClient, name: str, own: ConfigFile, sources: set[str]
                  ) -> RepoConfig:
    if own.extends is None:
        return own.config
    target = extends_target(own.extends, name.split("/", 1)[0])
    sources.add(target.lower())
    if target.lower() == name.lower():
        raise RepoConfigError([ConfigProblem(
            own.extends_line, "_extends", f"{own.extends} is this repository itself",
            own.source)])
    base_text = await repo.read_file_from(target, CONFIG_PATH)
    if base_text is None:
        raise RepoConfigError([ConfigProblem(
            own.extends_line, "_extends",
            f"{target} has no {CONFIG_PATH} (or it cannot be read)", own.source)])
    base = read_config_file(base_text, source=f"{target}:{CONFIG_PATH}")
    if base.extends is not None:
        further = extends_target(base.extends, target.split("/", 1)[0])
        message = (f"cycle: {target} extends {further} back" if further.lower() in sources
                   else f"{target} extends {further} in turn; only one level of _extends "
                        "is followed")
        raise RepoConfigError([ConfigProblem(own.extends_line, "_extends", message,
                                             own.source)])
    return merge_config_files(base, own)


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
    # Repositories' own ``clusters:`` (their files and feeds); None: not read (tools, tests).
    repo_sources: RepoSources | None = None
    # (installation id, repository lower) -> the resolved config or its error.
    repo_configs: cachetools.TTLCache[tuple[int | None, str], ResolvedConfig] = field(
        init=False
    )
    # Bumped by every drop, so a fetch that started before it does not store a stale answer.
    config_epoch: int = field(init=False, default=0)
    boilerplates: cachetools.TTLCache[str, Boilerplate] = field(init=False)
    # (installation id, repository lower) -> its latest releases, (tag, published_at).
    releases: cachetools.TTLCache[tuple[int | None, str], list[tuple[str, str]]] = field(
        init=False)
    # One fetch per repository at a time: deliveries for several issues of one repository arrive
    # together, and without it each would miss the cache and read the same files.
    fetch_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = field(
        init=False, default_factory=weakref.WeakValueDictionary)
    # repository (lower) -> the cluster index version under which its having no clusters was
    # logged: said once per version, not once per issue.
    no_clusters_logged: dict[str, str] = field(init=False, default_factory=dict)
    # repository (lower) -> the App's installation id on it (None: not installed), for the web
    # page, which has no delivery to read it from.
    installations: cachetools.TTLCache[str, int | None] = field(init=False)
    # (installation id, repository lower) -> its config file and issue templates, read at once
    # (one GraphQL call) when neither is cached: a cold repository's config and templates.
    repo_files: cachetools.TTLCache[tuple[int | None, str], tuple[RepoFiles | None]] = field(
        init=False)
    # (installation id, "{owner}/.github" lower) -> its config file's text (or None: none):
    # the fallback of every repository of that owner without a file of its own, read once
    # for all of them per cache time, not once per repository.
    org_files: cachetools.TTLCache[tuple[int | None, str], tuple[str | None]] = field(
        init=False)
    # (installation id, repository lower) -> how that installation is shown the repository
    # (None: hidden from it), for the upstreams rule. Short-lived: a repository made private
    # must stop being an upstream within a minute.
    visibilities: cachetools.TTLCache[tuple[int | None, str], tuple[Visibility | None]] = field(
        init=False)
    # (installation id, repository lower, upstream lower, reason) of refused upstreams already
    # logged: said once per five minutes, not once per issue.
    refusals_logged: cachetools.TTLCache[tuple[int | None, str, str, str], bool] = field(
        init=False)

    def fetch_lock(self, key: str) -> asyncio.Lock:
        lock = self.fetch_locks.get(key)
        if lock is None:
            lock = asyncio.Lock()
            self.fetch_locks[key] = lock
        return lock

    def cached_repo_config(self, key: tuple[int | None, str]) -> ResolvedConfig | None:
        """The cached config for (installation, repository). A delivery without an
        installation (GitHub always sends one to an App; hand-made payloads may not) reads
        anonymously, and may use what an installation of the same repository read."""
        cached = self.repo_configs.get(key)
        if cached is None and key[0] is None:
            for (_, name), value in list(self.repo_configs.items()):
                if name == key[1]:
                    return value
        return cached

    def forget_repo_config(self, repo_name: str) -> int:
        """Drop every cached config read from ``repo_name``'s file (its own, and those of
        repositories falling back to it or extending it). Returns how many were dropped."""
        name = repo_name.lower()
        self.config_epoch += 1
        stale = [key for key, value in list(self.repo_configs.items())
                 if key[1] == name or name in value.sources]
        for key in stale:
            self.repo_configs.pop(key, None)
        for org_key in [k for k in list(self.org_files) if k[1] == name]:
            self.org_files.pop(org_key, None)
        for files_key in [k for k in list(self.repo_files) if k[1] == name]:
            self.repo_files.pop(files_key, None)
        return len(stale)

    def forget_all_configs(self) -> None:
        """Drop every cached config (notifications from other processes may have been lost)."""
        self.config_epoch += 1
        self.repo_configs.clear()
        self.org_files.clear()
        self.repo_files.clear()

    def __post_init__(self) -> None:
        ttl = max(self.config.repo_config_ttl, 0.001)
        self.repo_configs = cachetools.TTLCache(maxsize=4096, ttl=ttl)
        # Templates change rarely; an hour is plenty and saves a folder listing per issue.
        self.boilerplates = cachetools.TTLCache(maxsize=4096, ttl=3600)
        # Releases: a new one within the hour only matters for a fix released in it.
        self.releases = cachetools.TTLCache(maxsize=4096, ttl=3600)
        self.installations = cachetools.TTLCache(maxsize=4096, ttl=300)
        self.visibilities = cachetools.TTLCache(maxsize=4096, ttl=60)
        self.refusals_logged = cachetools.TTLCache(maxsize=4096, ttl=300)
        self.org_files = cachetools.TTLCache(maxsize=4096, ttl=ttl)
        # Only long enough for a cold repository's config and templates to share the read.
        self.repo_files = cachetools.TTLCache(maxsize=4096, ttl=min(ttl, 60.0))


@dataclass
class Context:
    delivery_id: str
    repo_name: str
    repo: RepoClient
    services: Services
    payload: dict[str, Any]
    # Which attempt at the delivery this is: a first attempt at a newly opened issue cannot
    # have posted our comment yet, so it need not look among the comments for it.
    attempt: int = 1

    @property
    def installation_id(self) -> int | None:
        inst = self.payload.get("installation")
        value = inst.get("id") if isinstance(inst, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    async def repo_config(self) -> RepoConfig:
        """The repository's config (its own file, else its owner's ``.github`` repository's;
        ``_extends`` merged underneath); raises RepoConfigError (cached as well, so a broken
        file is reported once per TTL, not once per delivery)."""
        key = (self.installation_id, self.repo_name.lower())
        cached = self.services.cached_repo_config(key)
        if cached is None:
            async with self.services.fetch_lock(f"config:{key[0]}:{key[1]}"):
                cached = self.services.cached_repo_config(key)
                if cached is None:
                    epoch = self.services.config_epoch
                    cached = await resolve_repo_config(self.repo, self.repo_name,
                                                       read_org=self._org_file,
                                                       read_own=self._own_file)
                    if epoch == self.services.config_epoch:
                        self.services.repo_configs[key] = cached
        if isinstance(cached.result, RepoConfigError):
            raise cached.result
        return cached.result

    async def _org_file(self, org_repo: str) -> str | None:
        """The owner's ``.github`` config file, read once per cache time for all its
        repositories (per installation: a private one stays with its readers)."""
        key = (self.installation_id, org_repo.lower())
        epoch = self.services.config_epoch

        async def fetch() -> tuple[str | None]:
            return (await self.repo.read_file_from(org_repo, CONFIG_PATH),)

        cached = self.services.org_files.get(key)
        if cached is None:
            async with self.services.fetch_lock(f"org:{key[0]}:{key[1]}"):
                cached = self.services.org_files.get(key)
                if cached is None:
                    cached = await fetch()
                    if epoch == self.services.config_epoch:
                        self.services.org_files[key] = cached
        return cached[0]

    async def _files(self) -> RepoFiles | None:
        """The config file and templates in one call (None: read them over REST)."""
        key = (self.installation_id, self.repo_name.lower())
        epoch = self.services.config_epoch
        cached = self.services.repo_files.get(key)
        if cached is None:
            async with self.services.fetch_lock(f"files:{key[0]}:{key[1]}"):
                cached = self.services.repo_files.get(key)
                if cached is None:
                    cached = (await self.repo.read_files(CONFIG_PATH, TEMPLATE_DIR),)
                    if epoch == self.services.config_epoch:
                        self.services.repo_files[key] = cached
        return cached[0]

    async def _own_file(self) -> str | None:
        """The repository's own config file. With its templates not cached either (a cold
        repository), both are read in one call; otherwise the file alone, conditionally."""
        if self.services.boilerplates.get(self.repo_name.lower()) is None:
            files = await self._files()
            if files is not None:
                return files.config
        return await self.repo.read_file_from(self.repo_name, CONFIG_PATH)

    async def boilerplate(self) -> Boilerplate:
        key = self.repo_name.lower()
        return await self._cached(self.services.boilerplates, key, "templates:" + key,
                                  self._fetch_boilerplate)

    async def _cached(self, cache: cachetools.TTLCache[Any, _V], key: Any, lock: str,
                      fetch: Callable[[], Awaitable[_V]]) -> _V:
        """``cache[key]``, fetched once at a time per ``lock`` when missing: deliveries for one
        repository arrive together, and without the lock each would read the same thing. A
        fetch that raises stores nothing."""
        cached = cache.get(key)
        if cached is not None:
            return cached
        async with self.services.fetch_lock(lock):
            cached = cache.get(key)
            if cached is None:
                cached = cache[key] = await fetch()
            return cached

    async def _fetch_boilerplate(self) -> Boilerplate:
        texts: list[str] = []
        files = await self._files()
        if files is not None:
            texts = [text for path, text in files.templates
                     if path.lower().endswith((".md", ".yml", ".yaml")) and text]
            return await asyncio.to_thread(learn_boilerplate, texts)
        for path in await self.repo.list_dir(TEMPLATE_DIR):
            if path.lower().endswith((".md", ".yml", ".yaml")):
                text = await self.repo.read_file(path)
                if text:
                    texts.append(text)
        return await asyncio.to_thread(learn_boilerplate, texts)

    async def releases(self, repo: str) -> list[tuple[str, str]]:
        """``repo``'s latest releases, ``(tag, published_at)``, read once an hour per
        repository (and installation: a private repository's tags stay with its readers).
        A failed read raises and is not cached."""
        key = (self.installation_id, repo.lower())
        return await self._cached(self.services.releases, key,
                                  f"releases:{key[0]}:{key[1]}", lambda: self.repo.releases(repo))

    async def visibility(self, repo: str) -> Visibility | None:
        """How ``repo`` is shown to this delivery's installation (None: hidden from it), read
        once a minute per installation and repository. A failed read raises and is not
        cached."""
        key = (self.installation_id, repo.lower())

        async def fetch() -> tuple[Visibility | None]:
            return (await self.repo.visibility(repo),)

        cached = await self._cached(self.services.visibilities, key,
                                    f"visibility:{key[0]}:{key[1]}", fetch)
        return cached[0]
