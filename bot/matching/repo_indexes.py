"""Per-repository indexes of learned clusters, built when a repository's first issue arrives,
kept while it is used and dropped least-recently-used past a memory budget.

The curated clusters (cluster files and feeds) are indexed together by ``IndexHolder``, mapped
from disk when large; a repository with none learned answers from that index as it is. A
repository with learned clusters in the store gets an index of its own: its curated records
(read back from the curated index, byte for byte) and its learned ones, merged by the same
rules as ever (``builds.build_arrays``: the curated record wins). A store of 5,000 repositories
with 100 learned clusters each is then never indexed at once: a process holds the indexes of
the repositories it is answering for, up to ``index_memory_mb``.

An index is keyed by what it was built from: the curated index's fingerprint of the repository
and the store's learned version of it (count and latest write, one indexed read per delivery).
A cluster learned by any process sharing the store changes the version, and the next issue of
that repository, here or in another process, builds the new index; a feed update changes the
fingerprints of the repositories it touches and no other. Builds run off the event loop (a
thread; a separate process, mapped from disk after, for a repository whose inputs are large), a
few at a time, one at a time per repository.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import weakref
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path

from bot.matching.builds import (
    INDEX_KIND,
    LEARNED_RECORD_BYTES,
    PROCESS_BUILD_BYTES,
    SavedBuild,
    build_arrays,
    build_in_process,
    code_version,
    load_or_build,
    write_learned,
)
from bot.matching.scoring import Matcher

log = logging.getLogger("dejafix.index")

# A repository's learned clusters: how many, and a version that changes on every write.
LearnedState = Callable[[str], tuple[int, str]]
# Their raw JSON records, streamed (the stream may hold a connection: it is closed after).
LearnedRecords = Callable[[str], Iterable[str]]

# Builds at once: each is CPU work in a thread, and the event loop needs the GIL too.
BUILDS_AT_ONCE = 2


@dataclass
class _Entry:
    key: tuple[str, str]  # (the curated index's fingerprint of the repository, learned version)
    matcher: Matcher | None  # None: every learned record was invalid and there is no curated one
    nbytes: int


@dataclass
class RepoIndexStats:
    resident: int
    resident_bytes: int
    budget_bytes: int
    builds: int
    evictions: int


class RepoIndexes:
    """``root`` gives the directory large builds write under (the ``IndexDir`` the curated
    index's ``IndexHolder`` uses); without it every build runs in a thread."""

    def __init__(self, learned_state: LearnedState, learned_records: LearnedRecords, *,
                 budget_bytes: int,
                 root: Callable[[], Path] | None = None,
                 process_above: int = PROCESS_BUILD_BYTES,
                 on_build: Callable[[], object] | None = None,
                 on_evict: Callable[[], object] | None = None) -> None:
        self.learned_state = learned_state
        self.learned_records = learned_records
        self.budget_bytes = budget_bytes
        self._root = root
        self.process_above = process_above
        self._on_build = on_build
        self._on_evict = on_evict
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        # One build per repository at a time; a lock lives while a delivery holds it.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = \
            weakref.WeakValueDictionary()
        self._gate = asyncio.Semaphore(BUILDS_AT_ONCE)
        self.resident_bytes = 0
        self.builds = 0
        self.evictions = 0

    def stats(self) -> RepoIndexStats:
        return RepoIndexStats(len(self._entries), self.resident_bytes, self.budget_bytes,
                              self.builds, self.evictions)

    def resident(self, repo: str) -> bool:
        return repo.lower() in self._entries

    async def matcher(self, repo: str, curated: Matcher | None) -> Matcher | None:
        """``repo``'s index: ``curated`` (its part of the curated index) when it has no learned
        clusters, else its own, built now if it is not resident or is out of date."""
        repo = repo.lower()
        count, version = await asyncio.to_thread(self.learned_state, repo)
        if count == 0:
            self._drop(repo)  # nothing learned (any more): the curated index serves it
            return curated
        key = (curated.arrays.fingerprint if curated is not None else "", version)
        entry = self._fresh(repo, key)
        if entry is not None:
            return entry.matcher
        lock = self._locks.get(repo)
        if lock is None:
            lock = self._locks[repo] = asyncio.Lock()
        async with lock:
            entry = self._fresh(repo, key)  # built by the delivery this one waited for
            if entry is None:
                try:
                    async with self._gate:
                        matcher = await self._build(repo, curated, key, count)
                except Exception as exc:
                    # The store or the disk failed: answer from what there is (the index built
                    # before, else the curated clusters); the next issue tries again.
                    old = self._entries.get(repo)
                    log.warning("clusters: %s's index could not be built (%s: %s); using %s",
                                repo, type(exc).__name__, exc,
                                "the previous one" if old else "its curated clusters")
                    return old.matcher if old is not None else curated
                entry = _Entry(key, matcher, matcher.arrays.nbytes if matcher else 0)
                self._put(repo, entry)
            return entry.matcher

    def _fresh(self, repo: str, key: tuple[str, str]) -> _Entry | None:
        entry = self._entries.get(repo)
        if entry is None or entry.key != key:
            return None
        self._entries.move_to_end(repo)
        return entry

    def _put(self, repo: str, entry: _Entry) -> None:
        self._drop(repo)
        self._entries[repo] = entry
        self.resident_bytes += entry.nbytes
        # The one just built stays, even over the budget alone: it is about to be used.
        while self.resident_bytes > self.budget_bytes and len(self._entries) > 1:
            old, dropped = self._entries.popitem(last=False)
            self.resident_bytes -= dropped.nbytes
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict()
            log.debug("clusters: %s's index dropped (least recently used; %d MB resident, "
                      "budget %d MB)", old, self.resident_bytes >> 20, self.budget_bytes >> 20)

    def _drop(self, repo: str) -> None:
        entry = self._entries.pop(repo, None)
        if entry is not None:
            self.resident_bytes -= entry.nbytes

    async def _build(self, repo: str, curated: Matcher | None, key: tuple[str, str],
                     count: int) -> Matcher | None:
        # Copying the records touches every one (mapped pages too): not on the loop.
        given = await asyncio.to_thread(_records, curated)
        size = sum(map(len, given)) + count * LEARNED_RECORD_BYTES
        self.builds += 1
        if self._on_build is not None:
            self._on_build()
        if size > self.process_above and self._root is not None:
            return await self._build_elsewhere(repo, given, key)
        return await asyncio.to_thread(self._build_here, repo, given)

    def _build_here(self, repo: str, given: list[bytes]) -> Matcher | None:
        with contextlib.closing(_stream(self.learned_records(repo))) as learned:
            arrays, report = build_arrays([], learned, given=given,
                                          given_source=f"curated clusters of {repo}")
        for error in report.errors:
            log.warning("clusters: %s: %s", repo, error)
        built = arrays.get(repo)
        return Matcher(arrays=built) if built is not None else None

    async def _build_elsewhere(self, repo: str, given: list[bytes],
                               key: tuple[str, str]) -> Matcher | None:
        """A large repository: built in a process of its own, which writes its arrays under
        the index directory; mapped from there (again after a restart, unchanged)."""
        assert self._root is not None
        root = await asyncio.to_thread(_repo_root, self._root(), repo)
        full = f"{repo}/{key[0]}/{key[1]}/{code_version()}/{INDEX_KIND}"

        async def build() -> SavedBuild:
            given_file = root / f"given-{os.getpid()}.jsonl"
            learned_file = root / f".learned-{os.getpid()}.jsonl"
            try:
                await asyncio.to_thread(_write_lines, given, given_file)
                await asyncio.to_thread(write_learned, lambda: self.learned_records(repo),
                                        learned_file)
                saved = await build_in_process([given_file], learned_file, full, root)
            finally:
                given_file.unlink(missing_ok=True)
                learned_file.unlink(missing_ok=True)
            log.info("clusters: %s's index built in a separate process in %.1fs", repo,
                     saved.seconds)
            for error in saved.errors:
                log.warning("clusters: %s: %s", repo, error)
            return saved

        # A saved index that cannot be read fails this build (and is removed): the delivery
        # answers from what there is and the repository's next issue builds it again.
        loaded = await load_or_build(root, full, build, _matchers, rebuild_unreadable=False)
        return loaded.value.get(repo)


def _records(curated: Matcher | None) -> list[bytes]:
    if curated is None:
        return []
    table = curated.arrays.records
    return [table.raw(i) for i in range(len(curated))]


def _stream(records: Iterable[str]) -> Generator[str, None, None]:
    # A generator whose close() closes the store's stream too (it holds a connection).
    try:
        yield from records
    finally:
        close = getattr(records, "close", None)
        if close is not None:
            close()


def _write_lines(records: list[bytes], path: Path) -> None:
    with path.open("wb") as fh:
        for record in records:
            fh.write(record.replace(b"\n", b" ") + b"\n")


def _repo_root(root: Path, repo: str) -> Path:
    digest = hashlib.sha256(repo.encode()).hexdigest()[:12]
    path = root / "repos" / f"{re.sub(r'[^a-z0-9._-]+', '_', repo)[:60]}-{digest}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _matchers(saved: SavedBuild) -> dict[str, Matcher]:
    return {repo: Matcher(arrays=arrays) for repo, arrays in saved.arrays().items()}
