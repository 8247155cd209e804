"""Learning end to end: a repository with no cluster files learns from its own merged fixes,
then answers the next report of the same bug; reverts, duplicates, backfill and backtest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bot.clusters.learning import cluster_from_fix
from bot.db.sqlite import SQLiteStore as Store
from bot.eval.backtest import history_queries, recommend_threshold, replay
from bot.features.backfill import Backfill
from bot.github.app import GitHubApp
from bot.github.client import RepoClient
from bot.settings import PrivateKey, ServiceConfig
from bot.web.app import SERVICES
from tests.conftest import APP_ID, BotFactory, issue_payload
from tests.fake_github import FakeGitHub
from tests.samples import LEARN_REPO, NEW_REPORT, merged_pr, seed_history


@pytest.fixture
def empty_clusters(tmp_path: Path) -> ServiceConfig:
    folder = tmp_path / "no-clusters"
    folder.mkdir()
    return ServiceConfig(cluster_paths=[str(folder)], cluster_reload=0)


async def test_after_one_merged_fix_the_next_report_gets_the_comment(
        make_bot: BotFactory, empty_clusters: ServiceConfig) -> None:
    bot = await make_bot(config=empty_clusters)
    seed_history(bot.github)
    # Before: nothing known, nothing said.
    await bot.deliver("issues", issue_payload(**NEW_REPORT, repo=LEARN_REPO, number=11))
    await bot.settle()
    assert bot.github.writes() == []

    await bot.deliver("pull_request", merged_pr())
    await bot.settle()
    learned = bot.app[SERVICES].store.learned_clusters(LEARN_REPO)
    assert [c.public_id for c in learned] == ["10"]
    assert learned[0].files_changed == ["widgets/exporter/queue.py",
                                        "tests/exporter/test_queue.py"]
    assert (await bot.app[SERVICES].index.view([LEARN_REPO])).size == 1  # no restart needed

    await bot.deliver("issues", issue_payload(**NEW_REPORT, repo=LEARN_REPO, number=12))
    await bot.settle()
    posts = bot.github.calls("POST", f"/repos/{LEARN_REPO}/issues/12/comments")
    assert len(posts) == 1
    body = posts[0].body["body"]
    assert "#50" in body and "merged 2026-01-09" in body
    assert "widgets/exporter/queue.py" in body


async def test_pr_closing_two_issues_via_graphql_and_300_files(
        make_bot: BotFactory, empty_clusters: ServiceConfig) -> None:
    bot = await make_bot(config=empty_clusters)
    seed_history(bot.github)
    bot.github.add_issue(LEARN_REPO, {"number": 11, "title": "Shutdown stuck", "state": "closed"})
    bot.github.closing_refs[(LEARN_REPO, 50)] = [11]  # linked in the sidebar, not in the text
    bot.github.pr_files[(LEARN_REPO, 50)] = [
        {"filename": f"widgets/mod{i:03}.py", "patch": "@@ -1 +1 @@\n+x = 1"} for i in range(300)]
    await bot.deliver("pull_request", merged_pr())
    await bot.settle()
    [cluster] = bot.app[SERVICES].store.learned_clusters(LEARN_REPO)
    assert [(m.kind, m.number) for m in cluster.members] == [("issue", 10), ("issue", 11),
                                                             ("pr", 50)]
    assert len(cluster.files_changed) == 300
    assert len(bot.github.calls("GET", f"/repos/{LEARN_REPO}/pulls/50/files")) == 3  # 3 pages


async def test_unmerged_or_non_fixing_prs_teach_nothing(
        make_bot: BotFactory, empty_clusters: ServiceConfig) -> None:
    bot = await make_bot(config=empty_clusters)
    seed_history(bot.github)
    closed = merged_pr()
    closed["pull_request"]["merged"] = False
    await bot.deliver("pull_request", closed)
    await bot.deliver("pull_request", merged_pr(51, body="Related to #10.\n> fixes #10"))
    await bot.settle()
    assert bot.app[SERVICES].store.learned_clusters(LEARN_REPO) == []


async def test_revert_withdraws_the_fix_and_corrects_the_comment(
        make_bot: BotFactory, empty_clusters: ServiceConfig) -> None:
    bot = await make_bot(config=empty_clusters)
    seed_history(bot.github)
    await bot.deliver("pull_request", merged_pr())
    await bot.settle()
    await bot.deliver("issues", issue_payload(**NEW_REPORT, repo=LEARN_REPO, number=12))
    await bot.settle()
    assert len(bot.github.calls("POST", f"/repos/{LEARN_REPO}/issues/12/comments")) == 1

    revert = merged_pr(60, title='Revert "fix(exporter): bound flush_queue with a timeout"',
                        body=f"Reverts {LEARN_REPO}#50")
    await bot.deliver("pull_request", revert)
    await bot.settle()
    [cluster] = bot.app[SERVICES].store.learned_clusters(LEARN_REPO)
    assert cluster.landed_fix.reverted and not cluster.landed_fix.landed
    patches = bot.github.calls("PATCH")
    assert len(patches) == 1 and "was reverted by #60" in patches[0].body["body"]

    await bot.deliver("issues", issue_payload(**NEW_REPORT, repo=LEARN_REPO, number=13))
    await bot.settle()
    assert bot.github.calls("POST", f"/repos/{LEARN_REPO}/issues/13/comments") == []


async def test_issue_closed_as_duplicate_joins_the_cluster(
        make_bot: BotFactory, empty_clusters: ServiceConfig) -> None:
    bot = await make_bot(config=empty_clusters)
    seed_history(bot.github)
    await bot.deliver("pull_request", merged_pr())
    await bot.settle()
    bot.github.comments[(LEARN_REPO, 14)] = [{"id": 1, "body": "Duplicate of #10",
                                        "user": {"login": "maintainer", "type": "User"}}]
    closed = issue_payload("closed", title="Exporter freezes at exit", repo=LEARN_REPO, number=14)
    closed["issue"].update(state="closed", state_reason="duplicate")
    await bot.deliver("issues", closed)
    await bot.settle()
    [cluster] = bot.app[SERVICES].store.learned_clusters(LEARN_REPO)
    assert 14 in [m.number for m in cluster.members if m.kind == "issue"]


def _history(fake: FakeGitHub, prs: int) -> None:
    pulls = []
    for i in range(prs):
        issue, pr = 1000 + i, 2000 + i
        fake.add_issue(LEARN_REPO, {"number": issue, "title": f"Widget {i} breaks on resize",
                              "state": "closed", "created_at": f"2026-02-{1 + i % 27:02}"})
        fake.pr_files[(LEARN_REPO, pr)] = [{"filename": f"widgets/w{i}.py",
                                      "patch": f"@@ -1 +1 @@ def resize_{i}(self):\n+x"}]
        pulls.append({"number": pr, "title": f"fix: widget {i} resize", "body": f"fixes #{issue}",
                      "merged_at": f"2026-03-{1 + i % 27:02}T00:00:00Z", "state": "closed"})
    pulls.append({"number": 3000, "title": "docs", "body": "", "merged_at": None})
    fake.pulls[LEARN_REPO] = pulls


async def _backfill(fake: FakeGitHub, base: str, key: str, data: Path) -> Store:
    store = Store(data)
    async with aiohttp.ClientSession() as session:
        app = GitHubApp(session, base_url=base, app_id=APP_ID,
                        private_key=PrivateKey(key, source="t"))
        client = RepoClient(await app.for_installation(77), LEARN_REPO)
        # The REST walk (a GitHub without the GraphQL fields); tests/test_backfill_graphql.py
        # has the GraphQL one.
        await Backfill(client, store, LEARN_REPO, graphql=False).run()
    return store


async def test_backfill_interrupted_and_resumed_equals_one_run(
        github: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    fake, base = github
    _history(fake, 150)  # two pages of pull requests
    whole = await _backfill(fake, base, key_pair[0], tmp_path / "one-run")

    # The network goes away while reading page 2: the run stops after page 1.
    store = Store(tmp_path / "resumed")
    async with aiohttp.ClientSession() as session:
        app = GitHubApp(session, base_url=base, app_id=APP_ID,
                        private_key=PrivateKey(key_pair[0], source="t"))
        client = RepoClient(await app.for_installation(77), LEARN_REPO)
        calls = 0
        original = client.page

        async def flaky(url: str, params: dict[str, Any]) -> list[dict[str, Any]]:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise ConnectionError("network went away")
            return await original(url, params)

        client.page = flaky  # type: ignore[method-assign]
        with pytest.raises(ConnectionError):
            await Backfill(client, store, LEARN_REPO, graphql=False).run()
        assert store.get_cursor(f"backfill:{LEARN_REPO}:") == "pulls:2"
        assert len(store.learned_clusters(LEARN_REPO)) == 100
        summary = await Backfill(client, store, LEARN_REPO, graphql=False).run()
    assert summary.resumed_from == "pulls:2"
    resumed = {c.public_id: c.model_dump() for c in store.learned_clusters(LEARN_REPO)}
    expected = {c.public_id: c.model_dump() for c in whole.learned_clusters(LEARN_REPO)}
    assert len(expected) == 150 and resumed == expected


def test_backtest_figures_match_a_hand_count() -> None:
    """Three bugs. Two later reports name their bug's words (they should be answered), one
    later report is about something else in the same words' absence (a miss either way), and
    the three originals were opened before any fix (silence is right)."""
    def bug(issue: int, pr: int, title: str, created: str, merged: str,
            later: list[tuple[int, str, str]]) -> Any:
        c = cluster_from_fix(LEARN_REPO, {"number": pr, "title": title, "merged_at": merged},
                             [{"number": issue, "title": title, "created_at": created}],
                             [{"filename": f"widgets/{pr}.py"}])
        for number, t, when in later:
            c = c.model_copy(update={"members": [*c.members, c.members[0].model_copy(
                update={"number": number, "title": t, "created_at": when})]})
        return c

    clusters = [
        bug(1, 101, "Exporter flush_queue hangs forever on shutdown", "2026-01-01",
            "2026-01-02", [(4, "exporter flush_queue hangs forever at shutdown", "2026-01-10")]),
        bug(2, 102, "Tooltip renders behind the modal dialog overlay", "2026-01-01",
            "2026-01-03", [(5, "tooltip renders behind modal dialog overlay", "2026-01-11")]),
        bug(3, 103, "CSV import drops the last row silently", "2026-01-01", "2026-01-04",
            [(6, "Settings page has a typo", "2026-01-12")]),
    ]
    queries = history_queries(clusters)
    assert [(q.number, q.expected) for q in queries] == [
        (1, None), (2, None), (3, None), (4, "1"), (5, "2"), (6, "3")]
    outcomes = replay(clusters, queries=queries)
    by_number = {q.number: o for q, o in zip(queries, outcomes, strict=True)}
    # The originals were opened before any fix existed: nothing to rank, silence.
    assert all(by_number[n].top is None for n in (1, 2, 3))
    assert by_number[4].top == "1" and by_number[5].top == "2"
    assert by_number[4].score >= 0.65 and by_number[5].score >= 0.65
    assert by_number[6].score < 0.65  # unrelated words: the bot would have kept quiet
    # Hand count at the default threshold: 2 comments, both right; 3 positives -> R = 2/3.
    from bot.eval.offline import pr_at

    said, right, precision, recall = pr_at(outcomes, 0.65, 0.05)
    assert (said, right) == (2, 2) and precision == 1.0 and abs(recall - 2 / 3) < 1e-9
    best = recommend_threshold(outcomes, 0.9)
    assert best is not None and best[1] == 1.0
