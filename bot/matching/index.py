"""The live cluster index of the curated clusters (cluster files and feeds): one matcher per
repository, built off the event loop from one version of the files, and swapped in whole when
they change. Learned clusters are indexed per repository, when needed (``repo_indexes``);
``IndexHolder.view`` gives a delivery the index of the repositories it asks about.

Per repository, because IDF is a property of a repository's vocabulary (a word rare in one
project is everyday in another) and a change to one repository's clusters need not rebuild the
others'. Immutable once built, so a delivery ranks against one consistent version even while the
next one is being built.

Where it is built depends on its size. A few thousand clusters index in a worker thread in well
under a second. A large set (100,000 clusters take seconds of CPU) is built in a separate process,
which writes the index as arrays under the index directory; this process memory-maps them. The
event loop then never competes with the build for the GIL, the build's transient memory goes back
to the system when its process ends, and a restart with unchanged inputs maps the saved index
instead of building it again (``builds``, which the per-repository indexes build through too).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path
from typing import Protocol

from bot.clusters.load import SUFFIXES
from bot.clusters.models import Cluster
from bot.matching import Boilerplate, IssueText, Match, Matcher, MatchPolicy
from bot.matching.arrays import IndexArrays
from bot.matching.builds import (
    INDEX_KIND,
    PARALLEL_BUILD_BYTES,
    PROCESS_BUILD_BYTES,
    Builders,
    IndexDir,
    SavedBuild,
    build_arrays,
    build_in_process,
    build_workers,
    code_version,
    collector_paused,
    load_or_build,
)
from bot.matching.scoring import bounded

log = logging.getLogger("dejafix.index")

class ClusterIndex:
    def __init__(self, clusters: Iterable[Cluster] = (), *, version: str = "",
                 reuse: ClusterIndex | None = None) -> None:
        """An index of ``clusters``, built here (tests and tools; the bot uses ``build_index``)."""
        builders = Builders()
        with collector_paused():
            for cluster in clusters:
                builders.add(cluster)
            arrays = builders.finish()
        self._init(arrays, version=version, reuse=reuse)

    @classmethod
    def from_arrays(cls, arrays: dict[str, IndexArrays], *, version: str = "",
                    reuse: ClusterIndex | None = None) -> ClusterIndex:
        index = cls.__new__(cls)
        index._init(arrays, version=version, reuse=reuse)
        return index

    def _init(self, arrays: dict[str, IndexArrays], *, version: str,
              reuse: ClusterIndex | None) -> None:
        self.version = version
        self.size = sum(a.n for a in arrays.values())
        self._matchers: dict[str, Matcher] = {}
        for repo, repo_arrays in arrays.items():
            old = reuse._matchers.get(repo) if reuse is not None else None
            if old is not None and old.arrays.fingerprint == repo_arrays.fingerprint:
                self._matchers[repo] = old  # unchanged repository: keep its index (and caches)
            else:
                self._matchers[repo] = Matcher(arrays=repo_arrays)

    @classmethod
    def of(cls, matchers: dict[str, Matcher], *, version: str) -> ClusterIndex:
        """An index of matchers built already (``IndexHolder.view``)."""
        index = cls.__new__(cls)
        index.version = version
        index.size = sum(len(m) for m in matchers.values())
        index._matchers = dict(matchers)
        return index

    def matcher(self, repo: str) -> Matcher | None:
        return self._matchers.get(repo.lower())

    @property
    def repos(self) -> list[str]:
        return sorted(self._matchers)

    def count(self, repo: str) -> int:
        matcher = self._matchers.get(repo.lower())
        return len(matcher) if matcher is not None else 0

    def clusters(self, repo: str) -> list[Cluster]:
        """Every cluster of a repository, rebuilt from the index: for tools and tests."""
        matcher = self._matchers.get(repo.lower())
        return matcher.clusters if matcher is not None else []

    def find(self, repo: str, public_id: str | None = None, kind: str | None = None,
             number: int | None = None) -> Cluster | None:
        """A repository's cluster by id, or the first with issue/PR ``number`` as a member (or
        a PR as its landed fix)."""
        matcher = self._matchers.get(repo.lower())
        if matcher is None:
            return None
        i = matcher.find(public_id, kind, number)
        return matcher.cluster(i) if i is not None else None

    def rank(self, issue: IssueText, repos: Collection[str], *, limit: int = 5,
             policy: MatchPolicy | None = None, boilerplate: Boilerplate | None = None
             ) -> list[Match]:
        """Candidates from each named repository's index, best first."""
        issue = bounded(issue)
        found: list[Match] = []
        for repo in dict.fromkeys(r.lower() for r in repos):
            matcher = self._matchers.get(repo)
            if matcher is not None:
                found.extend(matcher.rank(issue, None, limit=limit, policy=policy,
                                          boilerplate=boilerplate))
        found.sort(key=lambda m: -m.score)
        return found[:limit]


