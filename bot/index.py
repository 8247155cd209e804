"""The live cluster index: one matcher per repository, built off the event loop from one
version of the cluster files, and swapped in whole when the files change.

Per repository, because IDF is a property of a repository's vocabulary (a word rare in one
project is everyday in another) and a change to one repository's clusters need not rebuild the
others'. Immutable once built, so a delivery ranks against one consistent version even while the
next one is being built.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import os
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from bot.clusters.load import SUFFIXES, load_clusters
from bot.clusters.models import Cluster
from bot.matching import Boilerplate, IssueText, Match, Matcher, MatchPolicy

log = logging.getLogger("dejafix.index")


class ClusterIndex:
    def __init__(self, clusters: Iterable[Cluster], *, version: str = "",
                 reuse: ClusterIndex | None = None, semantic: bool = False) -> None:
        by_repo: dict[str, list[Cluster]] = defaultdict(list)
        for cluster in clusters:
            by_repo[cluster.repo.lower()].append(cluster)
        self.version = version
        self.size = sum(len(v) for v in by_repo.values())
        self._fingerprints = {repo: _fingerprint(cs) for repo, cs in by_repo.items()}
        self._matchers: dict[str, Matcher] = {}
        for repo, group in by_repo.items():
            old = reuse._matchers.get(repo) if reuse is not None else None
            if old is not None and reuse is not None and \
                    reuse._fingerprints.get(repo) == self._fingerprints[repo]:
                self._matchers[repo] = old  # unchanged repository: keep its index
            else:
                self._matchers[repo] = Matcher(group, semantic=semantic)

    @property
    def repos(self) -> list[str]:
        return sorted(self._matchers)

    def clusters(self, repo: str) -> list[Cluster]:
        matcher = self._matchers.get(repo.lower())
        return matcher.clusters if matcher is not None else []

    def rank(self, issue: IssueText, repos: Collection[str], *, limit: int = 5,
             policy: MatchPolicy | None = None, boilerplate: Boilerplate | None = None
             ) -> list[Match]:
        """Candidates from each named repository's index, best first."""
        found: list[Match] = []
        for repo in dict.fromkeys(r.lower() for r in repos):
            matcher = self._matchers.get(repo)
            if matcher is not None:
                found.extend(matcher.rank(issue, None, limit=limit, policy=policy,
                                          boilerplate=boilerplate))
        found.sort(key=lambda m: -m.score)
        return found[:limit]


def _fingerprint(clusters: list[Cluster]) -> str:
    digest = hashlib.sha256()
    for cluster in clusters:
        digest.update(cluster.model_dump_json().encode())
    return digest.hexdigest()


def files_version(paths: Iterable[Path]) -> str:
    """A cheap version of the cluster files: names, sizes and modification times."""
    entries: list[str] = []
    for path in paths:
        candidates = sorted(path.iterdir()) if path.is_dir() else [path]
        for file in candidates:
            if file.suffix in SUFFIXES and not file.name.startswith("."):
                try:
                    st = os.stat(file)
                except OSError:
                    continue
                entries.append(f"{file}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def merge_learned(given: list[Cluster], learned: Iterable[Cluster]) -> list[Cluster]:
    """File and feed clusters, plus learned ones that fill the gaps: a learned cluster whose
    issues a given cluster already names is left out (the curated record wins), as is one whose
    id a given cluster of the same repository already uses."""
    named: set[tuple[str, int]] = set()
    ids: set[tuple[str, str]] = set()
    for cluster in given:
        ids.add(cluster.key)
        for m in cluster.members:
            if m.kind == "issue":
                named.add((cluster.repo.lower(), m.number))
    merged = {c.key: c for c in given}
    for cluster in learned:
        if cluster.key in ids:
            # The one learned fact that overrides a curated record: its fix was reverted, or
            # the repository closed another report as its duplicate.
            curated = merged[cluster.key]
            if cluster.landed_fix.reverted or len(cluster.members) > len(curated.members):
                merged[cluster.key] = cluster
            continue
        repo = cluster.repo.lower()
        issues = [m.number for m in cluster.members if m.kind == "issue"]
        if any((repo, n) in named for n in issues):
            continue
        merged[cluster.key] = cluster
    return list(merged.values())


LearnedSource = Callable[[], tuple[str, list[Cluster]]]


def build_index(paths: list[Path], reuse: ClusterIndex | None = None,
                learned: LearnedSource | None = None, semantic: bool = False) -> ClusterIndex:
    """Load and index every cluster file (and the learned clusters). CPU-bound: run it in a
    thread, never on the loop.

    The cyclic garbage collector is paused while building: a build allocates millions of
    objects, and each full collection it triggers walks all of them while holding the GIL, which
    stalled the event loop for seconds at 100,000 clusters. Afterwards the survivors are frozen
    (moved out of the collector's generations), so later collections do not walk the index
    either; reference counting still frees an old index once it is swapped out."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        index = _build(paths, reuse, learned, semantic)
    finally:
        if was_enabled:
            gc.enable()
    gc.freeze()
    return index


def _build(paths: list[Path], reuse: ClusterIndex | None, learned: LearnedSource | None,
           semantic: bool) -> ClusterIndex:
    version = files_version(paths)
    report = load_clusters(paths)
    for error in report.errors:
        log.warning("clusters: %s", error)
    clusters = report.clusters
    if learned is not None:
        learned_version, learned_clusters = learned()
        version += "+" + learned_version
        clusters = merge_learned(clusters, learned_clusters)
    index = ClusterIndex(clusters, version=version, reuse=reuse, semantic=semantic)
    log.info("clusters: %d loaded for %d repositories (version %s)", index.size,
             len(index.repos), version)
    return index


class IndexHolder:
    """The index in use, and its replacement when the files change. Readers take ``current``
    once per delivery; the swap is one attribute assignment, atomic for them."""

    def __init__(self, paths: list[Path], builder: Callable[..., ClusterIndex] = build_index,
                 learned: LearnedSource | None = None,
                 learned_version: Callable[[], str] | None = None,
                 semantic: bool = False) -> None:
        self.paths = paths
        self.semantic = semantic
        self.builder = builder
        self.learned = learned
        self.learned_version = learned_version
        self.current = ClusterIndex([], version="empty")
        self._lock = asyncio.Lock()

    async def refresh(self, *, force: bool = False) -> bool:
        """Rebuild in a worker thread if the files changed; True when a new index was swapped in.
        One build at a time; the event loop only awaits it."""
        async with self._lock:
            version = await asyncio.to_thread(self._version)
            if not force and version == self.current.version:
                return False
            index = await asyncio.to_thread(self.builder, self.paths, self.current,
                                            self.learned, self.semantic)
            self.current = index
            return True

    def _version(self) -> str:
        version = files_version(self.paths)
        if self.learned_version is not None:
            version += "+" + self.learned_version()
        return version

    async def watch(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await self.refresh()
            except Exception:
                log.exception("clusters: reload failed; the previous index stays in use")
