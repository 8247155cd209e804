"""A repository's own ``clusters:`` in the App (issue 27): files and folders of its default
branch read through the contents API (conditionally, by blob when changed), kept in the store,
read again after a push touching them; feeds listed there too, on public addresses only unless
the operator allows private ones; and never a cluster of another repository. Over real HTTP:
signed deliveries into the running bot, GitHub faked on loopback, a feed server on loopback."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import cachetools
import pytest
from aiohttp import web

from bot.clusters.sources import SourceFile, own_clusters
from bot.db import open_store
from bot.features.repo_clusters import (
    RECHECK_SECONDS,
    ContentsReader,
    PublicResolver,
    _feed_refusal,
    _without_url,
    push_touches,
    sync_repo,
)
from bot.features.repo_sources import materialise, repo_prefix
from bot.github.client import USER_AGENT, RepoClient, RetryingGitHubAPI
from bot.settings import ServiceConfig
from bot.web.app import SERVICES
from tests.conftest import REPO, SAMPLE_CLUSTERS, BotFactory, BotUnderTest, issue_payload
from tests.fake_github import FakeGitHub
from tests.samples import RESET_HANG

CONFIG = ".github/dejafix.yml"
FOLDER = "known-bugs"
JSON_CLUSTER = (SAMPLE_CLUSTERS / "cluster-35994.json").read_text()
MD_CLUSTER = (SAMPLE_CLUSTERS / "cluster-35309.md").read_text()
FIX = "52090"  # the fix of cluster 35994, which RESET_HANG matches
OTHER = "someone/other"
# No operator cluster files: whatever is answered comes from the repository's own.
NO_FILES = ServiceConfig(cluster_paths=[])


def own_folder(fake: FakeGitHub, repo: str = REPO, config: str = "") -> None:
    fake.add_file(repo, CONFIG, f"clusters: [{FOLDER}]\n" + config)
    fake.add_file(repo, f"{FOLDER}/cluster-35994.json", JSON_CLUSTER)
    fake.add_file(repo, f"{FOLDER}/cluster-35309.md", MD_CLUSTER)
    fake.add_file(repo, f"{FOLDER}/notes.txt", "not a cluster file")


def push(changed: list[str], repo: str = REPO, *, removed: list[str] | None = None
         ) -> dict[str, Any]:
    owner, name = repo.split("/")
    return {
        "ref": "refs/heads/main", "before": "1" * 40, "after": "2" * 40, "created": False,
        "deleted": False, "forced": False,
        "repository": {"full_name": repo, "name": name, "owner": {"login": owner},
                       "default_branch": "main", "private": False, "visibility": "public",
                       "html_url": f"https://github.com/{repo}"},
        "commits": [{"id": "2" * 40, "added": [], "removed": removed or [],
                     "modified": changed}],
        "sender": {"login": "maintainer", "type": "User"}, "installation": {"id": 77},
    }


async def answered(bot: BotUnderTest, number: int, repo: str = REPO,
                   issue: dict[str, str] = RESET_HANG) -> list[str]:
    resp = await bot.deliver("issues", issue_payload(**issue, number=number, repo=repo))
    assert resp.status == 202, await resp.text()
    await bot.settle()
    return [r.body["body"] for r in bot.github.calls(
        "POST", f"/repos/{repo}/issues/{number}/comments")]


def reads(fake: FakeGitHub, repo: str = REPO) -> list[str]:
    """The requests that read the repository's cluster files (listing or blobs)."""
    return [r.path for r in fake.requests
            if r.path.startswith(f"/repos/{repo}/contents/{FOLDER}")
            or r.path.startswith(f"/repos/{repo}/git/blobs/")]


