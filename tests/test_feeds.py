"""Cluster feeds against a real HTTP server on loopback: the first load, a 304 on the next poll,
a changed feed, a bad line reported with its line while the rest load, a failing feed keeping
its last good version, a restart that does not fetch again, and the running bot answering an
issue from a feed's cluster."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bot.clusters.feeds import parse_feed
from bot.db import open_store
from bot.db.store import Store
from bot.jobs.feeds import FeedPoller, feed_file, materialise, poll
from bot.settings import ClusterFeed, ServiceConfig
from tests.conftest import SAMPLE_CLUSTERS, BotFactory, issue_payload
from tests.samples import RESET_HANG

FEED_REPO = "octo/feedrepo"


def record(public_id: str, repo: str = FEED_REPO) -> dict[str, Any]:
    """A sample cluster (the /new confirm hang) moved to another repository and id."""
    data = json.loads((SAMPLE_CLUSTERS / "cluster-35994.json").read_text())
    data.update(repo=repo, public_id=public_id)
    return data


def jsonl(*records: dict[str, Any] | str) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


@dataclass
class FeedServer:
    """A tracker publishing JSON Lines: ETag from the content, 304 for a matching
    If-None-Match; ``status`` to make it fail."""

    body: bytes = b""
    status: int = 200
    seen: list[dict[str, str]] = field(default_factory=list)

    @property
    def etag(self) -> str:
        import hashlib

        return '"' + hashlib.sha256(self.body).hexdigest()[:12] + '"'

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append(dict(request.headers))
        if self.status != 200:
            return web.Response(status=self.status, text="tracker down")
        if request.headers.get("If-None-Match") == self.etag:
            return web.Response(status=304)
        return web.Response(body=self.body, headers={"ETag": self.etag},
                            content_type="application/x-ndjson")


@pytest.fixture
async def feed_server(aiohttp_server: Any) -> tuple[FeedServer, str]:
    server = FeedServer()
    app = web.Application()
    app.router.add_get("/clusters.jsonl", server.handle)
    running = await aiohttp_server(app)
    return server, str(running.make_url("/clusters.jsonl"))


@pytest.fixture
def store(tmp_path: Path) -> Store:
    opened = open_store(tmp_path / "data", None, max_attempts=3)
    yield opened  # type: ignore[misc]
    opened.close()


async def test_first_load_then_a_304_then_a_change(feed_server: tuple[FeedServer, str],
                                                    store: Store, tmp_path: Path) -> None:
    server, url = feed_server
    feed = ClusterFeed(url=url)
    server.body = jsonl(record("f1"), record("f2"))
    async with aiohttp.ClientSession() as http:
        first = await poll(http, store, feed)
        assert (first.outcome, first.clusters) == ("changed", 2)
        stored = store.get_feed(url)
        assert stored is not None and stored.etag == server.etag and stored.clusters == 2
        second = await poll(http, store, feed)
        assert second.outcome == "unchanged"
        assert server.seen[-1].get("If-None-Match") == server.etag
        server.body = jsonl(record("f1"), record("f2"), record("f3"))
        third = await poll(http, store, feed)
        assert (third.outcome, third.clusters) == ("changed", 3)
    folder = tmp_path / "feeds"
    assert materialise(store, [feed], folder)
    assert feed_file(folder, url).read_bytes() == server.body
    assert not materialise(store, [feed], folder)  # nothing changed since


async def test_a_bad_line_is_reported_with_feed_line_and_field_and_the_rest_load(
        feed_server: tuple[FeedServer, str], store: Store,
        caplog: pytest.LogCaptureFixture) -> None:
    server, url = feed_server
    broken = record("f2")
    broken["landed_fix"] = {"status": "merged_to_main", "pr": "not a number"}
    server.body = jsonl(record("f1"), broken, "{not json", record("f4"))
    with caplog.at_level(logging.INFO, logger="dejafix.feeds"):
        async with aiohttp.ClientSession() as http:
            # A tracker's token in the query: the feed is named without it in the log.
            result = await poll(http, store, ClusterFeed(url=url + "?token=s3cret"))
    assert (result.outcome, result.clusters) == ("changed", 2)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "s3cret" not in logged and f"feed {url}: 2 cluster(s)" in logged
    assert f"{url}:2: landed_fix.pr:" in logged
    assert f"{url}:3: invalid JSON" in logged
    stored = store.get_feed(url + "?token=s3cret")
    assert stored is not None
    assert [json.loads(line)["public_id"] for line in stored.body.splitlines()] == ["f1", "f4"]
    assert f"{url}:2:" in stored.problems


@pytest.mark.parametrize("how", ["status", "unreachable", "nothing valid"])
async def test_a_failing_feed_keeps_its_last_good_version(
        feed_server: tuple[FeedServer, str], store: Store, how: str) -> None:
    server, url = feed_server
    server.body = jsonl(record("f1"))
    async with aiohttp.ClientSession() as http:
        assert (await poll(http, store, ClusterFeed(url=url))).outcome == "changed"
        good = store.get_feed(url)
        target = url
        if how == "status":
            server.status = 502
        elif how == "unreachable":
            target = "http://127.0.0.1:9/clusters.jsonl"  # the discard port: refused
            store.put_feed(target, good.etag if good else None, good.body if good else "", 1,
                           "")
        else:
            server.body = jsonl("{oops", {"repo": "not a repo"})
        failed = await poll(http, store, ClusterFeed(url=target))
    assert failed.outcome == "failed" and failed.error
    kept = store.get_feed(target)
    assert kept is not None and good is not None
    assert kept.body == good.body and kept.clusters == 1 and kept.error == failed.error


async def test_a_restart_within_the_interval_does_not_fetch_again(
        feed_server: tuple[FeedServer, str], store: Store, tmp_path: Path) -> None:
    server, url = feed_server
    server.body = jsonl(record("f1"))
    feed = ClusterFeed(url=url, interval=300)
    changes: list[int] = []

    async def on_change() -> None:
        changes.append(1)

    now = [time.time()]
    clock: Callable[[], float] = lambda: now[0]  # noqa: E731
    async with aiohttp.ClientSession() as http:
        poller = FeedPoller([feed], store, tmp_path / "feeds", http, on_change, clock=clock)
        assert await poller.poll_due() == 1 and changes == [1]
        assert len(server.seen) == 1
        # Another process (or this one restarted) on the same store: not due yet.
        again = FeedPoller([feed], store, tmp_path / "feeds2", http, on_change, clock=clock)
        await again.refresh()  # the stored version, written without a fetch
        assert feed_file(tmp_path / "feeds2", url).read_bytes() == server.body
        assert await again.poll_due() == 0 and len(server.seen) == 1
        now[0] += 301  # past the interval (the store stamps polls with the wall clock)
        assert await again.poll_due() == 0 and len(server.seen) == 2  # due: asked, 304
        assert server.seen[-1].get("If-None-Match") == server.etag


def test_parse_feed_keeps_the_good_lines_as_written() -> None:
    parsed = parse_feed("https://tracker.example/feed", jsonl(record("a"), "", "[1, 2]"))
    assert parsed.clusters == 1 and len(parsed.problems) == 1
    assert json.loads(parsed.body)["public_id"] == "a"


async def test_the_running_bot_answers_from_a_feeds_cluster(
        make_bot: BotFactory, feed_server: tuple[FeedServer, str]) -> None:
    server, url = feed_server
    server.body = jsonl(record("777"))
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)],
                                              cluster_feeds=[ClusterFeed(url=url)]))
    # The poller's first poll happens at start; wait for the feed's cluster to be indexed.
    from bot.web.app import SERVICES

    services = bot.app[SERVICES]
    for _ in range(200):
        if services.index.current.count(FEED_REPO):
            break
        import asyncio

        await asyncio.sleep(0.05)
    assert services.index.current.count(FEED_REPO) == 1
    resp = await bot.deliver("issues", issue_payload(repo=FEED_REPO, **RESET_HANG))
    assert resp.status == 202
    await bot.settle()
    [posted] = bot.github.calls("POST", f"/repos/{FEED_REPO}/issues/90001/comments")
    assert "cluster `777`" in posted.body["body"]
