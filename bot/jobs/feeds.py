"""Cluster feeds: HTTP(S) URLs serving JSON Lines in the seed schema (a cluster tracker
publishing its records), polled with If-None-Match at each feed's interval.

A feed's last good version (its valid lines) is kept in the store, so every process shares it
and a restart within the interval does not fetch it again. A bad line is reported with the
feed, its line and field, and left out while the rest load; a feed that fails (unreachable, an
error status, nothing valid in it) keeps its last good version. Every process writes the
stored versions as files under ``<data dir>/feeds/``, one per feed, which the cluster index
reads as it reads any cluster folder: feed clusters are curated, as file clusters are."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bot.clusters.feeds import parse_feed, shown
from bot.db.store import Feed, Store
from bot.features.fetch import FetchRefused, fetch_bounded
from bot.settings import ClusterFeed

log = logging.getLogger("dejafix.feeds")

# A feed larger than this is refused whole (its last good version stays): a tracker publishing
# every cluster of a busy repository is a few MB.
MAX_FEED_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Polled:
    """What one poll did: ``changed`` (a new good version stored), ``unchanged`` (304, or the
    same content), ``failed`` (the last good version kept)."""

    outcome: str
    clusters: int = 0
    problems: tuple[str, ...] = ()
    error: str | None = None


_UNREAD = Feed("", None, "", 0, "", None, 0.0, 0.0)


async def poll(http: aiohttp.ClientSession, store: Store, feed: ClusterFeed,
               timeout: float = 30.0, stored: Feed | None = _UNREAD) -> Polled:
    """Fetch ``feed`` once (with the stored ETag) and store a new good version. ``stored``:
    the feed's row when the caller has just read it."""
    if stored is _UNREAD:
        stored = await asyncio.to_thread(store.get_feed, feed.url)
    etag = stored.etag if stored is not None and stored.clusters else None
    try:
        data, etag = await fetch_bounded(http, feed.url, etag=etag, limit=MAX_FEED_BYTES,
                                         timeout=timeout)
    except (aiohttp.ClientError, TimeoutError, FetchRefused) as exc:
        # The exception's text may carry the whole URL (and a token in it): its type only.
        error = str(exc) if isinstance(exc, FetchRefused) else type(exc).__name__
        return await _failed(store, feed, stored, error)
    if data is None:
        await asyncio.to_thread(store.feed_polled, feed.url, None)
        return Polled("unchanged", stored.clusters if stored else 0)
    parsed = await asyncio.to_thread(parse_feed, feed.url, data)
    for problem in parsed.problems:
        log.warning("feed %s", problem)
    if parsed.clusters == 0 and data.strip():
        return await _failed(store, feed, stored, "no valid cluster in it "
                             f"({len(parsed.problems)} problem(s))", parsed.problems)
    if stored is not None and stored.body == parsed.body:
        await asyncio.to_thread(store.feed_polled, feed.url, None)
        return Polled("unchanged", parsed.clusters, tuple(parsed.problems))
    await asyncio.to_thread(store.put_feed, feed.url, etag, parsed.body, parsed.clusters,
                            "\n".join(parsed.problems))
    log.info("feed %s: %d cluster(s)%s", shown(feed.url), parsed.clusters,
             f", {len(parsed.problems)} line problem(s)" if parsed.problems else "")
    return Polled("changed", parsed.clusters, tuple(parsed.problems))


async def _failed(store: Store, feed: ClusterFeed, stored: Feed | None, error: str,
                  problems: list[str] | None = None) -> Polled:
    kept = stored.clusters if stored is not None else 0
    log.warning("feed %s: %s; %s", shown(feed.url), error,
                f"its last good version ({kept} clusters) stays in use" if kept
                else "no good version of it yet")
    await asyncio.to_thread(store.feed_polled, feed.url, error)
    return Polled("failed", kept, tuple(problems or ()), error)


def feed_file(folder: Path, url: str) -> Path:
    return folder / f"feed-{hashlib.sha256(url.encode()).hexdigest()[:16]}.jsonl"


def materialise(store: Store, feeds: list[ClusterFeed], folder: Path) -> bool:
    """Write each feed's stored version to its file under ``folder`` (atomically, only when it
    differs) and remove files of feeds no longer configured. True when a file changed."""
    folder.mkdir(parents=True, exist_ok=True)
    changed = False
    wanted = set()
    for feed in feeds:
        path = feed_file(folder, feed.url)
        wanted.add(path.name)
        stored = store.get_feed(feed.url)
        body = stored.body if stored is not None else ""
        try:
            if path.read_text() == body:
                continue
        except FileNotFoundError:
            if not body:
                continue
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".feed-")
        with os.fdopen(fd, "w") as out:
            out.write(body)
        os.replace(tmp, path)
        changed = True
    for path in folder.glob("feed-*.jsonl"):
        if path.name not in wanted:
            path.unlink(missing_ok=True)
            changed = True
    return changed


def due(stored: Feed | None, feed: ClusterFeed, now: float) -> bool:
    return stored is None or stored.fetched_at + feed.interval <= now


class FeedPoller:
    """Polls every configured feed when it is due (by the store's last poll, so a restart or
    another process's poll counts), then has the index rebuilt when a version changed."""

    def __init__(self, feeds: list[ClusterFeed], store: Store, folder: Path,
                 http: aiohttp.ClientSession, on_change: Callable[[], Awaitable[object]],
                 clock: Callable[[], float] = time.time) -> None:
        self.feeds = feeds
        self.store = store
        self.folder = folder
        self.http = http
        self.on_change = on_change
        self.clock = clock

    async def poll_due(self) -> int:
        """Poll the feeds that are due; returns how many changed."""
        changed = 0
        for feed in self.feeds:
            stored = await asyncio.to_thread(self.store.get_feed, feed.url)
            if due(stored, feed, self.clock()) and \
                    (await poll(self.http, self.store, feed, stored=stored)).outcome == "changed":
                changed += 1
        if changed:
            await self.refresh()
        return changed

    async def refresh(self) -> None:
        """The stored versions to their files, and the index rebuilt if one changed (also when
        another process stored it: the ``feed:`` notification)."""
        if await asyncio.to_thread(materialise, self.store, self.feeds, self.folder):
            await self.on_change()

    async def run(self) -> None:
        every = max(1.0, min(f.interval for f in self.feeds) / 4) if self.feeds else 60.0
        while True:
            try:
                await self.poll_due()
            except Exception:
                log.exception("feeds: poll failed; the last good versions stay in use")
            await asyncio.sleep(every)