async def test_the_app_answers_from_the_repositorys_own_cluster_folder(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=NO_FILES)
    own_folder(bot.github)

    comments = await answered(bot, 1)
    assert len(comments) == 1 and FIX in comments[0]
    # One listing of the folder, one blob per cluster file; the .txt beside them is not read.
    first = reads(bot.github)
    assert first.count(f"/repos/{REPO}/contents/{FOLDER}") == 1
    assert len([p for p in first if "/git/blobs/" in p]) == 2
    # Both files' clusters are in the index, as the repository's.
    index = await bot.app[SERVICES].index.view([REPO])
    assert {c.public_id for c in index.clusters(REPO)} == {"35994", "35309"}

    # The next issue reads nothing again.
    assert len(await answered(bot, 2)) == 1
    assert reads(bot.github) == first


async def test_a_push_touching_the_files_reads_them_again_and_a_removal_takes_them_away(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=NO_FILES)
    fake = bot.github
    own_folder(fake)
    assert len(await answered(bot, 1)) == 1
    before = len(reads(fake))

    # A push elsewhere reads nothing.
    await bot.deliver("push", push(["README.md"]))
    await bot.settle()
    assert len(reads(fake)) == before

    # The fix turns out wrong: the maintainers delete its cluster file.
    del fake.files[(REPO.lower(), f"{FOLDER}/cluster-35994.json")]
    await bot.deliver("push", push([], removed=[f"{FOLDER}/cluster-35994.json"]))
    await bot.settle()
    assert len(reads(fake)) > before
    index = await bot.app[SERVICES].index.view([REPO])
    assert {c.public_id for c in index.clusters(REPO)} == {"35309"}
    assert await answered(bot, 2) == []


async def test_a_push_shows_the_cluster_files_problems_on_their_lines_in_a_check_run(
        make_bot: BotFactory) -> None:
    """The maintainers see a bad line where they wrote it, not only in the operator's log."""
    bot = await make_bot(config=NO_FILES)
    fake = bot.github
    own_folder(fake)
    fake.add_file(REPO, f"{FOLDER}/broken.jsonl",
                  json.dumps(json.loads(JSON_CLUSTER)).replace("35994", "777") + "\n"
                  + '{"repo": "NousResearch/hermes-agent"}\n')
    await bot.deliver("push", push([f"{FOLDER}/broken.jsonl"]))
    await bot.settle()
    (run,) = [r for r in fake.check_runs.get(REPO.lower(), [])
              if r["name"] == "dejafix known bugs"]
    assert run["conclusion"] == "failure" and run["head_sha"] == "2" * 40
    notes = run["output"]["annotations"]
    # One per problem of the bad record (each field it lacks), all on its line.
    assert notes and {(a["path"], a["start_line"], a["annotation_level"]) for a in notes} == {
        (f"{FOLDER}/broken.jsonl", 2, "failure")}
    assert "3 cluster(s) in use" in run["output"]["title"]
    # The good line of the broken file is used beside the other files' clusters.
    index = await bot.app[SERVICES].index.view([REPO])
    assert {c.public_id for c in index.clusters(REPO)} == {"35994", "35309", "777"}

    # Fixed: the next push's check passes.
    fake.add_file(REPO, f"{FOLDER}/broken.jsonl", "")
    await bot.deliver("push", push([f"{FOLDER}/broken.jsonl"]))
    await bot.settle()
    runs = [r for r in fake.check_runs[REPO.lower()] if r["name"] == "dejafix known bugs"]
    assert runs[-1]["conclusion"] == "success" and runs[-1]["output"]["annotations"] == []


