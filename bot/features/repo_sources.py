"""Where the repositories' own ``clusters:`` live once read (``bot.features.repo_clusters``
reads them): their versions in the store, keyed ``repo:<owner/name>:<entry>`` beside the
operator's feeds, and as files under ``<data dir>/repo-clusters/``, a folder of the curated
index like the feeds'. Every process writes the files from the store, so a version stored by
one is indexed by all (the ``feed:`` notification)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import cachetools

from bot.db.store import Feed, Store
from bot.matching.index import IndexHolder

PREFIX = "repo:"
FOLDER = "repo-clusters"
# A repository whose entries were found up to date is not looked at again for this long (one
# store read per issue otherwise).
CHECKED_SECONDS = 60.0


def repo_prefix(repo: str) -> str:
    return f"{PREFIX}{repo.lower()}:"


def source_key(repo: str, entry: str) -> str:
    return repo_prefix(repo) + entry


# --- the stored versions as files the index reads ------------------------------------------------

def source_file(folder: Path, key: str) -> Path:
    return folder / f"repo-{hashlib.sha256(key.encode()).hexdigest()[:20]}.jsonl"


def materialise(store: Store, folder: Path) -> bool:
    """Write every stored version of every repository's entries to its file under ``folder``
    (atomically, only when it differs), and remove the others. True when a file changed."""
    rows = store.feeds_under(PREFIX)
    changed = write_rows(rows, folder)
    wanted = {source_file(folder, row.url).name for row in rows if row.body}
    for path in folder.glob("repo-*.jsonl"):
        if path.name not in wanted:
            path.unlink(missing_ok=True)
            changed = True
    return changed


def write_rows(rows: list[Feed], folder: Path) -> bool:
    """``rows``' versions to their files (atomically, only when one differs); True when one
    changed. Removes nothing: ``materialise`` does, knowing every row."""
    folder.mkdir(parents=True, exist_ok=True)
    changed = False
    for row in rows:
        if not row.body:
            continue
        path = source_file(folder, row.url)
        try:
            if path.read_text(encoding="utf-8") == row.body:
                continue
        except FileNotFoundError:
            pass
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".repo-")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(row.body)
        os.replace(tmp, path)
        changed = True
    return changed


@dataclass
class RepoSources:
    """The App's side: where the stored versions are written as files, how the index is told,
    whether a feed may be on a private address, and which repositories were found up to date
    lately."""

    folder: Path
    store: Store
    index: IndexHolder
    private_feeds: bool = False
    checked: cachetools.TTLCache[tuple[str, tuple[str, ...], bool], bool] = field(
        default_factory=lambda: cachetools.TTLCache(maxsize=4096, ttl=CHECKED_SECONDS))

    # One writer of the folder at a time, each reading the store inside it: a write from an
    # older snapshot finishing last would put an old version back.
    _writing: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)

    async def refresh(self, *, changed: bool = False) -> None:
        """The stored versions to files, and the index rebuilt when one changed (also when
        another process stored it: the ``feed:`` notification). ``changed``: the caller
        stored a new version, and must find it indexed on return even when the notification's
        own refresh wrote the files first (the index compares the files under its lock)."""
        async with self._writing:
            wrote = await asyncio.to_thread(materialise, self.store, self.folder)
        if wrote or changed:
            await self.index.refresh()

    async def bring(self, repo: str) -> None:
        """One repository's stored versions to their files (not every repository's), and the
        index brought to the files: for a delivery that found them up to date in the store."""
        def write() -> bool:
            return write_rows(self.store.feeds_under(repo_prefix(repo)), self.folder)

        async with self._writing:
            wrote = await asyncio.to_thread(write)
        if wrote:
            await self.index.refresh()
        else:
            # Written already (by the notification's refresh): its rebuild may be running,
            # which this waits for, without looking at every cluster file again.
            await self.index.settled()
