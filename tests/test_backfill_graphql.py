"""The GraphQL backfill (issue 26): one pass over merged PRs with their closing issues (and
files) and over duplicate-closed issues with their last comments, learning what the REST walk
learns in a fraction of the calls; extra pages only for the PR that needs them; resumable; back
to REST on a GitHub without the fields; waiting when the GraphQL budget runs low."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import gidgethub
import pytest

from bench.backfill import generate_history
from bot.db.sqlite import SQLiteStore as Store
from bot.features.backfill import LOOKAHEAD_PAGES, LOW_BUDGET, Backfill
from bot.github.app import GitHubApp
from bot.github.client import RepoClient
from bot.github.graphql import PULLS_PAGE
from bot.settings import PrivateKey
from tests.conftest import APP_ID
from tests.fake_github import FakeGitHub

REPO = "history-org/widgets"
Clusters = dict[str, dict[str, Any]]


def _graphql_calls(fake: FakeGitHub, operation: str = "") -> list[Any]:
    return [r for r in fake.requests if r.path == "/graphql" and isinstance(r.body, dict)
            and f"query DejafixBackfill{operation}" in str(r.body.get("query", ""))]


def _repo_calls(fake: FakeGitHub) -> int:
    """Calls about the repository: REST under /repos/REPO and every GraphQL query."""
    return sum(1 for r in fake.requests if f"/repos/{REPO}" in r.path or r.path == "/graphql")


async def _run(fake: FakeGitHub, base: str, key: str, data: Path, *,
               wrap: Callable[[RepoClient], None] | None = None,
               **options: Any) -> tuple[Clusters, Backfill, int]:
    """One backfill into the store at ``data``: (clusters by id, the run, calls it made)."""
    store = Store(data)
    try:
        before = _repo_calls(fake)
        async with aiohttp.ClientSession() as session:
            app = GitHubApp(session, base_url=base, app_id=APP_ID,
                            private_key=PrivateKey(key, source="t"))
            client = RepoClient(await app.for_installation(77), REPO)
            if wrap is not None:
                wrap(client)
            run = Backfill(client, store, REPO, out=io.StringIO(), **options)
            try:
                await run.run()
            finally:
                clusters = {c.public_id: c.model_dump() for c in store.learned_clusters(REPO)}
        return clusters, run, _repo_calls(fake) - before
    finally:
        store.close()


def _without_hunks(clusters: Clusters) -> Clusters:
    return {k: {**c, "members": [{**m, "fix_hunks": []} for m in c["members"]]}
            for k, c in clusters.items()}


@pytest.fixture
def history(github: tuple[FakeGitHub, str]) -> tuple[FakeGitHub, str]:
    fake, base = github
    # Pages enough for a batch read ahead and learned, and one more batch.
    generate_history(fake, prs=1000, closing_prs=300, issues=400, duplicates=80, seed=3,
                     repo=REPO)
    return fake, base


async def test_graphql_learns_what_rest_learns_in_a_25th_of_the_calls(
        history: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    fake, base = history
    rest, _, rest_calls = await _run(fake, base, key_pair[0], tmp_path / "rest", graphql=False)
    paths, run, calls = await _run(fake, base, key_pair[0], tmp_path / "paths", diffs=False)
    diffs, _, diff_calls = await _run(fake, base, key_pair[0], tmp_path / "diffs")

    assert len(rest) > 250
    # With each fix's files read over REST (with patches) the clusters are the REST walk's,
    # record for record; with paths only, the diff hunks are the one difference.
    assert diffs == rest
    assert paths == _without_hunks(rest) and paths != rest
    assert run.summary.prs_merged == 1000 and run.summary.learned > 250
    assert calls <= 1000 / 25, calls
    assert diff_calls < rest_calls / 3, (diff_calls, rest_calls)


async def test_a_pr_with_more_than_100_files_gets_its_extra_pages(
        github: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    fake, base = github
    fake.add_issue(REPO, {"number": 1, "title": "Export crashes", "state": "closed"})
    fake.add_issue(REPO, {"number": 2, "title": "Import crashes", "state": "closed"})
    fake.pulls[REPO] = [
        {"number": 10, "title": "fix export", "body": "Fixes #1", "merged_at": "2026-01-02"},
        {"number": 11, "title": "fix import", "body": "Fixes #2", "merged_at": "2026-01-03"},
        {"number": 12, "title": "big refactor", "body": "", "merged_at": "2026-01-04"}]
    fake.pr_files[(REPO, 10)] = [{"filename": f"src/f{i}.py"} for i in range(250)]
    fake.pr_files[(REPO, 11)] = [{"filename": f"lib/g{i}.py"} for i in range(450)]
    fake.pr_files[(REPO, 12)] = [{"filename": f"x/h{i}.py"} for i in range(400)]
    clusters, _, _ = await _run(fake, base, key_pair[0], tmp_path / "s", diffs=False)

    assert clusters["1"]["members"][-1]["files_changed"] == [f"src/f{i}.py" for i in range(250)]
    # Learning keeps 300 files: the 450-file PR is read up to there, no further; the PR that
    # fixes nothing is never paged.
    assert clusters["2"]["members"][-1]["files_changed"] == [f"lib/g{i}.py" for i in range(300)]
    pages = [(r.body["variables"]["number"], r.body["variables"]["after"])
             for r in _graphql_calls(fake, "PullFiles")]
    assert pages == [(10, "100"), (10, "200"), (11, "100"), (11, "200")]


async def test_resumes_from_the_saved_cursor_after_an_interruption(
        history: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    fake, base = history
    whole, _, _ = await _run(fake, base, key_pair[0], tmp_path / "whole", diffs=False)

    def flaky(client: RepoClient) -> None:
        original = client.graphql
        pulls = 0

        async def graphql(query: str, **variables: Any) -> dict[str, Any]:
            nonlocal pulls
            if "DejafixBackfillPulls" in query:
                pulls += 1
                if pulls == LOOKAHEAD_PAGES + 2:
                    raise ConnectionError("network went away")
            return await original(query, **variables)

        client.graphql = graphql  # type: ignore[method-assign]

    store_dir = tmp_path / "resumed"
    with pytest.raises(ConnectionError):
        await _run(fake, base, key_pair[0], store_dir, wrap=flaky, diffs=False)
    # The first pages read ahead were learned and saved; the one read since is read again.
    learned = LOOKAHEAD_PAGES * PULLS_PAGE
    cursor = f"gql-pulls:{learned}"
    store = Store(store_dir)
    assert store.get_cursor(f"backfill:{REPO}:") == cursor
    store.close()

    before = len(_graphql_calls(fake, "Pulls"))
    resumed, run, _ = await _run(fake, base, key_pair[0], store_dir, diffs=False)
    assert run.summary.resumed_from == cursor
    # The pages already learned are not read again.
    first = _graphql_calls(fake, "Pulls")[before]
    assert first.body["variables"]["after"] == str(learned)
    assert resumed == whole


async def test_a_github_without_the_fields_falls_back_to_rest(
        history: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    fake, base = history
    rest, _, _ = await _run(fake, base, key_pair[0], tmp_path / "rest", graphql=False)

    # As on a GitHub Enterprise without closingIssuesReferences, where the REST walk reads
    # only the closing keywords too.
    fake.graphql_missing = {"closingIssuesReferences"}
    ghes, _, _ = await _run(fake, base, key_pair[0], tmp_path / "ghes-rest", graphql=False)
    assert ghes != rest
    with caplog.at_level(logging.WARNING, logger="dejafix.backfill"):
        fallback, _, _ = await _run(fake, base, key_pair[0], tmp_path / "ghes")
    assert fallback == ghes
    warned = [r.getMessage() for r in caplog.records if "GraphQL backfill unavailable" in
              r.getMessage()]
    assert len(warned) == 1 and "closingIssuesReferences" in warned[0]
    assert fake.calls("GET", f"/repos/{REPO}/pulls")  # the REST walk ran

    # Only the issues' stateReason missing: the pulls go over GraphQL, the issues over REST.
    fake.graphql_missing = {"stateReason"}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dejafix.backfill"):
        partial, _, _ = await _run(fake, base, key_pair[0], tmp_path / "partial")
    assert partial == rest
    assert ["issues over REST" in r.getMessage() for r in caplog.records
            if "GraphQL backfill unavailable" in r.getMessage()] == [True]


async def test_other_graphql_errors_stop_the_run_instead_of_falling_back(
        history: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    fake, base = history
    fake.failures["POST /graphql"] = [502] * 8
    with pytest.raises(gidgethub.GitHubBroken):
        await _run(fake, base, key_pair[0], tmp_path / "s")
    assert not fake.calls("GET", f"/repos/{REPO}/pulls")
    # A failing page is asked again lighter (GitHub's query timeout), down to 10 PRs.
    assert [r.body["variables"]["first"] for r in _graphql_calls(fake, "Pulls")] == \
        [100, 50, 25, 12, 10]


async def test_a_low_graphql_budget_waits_for_its_reset(
        history: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    fake, base = history
    fake.graphql_remaining = LOW_BUDGET + 3  # three queries in, it is below the line
    fake.graphql_reset_at = "2030-01-01T00:10:00Z"
    now = 1893456000.0  # 2030-01-01T00:00:00Z
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        fake.graphql_remaining = 5000  # the budget is back after the reset

    await _run(fake, base, key_pair[0], tmp_path / "s", diffs=False, sleep=sleep,
               clock=lambda: now)
    assert waits == [601.0]


async def test_another_repositorys_closing_reference_teaches_nothing_here(
        github: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    """GitHub links other repositories' issues as closed by a PR too; this repository's
    issue of the same number was not fixed by it."""
    fake, base = github
    fake.add_issue(REPO, {"number": 7, "title": "Unrelated bug here", "state": "open"})
    fake.pulls[REPO] = [{"number": 20, "title": "fix upstream thing", "body": "",
                         "merged_at": "2026-01-02T00:00:00Z"}]
    fake.closing_refs[(REPO.lower(), 20)] = ["other-org/upstream#7"]
    fake.pr_files[(REPO, 20)] = [{"filename": "a.py"}]
    for options in ({"graphql": False}, {}):
        clusters, _, _ = await _run(fake, base, key_pair[0], tmp_path / str(options),
                                    **options)
        assert clusters == {}, options


def test_the_queries_are_balanced() -> None:
    from bot.github import graphql as q

    for text in [q.pulls_query(True), q.pulls_query(False), q.PR_FILES_QUERY, q.PR_REFS_QUERY,
                 q.ISSUES_QUERY, q.lookup_query(3)]:
        depth = 0
        for char in text:
            depth += (char == "{") - (char == "}")
            assert depth >= 0, text
        assert depth == 0, text