def files_version(paths: Iterable[Path]) -> str:
    """A cheap version of the cluster files: names, sizes and modification times."""
    entries: list[str] = []
    for file, st in _cluster_files(paths):
        entries.append(f"{file}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def files_bytes(paths: Iterable[Path]) -> int:
    return sum(st.st_size for _, st in _cluster_files(paths))


def _cluster_files(paths: Iterable[Path]) -> Iterator[tuple[Path, os.stat_result]]:
    for path in paths:
        try:
            candidates = sorted(path.iterdir()) if path.is_dir() else [path]
        except OSError:
            continue
        for file in candidates:
            if file.suffix in SUFFIXES and not file.name.startswith("."):
                try:
                    yield file, os.stat(file)
                except OSError:
                    continue


def build_index(paths: list[Path], reuse: ClusterIndex | None = None) -> ClusterIndex:
    """Load and index every cluster file, here. CPU-bound: run it in a thread, never on the
    loop; large inputs go to ``build_in_process`` instead."""
    version = files_version(paths)
    arrays, report = build_arrays(paths, ())
    for error in report.errors:
        log.warning("clusters: %s", error)
    index = ClusterIndex.from_arrays(arrays, version=version, reuse=reuse)
    log.info("clusters: %d loaded for %d repositories (version %s)", index.size,
             len(index.repos), version)
    return index


class LearnedIndexes(Protocol):
    """The per-repository indexes of learned clusters, as the holder uses them
    (``repo_indexes.RepoIndexes``, which the app makes and hands to it)."""

    async def matcher(self, repo: str, curated: Matcher | None) -> Matcher | None: ...

    def resident(self, repo: str) -> bool: ...


class IndexHolder:
    """The curated index in use (cluster files and feeds), its replacement when they change, and
    the per-repository indexes of learned clusters (``learned``). Readers take ``view`` of the
    repositories they need once per delivery; a swap is one attribute assignment, atomic for
    them.

    ``index_dir`` is where large builds write their arrays (a temporary directory when not
    given); pass the same ``IndexDir`` to the ``RepoIndexes`` handed in as ``learned``, so that
    both write under one directory. Without ``learned`` only the curated clusters are matched.
    The holder knows nothing of the store: the app gives ``learned`` its callables."""

    def __init__(self, paths: list[Path], builder: Callable[..., ClusterIndex] = build_index,
                 *, index_dir: Path | IndexDir | None = None,
                 learned: LearnedIndexes | None = None,
                 process_above: int = PROCESS_BUILD_BYTES,
                 parallel_above: int = PARALLEL_BUILD_BYTES) -> None:
        self.paths = paths
        self.builder = builder
        self.process_above = process_above
        self.parallel_above = parallel_above
        self._dir = index_dir if isinstance(index_dir, IndexDir) else IndexDir(index_dir)
        self.current = ClusterIndex([], version="empty")
        self.saved: SavedBuild | None = None
        self._lock = asyncio.Lock()
        self.learned = learned

    @property
    def index_dir(self) -> Path | None:
        """The directory builds write under: None until one is needed, when not given."""
        return self._dir.path

    async def view(self, repos: Iterable[str]) -> ClusterIndex:
        """The index of ``repos`` as it stands: each one's curated clusters, and its learned
        ones when it has any (its own index, built now when it is not resident or is out of
        date). Take it once per delivery: it is immutable."""
        base = self.current
        wanted = list(dict.fromkeys(r.lower() for r in repos))
        if self.learned is None:
            found = [base.matcher(r) for r in wanted]
        else:
            learned = self.learned
            found = list(await asyncio.gather(*(learned.matcher(r, base.matcher(r))
                                                for r in wanted)))
        matchers = {r: m for r, m in zip(wanted, found, strict=True) if m is not None}
        digest = hashlib.sha256(base.version.encode())
        for repo, matcher in sorted(matchers.items()):
            digest.update(f"{repo}:{matcher.arrays.fingerprint}".encode())
        return ClusterIndex.of(matchers, version=digest.hexdigest()[:16])

    async def learned_changed(self, repo: str) -> None:
        """A cluster of ``repo`` was learned: a resident index of it is rebuilt now, so the
        next issue does not wait for it (one not resident is built when next needed)."""
        if self.learned is not None and self.learned.resident(repo):
            await self.view([repo])

    async def refresh(self, *, force: bool = False) -> bool:
        """Rebuild the curated index off the loop if its files changed; True when a new one
        was swapped in. One build at a time; the event loop only awaits it."""
        async with self._lock:
            version = await asyncio.to_thread(files_version, self.paths)
            if not force and version == self.current.version:
                return False
            size = await asyncio.to_thread(files_bytes, self.paths)
            if size > self.process_above and self.builder is build_index:
                workers = build_workers() if size > self.parallel_above else 0
                index = await self._build_elsewhere(version, workers)
            else:
                index = await asyncio.to_thread(self.builder, self.paths, self.current)
            self.current = index
            return True

    async def _build_elsewhere(self, version: str, workers: int) -> ClusterIndex:
        root = await asyncio.to_thread(self._dir)
        full = f"{version}/{code_version()}/{INDEX_KIND}"

        async def build() -> SavedBuild:
            started = time.perf_counter()
            saved = await build_in_process(self.paths, None, full, root, workers)
            log.info("clusters: built in a separate process in %.1fs (peak memory %d MB, and"
                     " %d MB in each of %d workers)", time.perf_counter() - started,
                     saved.peak_rss_kb // 1024, saved.worker_peak_rss_kb // 1024, saved.workers)
            _log_errors(saved)
            return saved

        def load(saved: SavedBuild) -> ClusterIndex:
            return ClusterIndex.from_arrays(saved.arrays(), version=saved.version,
                                            reuse=self.current)

        loaded = await load_or_build(root, full, build, load, rebuild_unreadable=True)
        saved, index = loaded.saved, loaded.value
        if loaded.mapped:
            log.info("clusters: version %s already built in %s; mapped, not rebuilt",
                     version, saved.directory)
            _log_errors(saved)
        index.version = version
        log.info("clusters: %d loaded for %d repositories (version %s)", index.size,
                 len(index.repos), version)
        self.saved = saved
        return index

    async def settled(self) -> None:
        """Return once no rebuild is running (one in progress is waited for)."""
        async with self._lock:
            return

    async def watch(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self.refresh()
            except Exception:
                log.exception("clusters: reload failed; the previous index stays in use")


def _log_errors(saved: SavedBuild) -> None:
    for error in saved.errors:
        log.warning("clusters: %s", error)