async def test_a_pull_request_changing_the_cluster_files_is_checked_before_it_is_merged(
        make_bot: BotFactory) -> None:
    """The files as the pull request's head has them: its bad line on its file and line,
    nothing stored, nothing answered from them; a pull request not touching them: no check."""
    bot = await make_bot(config=NO_FILES)
    fake = bot.github
    head = "c" * 40
    fake.add_file(REPO, CONFIG, f"clusters: [{FOLDER}]\n")
    fake.add_file_at(REPO, head, f"{FOLDER}/cluster-35994.json", JSON_CLUSTER)
    fake.add_file_at(REPO, head, f"{FOLDER}/new.jsonl", '{"repo": "NousResearch/hermes-agent"}\n')
    fake.pr_files[(REPO.lower(), 7)] = [{"filename": f"{FOLDER}/new.jsonl"}]
    owner, name = REPO.split("/")
    repository = {"full_name": REPO, "name": name, "owner": {"login": owner},
                  "default_branch": "main", "private": False,
                  "html_url": f"https://github.com/{REPO}"}
    payload = {"action": "opened", "number": 7,
               "pull_request": {"number": 7, "state": "open", "head": {"sha": head},
                                "user": {"login": "contributor", "type": "User"}},
               "repository": repository, "installation": {"id": 77},
               "sender": {"login": "contributor", "type": "User"}}
    await bot.deliver("pull_request", payload)
    await bot.settle()
    (run,) = [r for r in fake.check_runs.get(REPO.lower(), [])
              if r["name"] == "dejafix known bugs"]
    assert run["head_sha"] == head and run["conclusion"] == "failure"
    assert {(a["path"], a["start_line"]) for a in run["output"]["annotations"]} == {
        (f"{FOLDER}/new.jsonl", 1)}
    assert "1 cluster(s) usable" in run["output"]["title"]
    # Nothing of the pull request's version is stored or indexed.
    services = bot.app[SERVICES]
    assert services.store.feeds_under(repo_prefix(REPO)) == []
    assert (await services.index.view([REPO])).size == 0

    fake.pr_files[(REPO.lower(), 7)] = [{"filename": "README.md"}]
    await bot.deliver("pull_request", {**payload, "action": "synchronize"})
    await bot.settle()
    assert len([r for r in fake.check_runs[REPO.lower()]
                if r["name"] == "dejafix known bugs"]) == 1


async def test_a_fork_gets_the_known_bugs_its_public_upstream_lists(
        make_bot: BotFactory) -> None:
    """``upstreams: [REPO]`` on a fork: the upstream's own ``clusters:`` are read (the App is
    not installed there, so nothing else would read them) and answer the fork's issue."""
    bot = await make_bot(config=NO_FILES)
    fake = bot.github
    fork = "someone/hermes-fork"
    fake.add_repo(REPO, private=False, installation=2)
    fake.add_repo(fork, installation=77)
    own_folder(fake)
    fake.add_file(fork, CONFIG, f"upstreams: [{REPO}]\n")
    payload = issue_payload(**RESET_HANG, number=3, repo=fork)
    payload["repository"].update(private=False, visibility="public")
    resp = await bot.deliver("issues", payload)
    assert resp.status == 202
    await bot.settle()
    comments = [r.body["body"] for r in fake.calls("POST", f"/repos/{fork}/issues/3/comments")]
    assert len(comments) == 1 and FIX in comments[0]
    assert reads(fake), "the upstream's folder was read"


async def test_a_repository_removed_from_the_installation_takes_its_clusters_away(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=NO_FILES)
    own_folder(bot.github)
    assert len(await answered(bot, 1)) == 1
    owner, name = REPO.split("/")
    removed = {"action": "removed", "installation": {"id": 77},
               "repositories_removed": [{"full_name": REPO, "name": name}],
               "repositories_added": [], "repository_selection": "selected",
               "sender": {"login": owner, "type": "User"}}
    resp = await bot.deliver("installation_repositories", removed)
    assert resp.status == 202, await resp.text()
    await bot.settle()
    services = bot.app[SERVICES]
    assert services.store.feeds_under(repo_prefix(REPO)) == []
    assert (await services.index.view([REPO])).size == 0


