"""The GraphQL backfill (issue 26): one pass over merged PRs with their closing issues and
files' paths and over duplicate-closed issues with their last comments, learning every cluster
in a fraction of the REST walk's calls; then the diffs phase, the learned fixes' patches over
REST, after which the clusters are the REST walk's record for record. Extra pages only for the PR
that needs them; resumable in every phase; back to REST on a GitHub without the fields; waiting
when a budget runs low; its progress in one object, drawn by the CLI."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import gidgethub
import pytest

from bench.backfill import generate_history
from bot.db.sqlite import SQLiteStore as Store
from bot.features.backfill import (
    DIFFS_BATCH,
    LOOKAHEAD_PAGES,
    LOW_BUDGET,
    Backfill,
    BackfillProgress,
)
from bot.github.app import GitHubApp
from bot.github.client import RepoClient
from bot.github.graphql import PULLS_PAGE
from bot.settings import PrivateKey
from tests.conftest import APP_ID, ROOT
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
            run = Backfill(client, store, REPO, **options)
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


class Boundary:
    """A progress callback keeping what the store held, and the calls the fake had seen, when
    every cluster was learned (the run enters the diffs phase or ends)."""

    def __init__(self, fake: FakeGitHub, data: Path) -> None:
        self.fake, self.data = fake, data
        self.clusters: Clusters | None = None
        self.fake_calls = 0
        self.seen: list[BackfillProgress] = []
        self.before = _repo_calls(fake)

    def __call__(self, progress: BackfillProgress) -> None:
        self.seen.append(dataclasses.replace(progress))
        if progress.clusters_at is not None and self.clusters is None:
            self.fake_calls = _repo_calls(self.fake) - self.before
            store = Store(self.data)
            try:
                self.clusters = {c.public_id: c.model_dump()
                                 for c in store.learned_clusters(REPO)}
            finally:
                store.close()


async def test_paths_first_then_diffs_learns_what_rest_learns(
        history: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    fake, base = history
    rest, _, rest_calls = await _run(fake, base, key_pair[0], tmp_path / "rest", graphql=False)
    paths, run, calls = await _run(fake, base, key_pair[0], tmp_path / "paths", diffs=False)
    boundary = Boundary(fake, tmp_path / "diffs")
    diffs, first, diff_calls = await _run(fake, base, key_pair[0], tmp_path / "diffs",
                                          progress=boundary)

    assert len(rest) > 250
    # Every cluster is learned first, with its fix's paths (the diff hunks are the one
    # difference from the REST walk's); the diffs phase then makes them the REST walk's,
    # record for record.
    assert boundary.clusters == _without_hunks(rest) and boundary.clusters != rest
    assert diffs == rest
    assert paths == _without_hunks(rest) and paths != rest
    assert run.summary.prs_merged == 1000 and run.summary.learned > 250
    assert first.summary.diffs > 250
    # Until the clusters are learned: at most one call per 25 merged PRs, and GraphQL only.
    assert boundary.fake_calls <= 1000 / 25, boundary.fake_calls
    assert calls <= 1000 / 25, calls
    assert diff_calls < rest_calls / 3, (diff_calls, rest_calls)

    # The progress object's figures: the total GitHub gave, all of it read, calls as the fake
    # counted them, the phases in order.
    progress = first.progress
    assert progress.prs_total == 1000 and progress.prs_read == 1000
    assert progress.issues_total == progress.issues_read > 0
    assert progress.fixes_total == progress.fixes_read == first.summary.diffs
    assert progress.calls == diff_calls
    assert progress.calls_to_clusters == boundary.fake_calls
    assert progress.clusters == len(rest) and progress.phase == "done"
    phases = [p.phase for p in boundary.seen]
    assert sorted(set(phases), key=phases.index) == ["pulls", "duplicates", "diffs", "done"]
    reads = [p.prs_read for p in boundary.seen]
    assert reads == sorted(reads) and reads[0] < 1000


async def test_the_diffs_phase_keeps_what_later_fixes_and_duplicates_added(
        github: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    """Issue 1 is fixed by #10, fixed again by #20 (which leads the cluster then), and #3 is
    closed as its duplicate: #10's hunks, filled in last, go into the cluster as it is."""
    fake, base = github
    for number, title in [(1, "Export crashes on empty rows"), (2, "Import hangs"),
                          (3, "Export crash again")]:
        fake.add_issue(REPO, {"number": number, "title": title, "state": "closed",
                              "state_reason": "duplicate" if number == 3 else "completed",
                              "created_at": f"2026-01-0{number}T00:00:00Z"})
    fake.comments[(REPO.lower(), 3)] = [{"id": 1, "body": "Duplicate of #1"}]
    fake.pulls[REPO] = [
        {"number": 10, "title": "fix export", "body": "Fixes #1", "merged_at": "2026-01-05"},
        {"number": 11, "title": "fix import", "body": "Fixes #2", "merged_at": "2026-01-06"},
        {"number": 20, "title": "fix export again", "body": "Fixes #1",
         "merged_at": "2026-01-07"}]
    for number in (10, 11, 20):
        fake.pr_files[(REPO, number)] = [
            {"filename": f"src/m{number}.py", "patch": f"@@ -1 +1 @@ def f{number}():\n+x"},
            {"filename": "logo.png"}]  # binary: no patch, no hunk
    rest, _, _ = await _run(fake, base, key_pair[0], tmp_path / "rest", graphql=False)
    boundary = Boundary(fake, tmp_path / "first")
    first, _, _ = await _run(fake, base, key_pair[0], tmp_path / "first", progress=boundary)

    assert first == rest
    cluster = first["1"]
    assert cluster["landed_fix"]["pr"] == 20
    assert {(m["kind"], m["number"]) for m in cluster["members"]} == {
        ("issue", 1), ("issue", 3), ("pr", 10), ("pr", 20)}
    assert [h["file"] for m in cluster["members"] if m["kind"] == "pr"
            for h in m["fix_hunks"]] == ["src/m10.py", "src/m20.py"]
    assert boundary.clusters == _without_hunks(rest)


