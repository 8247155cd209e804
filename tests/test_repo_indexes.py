"""Per-repository indexes of learned clusters (issue 17): none is built at start; one is built
on its repository's first issue, kept while used, dropped least-recently-used past the memory
budget and built again on its next issue; a cluster learned through another store connection
(another process) is picked up by the next issue; a changed feed rebuilds only the indexes of
the repositories it touches."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bot.clusters.models import Cluster
from bot.db.sqlite import SQLiteStore
from bot.jobs.feeds import FeedPoller
from bot.matching import IssueText
from bot.matching.builds import IndexDir
from bot.matching.index import IndexHolder
from bot.matching.repo_indexes import RepoIndexes
from bot.settings import ClusterFeed, ServiceConfig
from bot.web.app import SERVICES
from tests.conftest import SAMPLE_CLUSTERS, BotFactory, issue_payload
from tests.samples import RESET_HANG

SAMPLE = json.loads((SAMPLE_CLUSTERS / "cluster-35994.json").read_text())


def learned(repo: str, public_id: str = "35994", label: str | None = None) -> Cluster:
    """The sample /new-confirm-hang cluster, as if learned in ``repo``."""
    data = dict(SAMPLE, repo=repo, public_id=public_id)
    if label is not None:
        data["display_label"] = label
    return Cluster.model_validate(data)


HANG = IssueText(number=1, title=RESET_HANG["title"], body=RESET_HANG["body"])


@pytest.fixture
def store(tmp_path: Path) -> Any:
    opened = SQLiteStore(tmp_path / "data")
    yield opened
    opened.close()


def holder_of(store: SQLiteStore, tmp_path: Path, paths: list[Path] | None = None,
              budget: int = 1 << 30) -> IndexHolder:
    index_dir = IndexDir(tmp_path / "index")
    learned = RepoIndexes(store.learned_state, store.learned_records, budget_bytes=budget,
                          root=index_dir)
    return IndexHolder(paths or [], index_dir=index_dir, learned=learned)


async def test_a_cold_start_builds_no_repository_index(store: SQLiteStore,
                                                       tmp_path: Path) -> None:
    for n in range(30):
        store.put_learned(learned(f"many/repo-{n}"))
    holder = holder_of(store, tmp_path)
    await holder.refresh(force=True)
    assert holder.learned is not None
    assert (holder.learned.stats().builds, holder.learned.stats().resident) == (0, 0)
    view = await holder.view(["many/repo-7"])
    assert view.rank(HANG, ["many/repo-7"])[0].public_id == "35994"
    assert (holder.learned.stats().builds, holder.learned.stats().resident) == (1, 1)
    await holder.view(["many/repo-7"])  # resident and unchanged: not built again
    assert holder.learned.stats().builds == 1


async def test_the_budget_drops_the_least_recently_used_and_its_next_issue_rebuilds_it(
        store: SQLiteStore, tmp_path: Path) -> None:
    for repo in ("lru/a", "lru/b", "lru/c"):
        store.put_learned(learned(repo))
    holder = holder_of(store, tmp_path)
    assert holder.learned is not None
    await holder.view(["lru/a"])
    one = holder.learned.stats().resident_bytes
    assert one > 0
    holder.learned.budget_bytes = int(one * 2.5)  # room for two
    await holder.view(["lru/b"])
    await holder.view(["lru/a"])  # a is used again: b is now the least recently used
    await holder.view(["lru/c"])
    assert [holder.learned.resident(r) for r in ("lru/a", "lru/b", "lru/c")] == \
        [True, False, True]
    assert holder.learned.stats().evictions == 1
    assert holder.learned.stats().resident_bytes <= holder.learned.budget_bytes
    again = await holder.view(["lru/b"])  # its next issue builds it again, and it answers
    assert again.rank(HANG, ["lru/b"])[0].public_id == "35994"
    assert holder.learned.stats().builds == 4
    assert [holder.learned.resident(r) for r in ("lru/a", "lru/b", "lru/c")] == \
        [False, True, True]


async def test_a_cluster_learned_by_another_process_is_picked_up_by_the_next_issue(
        store: SQLiteStore, tmp_path: Path) -> None:
    store.put_learned(learned("shared/one"))
    store.put_learned(learned("shared/two"))
    holder = holder_of(store, tmp_path)
    first = await holder.view(["shared/one", "shared/two"])
    assert first.count("shared/one") == 1
    other = SQLiteStore(tmp_path / "data")  # another process's connection to the same store
    try:
        other.put_learned(learned("shared/one", "40000", "Another bug entirely"))
    finally:
        other.close()
    after = await holder.view(["shared/one", "shared/two"])
    assert after.count("shared/one") == 2
    assert after.version != first.version
    # The other repository's index is the one it had: nothing of it was rebuilt.
    assert after.matcher("shared/two") is first.matcher("shared/two")
    assert after.matcher("shared/one") is not first.matcher("shared/one")


async def test_a_changed_feed_rebuilds_only_the_indexes_of_its_repositories(
        store: SQLiteStore, tmp_path: Path, aiohttp_server: Any) -> None:
    body: dict[str, bytes] = {}

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=body["now"], content_type="application/x-ndjson")

    app = web.Application()
    app.router.add_get("/feed.jsonl", handle)
    server = await aiohttp_server(app)
    url = str(server.make_url("/feed.jsonl"))

    def feed(label: str) -> bytes:
        return (json.dumps(dict(SAMPLE, repo="feed/touched", public_id="500",
                                display_label=label)) + "\n").encode()

    # Two repositories with clusters of their own in the store; the feed names one of them.
    store.put_learned(learned("feed/touched", "41000", "A learned bug"))
    store.put_learned(learned("feed/other", "41001", "A learned bug"))
    feeds_dir = tmp_path / "feeds"
    holder = holder_of(store, tmp_path, [feeds_dir])
    assert holder.learned is not None
    body["now"] = feed("The first wording")
    async with aiohttp.ClientSession() as http:
        now = [time.time()]
        poller = FeedPoller([ClusterFeed(url=url)], store, feeds_dir, http,
                            on_change=holder.refresh, clock=lambda: now[0])
        assert await poller.poll_due() == 1
        first = await holder.view(["feed/touched", "feed/other"])
        # (The learned cluster repeats the feed's issues: the curated record wins.)
        assert first.find("feed/touched", public_id="500") is not None
        builds = holder.learned.stats().builds
        body["now"] = feed("The second wording")
        now[0] += 3600  # the feed is due again
        assert await poller.poll_due() == 1
    after = await holder.view(["feed/touched", "feed/other"])
    assert after.find("feed/touched", public_id="500").display_label == "The second wording"
    assert after.matcher("feed/other") is first.matcher("feed/other")
    assert after.matcher("feed/touched") is not first.matcher("feed/touched")
    assert holder.learned.stats().builds == builds + 1


async def test_the_running_bot_answers_after_its_index_was_dropped(
        make_bot: BotFactory, tmp_path: Path) -> None:
    """A budget too small for two indexes: each repository's issue drops the other's, and the
    next issue of the dropped one still gets its comment."""
    empty = tmp_path / "none"
    empty.mkdir()
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(empty)], cluster_reload=0,
                                              index_memory_mb=0.01))
    services = bot.app[SERVICES]
    for repo in ("drop/first", "drop/second"):
        services.store.put_learned(learned(repo))
    number = 70000
    for repo in ("drop/first", "drop/second", "drop/first"):
        number += 1
        await bot.deliver("issues", issue_payload(repo=repo, number=number, **RESET_HANG))
        await bot.settle()
        [posted] = bot.github.calls("POST", f"/repos/{repo}/issues/{number}/comments")
        assert "cluster `35994`" in posted.body["body"]
    health = await (await bot.client.get("/healthz")).json()
    assert health["repo_indexes"]["builds"] == 3
    assert health["repo_indexes"]["evictions"] == 2
    assert health["repo_indexes"]["resident"] == 1


async def test_an_issue_skipped_before_matching_leaves_its_repository_s_index_built(
        make_bot: BotFactory, tmp_path: Path) -> None:
    """The build started while the config is read is not thrown away when the config says to
    skip the issue: the repository's next issue finds it built."""
    import asyncio

    empty = tmp_path / "none"
    empty.mkdir()
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(empty)], cluster_reload=0))
    services = bot.app[SERVICES]
    services.store.put_learned(learned("skip/me"))
    bot.github.add_file("skip/me", ".github/dejafix.yml", "enabled: false\n")
    await bot.deliver("issues", issue_payload(repo="skip/me", number=5, **RESET_HANG))
    await bot.settle()
    assert bot.github.calls("POST", "/repos/skip/me/issues/5/comments") == []
    for _ in range(200):
        if services.index.learned.resident("skip/me"):
            break
        await asyncio.sleep(0.02)
    assert services.index.learned.resident("skip/me")
    assert services.index.learned.stats().builds == 1