async def test_a_repository_cannot_answer_with_another_repositorys_clusters(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    """``someone/other`` lists a file holding a cluster of REPO: it is refused, named in the
    log, and answers in neither repository."""
    caplog.set_level(logging.INFO)
    bot = await make_bot(config=NO_FILES)
    fake = bot.github
    fake.add_repo(OTHER, installation=77)
    fake.add_file(OTHER, CONFIG, "clusters: [bugs/planted.json]\n")
    fake.add_file(OTHER, "bugs/planted.json", JSON_CLUSTER)

    assert await answered(bot, 1, repo=OTHER) == []
    assert await answered(bot, 2) == []
    said = [r.getMessage() for r in caplog.records if r.name == "dejafix.repo_clusters"]
    assert any("bugs/planted.json" in m and f"is of {REPO}, not of {OTHER}" in m
               for m in said), said
    index = await bot.app[SERVICES].index.view([REPO, OTHER])
    assert index.size == 0


def feed_app(body: str, seen: list[dict[str, str]]) -> web.Application:
    etag = '"v1"'

    async def serve(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={"ETag": etag})
        return web.Response(text=body, headers={"ETag": etag})

    app = web.Application()
    app.router.add_get("/clusters.jsonl", serve)
    return app


@pytest.mark.parametrize("private_ok", [False, True])
async def test_a_feed_on_a_private_address_is_read_only_when_the_operator_allows_it(
        make_bot: BotFactory, aiohttp_server: Any, private_ok: bool,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    seen: list[dict[str, str]] = []
    server = await aiohttp_server(feed_app(json.dumps(json.loads(JSON_CLUSTER)) + "\n", seen))
    url = str(server.make_url("/clusters.jsonl"))
    bot = await make_bot(config=NO_FILES.model_copy(update={"repo_feeds_private": private_ok}))
    bot.github.add_file(REPO, CONFIG, f"clusters: ['{url}']\n")

    comments = await answered(bot, 1)
    if private_ok:
        assert len(comments) == 1 and FIX in comments[0]
        assert len(seen) == 1
    else:
        assert comments == [] and seen == []
        said = [r.getMessage() for r in caplog.records if r.name == "dejafix.repo_clusters"]
        assert any("only https feeds are read" in m for m in said), said


def test_public_feeds_only_by_default() -> None:
    assert _feed_refusal("http://tracker.example/x.jsonl", False) == "only https feeds are read"
    for url in ("https://127.0.0.1/x", "https://[::1]/x", "https://169.254.169.254/x",
                "https://10.0.0.8/x", "https://[fe80::1]/x", "https://[::ffff:127.0.0.1]/x",
                # Digits that IDNA turns into an address literal, which no resolver sees.
                "https://\u2460\u2461\u2466.\u24ea.\u24ea.\u2460/x",
                "https://\uff11\uff12\uff17.\uff10.\uff10.\uff11/x"):
        assert _feed_refusal(url, False) is not None, url
    assert _feed_refusal("https://tracker.example/x.jsonl", False) is None
    assert _feed_refusal("http://127.0.0.1:9/x", True) is None


async def test_a_name_resolving_to_a_private_address_is_refused() -> None:
    """A public-looking name pointing at loopback: refused on the address it resolves to,
    the one the connection would use."""
    resolver = PublicResolver()
    try:
        with pytest.raises(OSError, match="not a public address"):
            await resolver.resolve("localhost", 443, socket.AF_INET)
        # Through a session: the request never reaches the loopback server.
        connector = aiohttp.TCPConnector(resolver=resolver)
        async with aiohttp.ClientSession(connector=connector) as session:
            with pytest.raises(aiohttp.ClientError):
                await session.get("http://localhost:9/")
    finally:
        await resolver.close()


async def test_issues_arriving_together_after_clusters_are_listed_are_all_answered(
        make_bot: BotFactory) -> None:
    """The first delivery reads the files; the others wait for it and must use what it read,
    not the view they took before (found by review: they answered nothing)."""
    bot = await make_bot(config=NO_FILES)
    own_folder(bot.github)
    for number in (1, 2, 3):
        resp = await bot.deliver("issues", issue_payload(**RESET_HANG, number=number))
        assert resp.status == 202
    await bot.settle()
    got = {n: len(bot.github.calls("POST", f"/repos/{REPO}/issues/{n}/comments"))
           for n in (1, 2, 3)}
    assert got == {1: 1, 2: 1, 3: 1}
    assert len([p for p in reads(bot.github) if "/contents/" in p]) == 1


def test_a_clusters_path_cannot_be_escaped_into_another_api_path() -> None:
    """``%2e%2e`` reaches the API URL as ``..`` once the client resolves it: refused with the
    other ways out, whatever their spelling; an entry is normalised so a push recognises it."""
    from bot.repo_config import RepoConfigError, read_config_file

    for bad in ("docs/%2e%2e/%2e%2e/other/private/contents/x.json", "bugs?ref=main",
                "bugs#x", "a\\\\..\\\\b", "./..", "x/\t/y"):
        with pytest.raises(RepoConfigError, match="clusters"):
            read_config_file(f"clusters: [\"{bad}\"]\n")
    assert read_config_file("clusters: [./bugs/, 'docs//./k.md']\n").config.clusters == [
        "bugs", "docs/k.md"]
    # A port that is not a number would break every later use of the URL.
    with pytest.raises(RepoConfigError, match="numeric port"):
        read_config_file("clusters: ['https://tracker.example:8443x/f.jsonl?token=s3cret']\n")


async def test_a_source_over_the_bound_is_refused_before_any_blob_is_read(
        github: tuple[FakeGitHub, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import bot.features.repo_clusters as repo_clusters

    fake, api = github
    token = "ghs_plainTOKENforTHEboundTEST"
    fake.tokens[token] = 77
    own_folder(fake)
    monkeypatch.setattr(repo_clusters, "MAX_SOURCE_BYTES", 1000)
    store = open_store(tmp_path / "data", None)
    try:
        async with aiohttp.ClientSession() as session:
            gh = RetryingGitHubAPI(session, USER_AGENT, oauth_token=token, base_url=api)
            done = await sync_repo(store, REPO, [FOLDER], ContentsReader(RepoClient(gh, REPO)),
                                   private_feeds=False)
        assert [(s.outcome, s.error) for s in done] == [("failed", "larger than 1000 bytes")]
        assert [p for p in reads(fake) if "/git/blobs/" in p] == []
    finally:
        store.close()


def test_a_feeds_error_never_carries_its_url_query() -> None:
    """aiohttp puts the whole URL in some errors (an invalid URL's); the text reaches logs,
    check runs and annotations."""
    url = "https://tracker.example/f.jsonl?token=s3cretTOKEN"
    said = _without_url(f"InvalidURL: {url}; and again token=s3cretTOKEN", url)
    assert "s3cretTOKEN" not in said and "https://tracker.example/f.jsonl" in said
    assert _without_url("bugs: HTTP 500", "bugs") == "bugs: HTTP 500"


# -- the store and the requests, without the webhook -------------------------------------------

async def test_an_unchanged_folder_costs_one_conditional_request_and_no_blob(
        github: tuple[FakeGitHub, str], tmp_path: Path) -> None:
    fake, api = github
    token = "ghs_plainTOKENforTHEsyncTEST"
    fake.tokens[token] = 77
    own_folder(fake)
    store = open_store(tmp_path / "data", None)
    try:
        async with aiohttp.ClientSession() as session:
            gh = RetryingGitHubAPI(session, USER_AGENT, oauth_token=token, base_url=api,
                                   cache=cachetools.LRUCache(maxsize=64))
            client = RepoClient(gh, REPO)
            first = await sync_repo(store, REPO, [FOLDER], ContentsReader(client),
                                    private_feeds=False)
            assert [(s.outcome, s.clusters) for s in first] == [("changed", 2)]
            asked = len(fake.requests)
            # Nothing due yet: no request at all.
            assert await sync_repo(store, REPO, [FOLDER], ContentsReader(client),
                                   private_feeds=False) == []
            assert len(fake.requests) == asked
            later = time.time() + RECHECK_SECONDS + 1
            again = await sync_repo(store, REPO, [FOLDER], ContentsReader(client),
                                    private_feeds=False, now=later)
            assert [s.outcome for s in again] == ["unchanged"]
            new = fake.requests[asked:]
            assert [r.path for r in new] == [f"/repos/{REPO}/contents/{FOLDER}"]
            assert new[0].headers.get("If-None-Match")  # answered 304: no rate limit

            # GitHub unreachable: the last good version stays, with the error.
            dead = RepoClient(RetryingGitHubAPI(session, USER_AGENT, oauth_token=token,
                                                base_url="http://127.0.0.1:9"), REPO)
            failed = await sync_repo(store, REPO, [FOLDER], ContentsReader(dead),
                                     private_feeds=False, force_files=True)
            assert [(s.outcome, s.clusters) for s in failed] == [("failed", 2)]
            (row,) = store.feeds_under(repo_prefix(REPO))
            assert row.clusters == 2 and row.error

            # Read for a fork (``drop=False``), whose view of the config lists less: nothing
            # of what the repository's own reads stored is removed.
            assert await sync_repo(store, REPO, [], ContentsReader(client),
                                   private_feeds=False, drop=False) == []
            assert len(store.feeds_under(repo_prefix(REPO))) == 1

            # The entry is no longer listed: its clusters go.
            assert [s.outcome for s in await sync_repo(
                store, REPO, [], ContentsReader(client), private_feeds=False)] == ["changed"]
            assert store.feeds_under(repo_prefix(REPO)) == []
    finally:
        store.close()


def test_every_process_writes_the_same_files_from_the_store(tmp_path: Path) -> None:
    store = open_store(tmp_path / "data", None)
    try:
        parsed = own_clusters(REPO, [SourceFile("bugs/a.json", JSON_CLUSTER.encode())])
        store.put_feed(repo_prefix(REPO) + "bugs", "v1", parsed.body, parsed.clusters, "")
        one, two = tmp_path / "one", tmp_path / "two"
        assert materialise(store, one) and materialise(store, two)
        assert not materialise(store, one)  # unchanged: nothing written, no rebuild
        assert sorted(p.read_text() for p in one.iterdir()) == \
            sorted(p.read_text() for p in two.iterdir())
        store.drop_feed(repo_prefix(REPO) + "bugs")
        assert materialise(store, one) and list(one.glob("repo-*")) == []
    finally:
        store.close()


def test_own_clusters_keeps_this_repositorys_and_names_the_rest() -> None:
    foreign = json.loads(JSON_CLUSTER)
    foreign.update(repo=OTHER, public_id="9")
    files = [SourceFile("bugs/a.jsonl", (json.dumps(json.loads(JSON_CLUSTER)) + "\n"
                                         + json.dumps(foreign)
                                         + "\n{\"repo\": 1}\n").encode()),
             SourceFile("bugs/b.md", MD_CLUSTER.encode())]
    parsed = own_clusters(REPO, files)
    assert parsed.clusters == 2
    assert {json.loads(line)["public_id"] for line in parsed.body.splitlines()} == {
        "35994", "35309"}
    shown = [str(p) for p in parsed.problems]
    assert any(p.startswith("bugs/a.jsonl:3:") for p in shown), shown
    assert any("cluster 9 is of someone/other" in p and p.startswith("bugs/a.jsonl")
               for p in shown), shown


def test_a_push_touches_an_entry_by_path_or_folder() -> None:
    assert push_touches(push([f"{FOLDER}/x.json"]), [FOLDER])
    assert push_touches(push([], removed=["docs/known.md"]), ["docs/known.md"])
    assert push_touches(push([CONFIG]), [])
    assert not push_touches(push([f"{FOLDER}-old/x.json", "README.md"]), [FOLDER])
    assert not push_touches(push(["x.jsonl"]), ["https://tracker.example/x.jsonl"])