async def test_an_interrupted_diffs_phase_resumes_without_reading_done_fixes_again(
        history: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    fake, base = history
    rest, _, _ = await _run(fake, base, key_pair[0], tmp_path / "rest", graphql=False)

    def flaky(client: RepoClient) -> None:
        original = client.pr_files
        reads = 0

        async def pr_files(number: int, limit: int = 3000) -> list[dict[str, Any]]:
            nonlocal reads
            reads += 1
            if reads == DIFFS_BATCH + 5:  # in the second batch
                raise ConnectionError("network went away")
            return await original(number, limit)

        client.pr_files = pr_files  # type: ignore[method-assign]

    store_dir = tmp_path / "resumed"
    start = len(fake.requests)
    with pytest.raises(ConnectionError):
        await _run(fake, base, key_pair[0], store_dir, wrap=flaky)
    store = Store(store_dir)
    cursor = store.get_cursor(f"backfill:{REPO}:")
    store.close()
    assert cursor is not None and cursor.startswith("diffs:")
    done = int(cursor.partition(":")[2])

    middle = len(fake.requests)
    resumed, run, _ = await _run(fake, base, key_pair[0], store_dir)
    assert run.summary.resumed_from == cursor
    assert resumed == rest

    def files_read(requests: list[Any]) -> list[tuple[int, str]]:
        # A PR with over 100 files is read a page (``page=``) at a time.
        return [(int(r.path.split("/")[-2]), r.query) for r in requests
                if r.path.startswith(f"/repos/{REPO}/pulls/") and r.path.endswith("/files")]

    before, after = files_read(fake.requests[start:middle]), files_read(fake.requests[middle:])
    # The first batch was saved; the resumed run reads only the fixes after it, each page
    # once, and no GraphQL page again.
    assert len({n for n, _ in before if n <= done}) == DIFFS_BATCH
    assert after and min(n for n, _ in after) > done and len(after) == len(set(after))
    assert not [r for r in fake.requests[middle:] if r.path == "/graphql"]
    assert run.progress.fixes_read == run.progress.fixes_total == \
        DIFFS_BATCH + len({n for n, _ in after})


async def test_the_diffs_phase_waits_for_the_rest_budget(
        history: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    """The fake serves no REST rate headers: the client's reading of them is what is set."""
    fake, base = history
    now = 1893456000.0
    waits: list[float] = []
    waiting: list[float | None] = []
    budget: list[tuple[int, float] | None] = [None]

    def low(client: RepoClient) -> None:
        client.rate_remaining = lambda: budget[0]  # type: ignore[method-assign]

    def watch(progress: BackfillProgress) -> None:
        if progress.phase == "diffs" and budget[0] is None:
            budget[0] = (LOW_BUDGET - 1, now + 300)
        waiting.append(progress.waiting_until)

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    await _run(fake, base, key_pair[0], tmp_path / "s", wrap=low, sleep=sleep,
               clock=lambda: now, progress=watch)
    # Eight readers at a time, one wait for the one reset.
    assert waits == [301.0]
    assert now + 301.0 in waiting and waiting[-1] is None


async def test_without_diffs_a_later_run_adds_only_them(
        history: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path) -> None:
    fake, base = history
    rest, _, _ = await _run(fake, base, key_pair[0], tmp_path / "rest", graphql=False)
    start = len(fake.requests)
    paths, _, _ = await _run(fake, base, key_pair[0], tmp_path / "s", diffs=False)
    assert paths == _without_hunks(rest)
    assert not [r for r in fake.requests[start:] if r.path.startswith(f"/repos/{REPO}/pulls/")]
    before = len(fake.requests)
    later, run, _ = await _run(fake, base, key_pair[0], tmp_path / "s")
    assert later == rest and run.summary.resumed_from == "done-paths:0"
    assert not [r for r in fake.requests[before:] if r.path == "/graphql"]


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




async def test_the_cli_prints_plain_progress_lines_when_not_on_a_terminal(
        history: tuple[FakeGitHub, str], tmp_path: Path) -> None:
    """``python -m bot backfill`` in a real process, its stderr a pipe: lines, not a bar."""
    fake, base = history
    token = "ghp_" + "t" * 36
    fake.tokens[token] = 77
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEJAFIX_")}
    env.update({"DEJAFIX_GITHUB_URL": base, "DEJAFIX_GITHUB_TOKEN": token,
                "DEJAFIX_DATA_DIR": str(tmp_path / "data")})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bot", "backfill", REPO, cwd=ROOT, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    stdout, stderr = out.decode(), err.decode()
    assert proc.returncode == 0, stderr
    assert token not in stdout + stderr
    lines = [line for line in stderr.splitlines() if line.startswith(f"{REPO}: ")]
    assert "\r" not in stderr and "\x1b[" not in stderr  # no bar drawn on a pipe
    # A line after the first page (with GitHub's total), then every ten pages of a hundred.
    left = r"(, ~\d+ s left)?"
    assert re.fullmatch(rf"{REPO}: pull requests 100/1000 read, 0 clusters, 1 calls{left}",
                        lines[0]), lines
    pattern = rf"{REPO}: pull requests 1000/1000 read, \d+ clusters, \d+ calls{left}"
    assert any(re.fullmatch(pattern, line) for line in lines), lines
    learned = [line for line in lines if "every cluster learned" in line]
    assert len(learned) == 1 and re.search(r"learned: \d+ clusters, \d+ calls", learned[0])
    assert any(re.match(rf"{REPO}: fixes' diffs 0/\d+ read", line) for line in lines), lines
    assert re.fullmatch(rf"{REPO}: done: \d+ clusters, \d+ calls, [\d.]+ min", lines[-1])
    assert "fixes given their diff hunks" in stdout
    assert fake.calls("GET", f"/repos/{REPO}/pulls/")

    # --no-diffs: no REST patches read, and the run says it finished without them.
    start = len(fake.requests)
    env["DEJAFIX_DATA_DIR"] = str(tmp_path / "paths")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bot", "backfill", REPO, "--no-diffs", cwd=ROOT, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert "fixes' diffs" not in err.decode()
    assert not [r for r in fake.requests[start:] if r.path.startswith(f"/repos/{REPO}/pulls/")]


def test_the_view_draws_the_wait_and_the_bar_on_a_terminal(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from bot.cli_progress import BackfillView, clock_time

    monkeypatch.setenv("COLUMNS", "200")  # the terminal's width, as rich reads it

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    now = 1893456000.0
    progress = BackfillProgress(repo=REPO, prs_total=1000, started_at=now - 60,
                                phase_started_at=now - 60)
    for stream in (io.StringIO(), Terminal()):
        with BackfillView(stream, clock=lambda: now) as view:
            progress.prs_read, progress.calls, progress.clusters = 0, 0, 0
            view(progress)
            progress.prs_read, progress.calls, progress.clusters = 250, 3, 70
            progress.waiting_until = now + 600
            view(progress)
            progress.waiting_until = None
            view(progress)
        text = stream.getvalue()
        assert f"waiting for the rate limit until {clock_time(now + 600)}" in text, text
        if isinstance(stream, Terminal):
            # The bar: the count of the total, and the time left at the rate so far.
            assert "250/1000" in text and "70 clusters, 3 calls, ~3.0 min left" in text, text
        else:
            assert text.splitlines()[-1] == (f"{REPO}: pull requests 250/1000 read, 70 clusters,"
                                             " 3 calls, waiting for the rate limit until "
                                             f"{clock_time(now + 600)}")
