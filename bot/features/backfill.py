"""Backfill: walk a repository's merged PRs and duplicate-closed issues once, learning the same
clusters the live handlers learn. Resumable (a cursor per repository in SQLite, saved after each
page), and careful with the rate limit (it waits when the budget runs low)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TextIO

import gidgethub

from bot.clusters.learning import MAX_FILES, duplicate_target, reverted_number
from bot.db.store import Store
from bot.features.learning import (
    fix_issue,
    learn_duplicate,
    learn_duplicate_of,
    learn_fix,
    learn_pr,
    learn_revert,
    pr_refs,
)
from bot.github import graphql as graphql_queries
from bot.github.client import RepoClient
from bot.github.graphql import schema_errors

log = logging.getLogger("dejafix.backfill")

PER_PAGE = 100
# Below this many requests left, wait for the reset rather than fail halfway through a page.
LOW_BUDGET = 50
MAX_WAIT = 3600.0


@dataclass
class Summary:
    prs_seen: int = 0
    prs_merged: int = 0
    learned: int = 0
    reverted: int = 0
    duplicates: int = 0
    pages: int = 0
    resumed_from: str | None = None
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        start = f" (resumed at {self.resumed_from})" if self.resumed_from else ""
        return [
            f"pages read {self.pages}{start}",
            f"pull requests seen {self.prs_seen}, merged {self.prs_merged}",
            f"clusters learned or updated {self.learned}, fixes reverted {self.reverted}",
            f"duplicates added {self.duplicates}",
        ]


# Pages of pull requests read before their keyword-only issues are looked up in one call.
LOOKAHEAD_PAGES = 8


@dataclass
class _Page:
    """A page of merged PRs read, not yet learned: each PR with the issue numbers it may fix
    (None: a revert), and where the walk resumes once it is learned."""

    end: str | None
    plans: list[tuple[dict[str, Any], list[int] | None]] = field(default_factory=list)
    nodes: dict[int, dict[str, Any]] = field(default_factory=dict)


class GraphQLMissing(Exception):
    """This GitHub lacks a field the GraphQL walk needs (an older GitHub Enterprise)."""


class Backfill:
    """``graphql`` (the default) walks merged PRs 100 a page with their closing issues (and, with
    ``diffs=False``, their files' paths) in the same query, and closed issues with their last
    comments for the duplicates; the REST walk is kept for a GitHub without those fields, and
    used when it answers so. ``diffs`` reads each learned fix's files over REST with their
    patches (one call per learned PR and 100 files; GraphQL has no patches): the clusters then
    equal the REST walk's exactly. Without it a cluster has its fix's paths but no diff hunks, so
    none of the symbols the matcher reads from the fix's changed lines."""

    def __init__(self, client: RepoClient, store: Store, repo: str, *, since: str | None = None,
                 out: TextIO | None = None, sleep: Callable[[float], Any] = asyncio.sleep,
                 clock: Callable[[], float] = time.time, graphql: bool = True,
                 diffs: bool = True, concurrency: int = 8) -> None:
        self.client = client
        self.store = store
        self.repo = repo
        self.since = since
        self.out = out if out is not None else sys.stderr
        self.sleep = sleep
        self.clock = clock
        self.graphql = graphql
        self.diffs = diffs
        self.concurrency = max(1, concurrency)
        self.summary = Summary()
        # The GraphQL budget, from the last answer's rateLimit: (remaining, reset epoch).
        self._gql_budget: tuple[int, float] | None = None

    @property
    def cursor_name(self) -> str:
        return f"backfill:{self.repo.lower()}:{self.since or ''}"

    async def _mind_budget(self) -> None:
        budget = self.client.rate_remaining()
        if budget is None:
            return
        remaining, reset = budget
        if remaining < LOW_BUDGET:
            wait = min(MAX_WAIT, max(0.0, reset - self.clock()) + 1)
            self._progress(f"rate limit nearly spent ({remaining} left): waiting {wait:.0f}s",
                           end="\n")
            await self.sleep(wait)

    async def _mind_graphql_budget(self) -> None:
        # GraphQL points are a budget of their own, reported in each answer's rateLimit.
        if self._gql_budget is None:
            return
        remaining, reset = self._gql_budget
        if remaining < LOW_BUDGET:
            wait = min(MAX_WAIT, max(0.0, reset - self.clock()) + 1)
            self._progress(f"GraphQL rate limit nearly spent ({remaining} points left): "
                           f"waiting {wait:.0f}s", end="\n")
            await self.sleep(wait)
            self._gql_budget = None

    def _progress(self, text: str, *, end: str = "") -> None:
        # One line rewritten in place; a line that must stay readable (a wait) ends it.
        self.out.write(f"\r{self.repo}: {text}".ljust(78) + end)
        self.out.flush()

    async def run(self) -> Summary:
        cursor = self.store.get_cursor(self.cursor_name)
        if cursor:
            self.summary.resumed_from = cursor
        default = "gql-pulls:" if self.graphql else "pulls:1"
        phase, _, at = (cursor or default).partition(":")
        if phase == "gql-pulls":
            try:
                await self._graphql_pulls(at or None)
                phase, at = "gql-issues", ""
            except GraphQLMissing as exc:
                log.warning("%s: GraphQL backfill unavailable (%s); walking pull requests over "
                            "REST", self.repo, exc)
                phase, at = "pulls", "1"
            self.store.set_cursor(self.cursor_name, f"{phase}:{at}")
        if phase == "pulls":
            await self._walk_pulls(int(at or 1))
            phase, at = ("gql-issues", "") if self.graphql else ("issues", "1")
            self.store.set_cursor(self.cursor_name, f"{phase}:{at}")
        if phase == "gql-issues":
            try:
                await self._graphql_duplicates(at or None)
                phase = "done"
            except GraphQLMissing as exc:
                log.warning("%s: GraphQL backfill unavailable (%s); walking issues over REST",
                            self.repo, exc)
                phase, at = "issues", "1"
                self.store.set_cursor(self.cursor_name, f"{phase}:{at}")
        if phase == "issues":
            await self._walk_duplicates(int(at or 1))
        self.store.set_cursor(self.cursor_name, "done:0")
        self.out.write("\n")
        return self.summary

    # -- GraphQL --------------------------------------------------------------------------------
    async def _query(self, query: str, **variables: Any) -> dict[str, Any]:
        await self._mind_graphql_budget()
        try:
            data = await self.client.graphql(query, **variables)
        except gidgethub.QueryError as exc:
            missing = schema_errors((exc.response or {}).get("errors"))
            if missing:
                raise GraphQLMissing("; ".join(missing)) from exc
            raise
        except gidgethub.BadGraphQLRequest as exc:
            if exc.status_code in (404, 410):
                raise GraphQLMissing(f"GraphQL answered {exc.status_code}") from exc
            raise
        rate = data.get("rateLimit")
        if isinstance(rate, dict) and isinstance(rate.get("remaining"), int):
            self._gql_budget = (int(rate["remaining"]), _epoch(rate.get("resetAt"), self.clock))
        repository = data.get("repository")
        if not isinstance(repository, dict):
            raise gidgethub.GraphQLException(f"{self.repo}: GraphQL answered no repository",
                                             data)
        return repository

    async def _graphql_pulls(self, after: str | None) -> None:
        query = graphql_queries.pulls_query(with_files=not self.diffs)
        first = graphql_queries.PULLS_PAGE
        issues: dict[int, dict[str, Any] | None] = {}
        ahead: list[_Page] = []
        while True:
            while True:
                try:
                    repository = await self._query(query, first=first, after=after)
                    break
                except (gidgethub.GitHubBroken, TimeoutError):
                    # GitHub gives up on a query that takes over 10 s (long bodies, many
                    # files): a smaller page is lighter; the smallest one's failure stops the
                    # run (resumable).
                    if first <= graphql_queries.PULLS_PAGE_MIN:
                        raise
                    first = max(graphql_queries.PULLS_PAGE_MIN, first // 2)
                    log.warning("%s: GraphQL page failed; asking for %d pull requests a page",
                                self.repo, first)
            conn = repository["pullRequests"]
            nodes = [n for n in conn.get("nodes") or [] if isinstance(n, dict)]
            info = conn.get("pageInfo") or {}
            after = info.get("endCursor") or after
            ahead.append(await self._plan_page(nodes, after, issues))
            last = not info.get("hasNextPage") or not nodes
            wanted = {n for page in ahead for _, refs in page.plans for n in refs or []
                      if n not in issues}
            # Issues named only by a keyword are looked up for several pages in one call;
            # the pages are then learned in order, as the REST walk learns them.
            if last or len(ahead) >= LOOKAHEAD_PAGES or len(wanted) >= graphql_queries.LOOKUP_MAX:
                await self._lookup(sorted(wanted), issues)
                for page in ahead:
                    await self._learn_page(page, issues)
                ahead = []
                # Only the pull requests' issues are kept between batches.
                issues.clear()
            if last:
                return

    async def _plan_page(self, nodes: list[dict[str, Any]], end: str | None,
                         issues: dict[int, dict[str, Any] | None]) -> _Page:
        page = _Page(end=end)
        for node in nodes:
            self.summary.prs_seen += 1
            pr = graphql_queries.pr_dict(node)
            if self.since and str(pr["merged_at"] or "") < self.since:
                continue
            self.summary.prs_merged += 1
            page.nodes[int(pr["number"])] = node
            if reverted_number(pr.get("title"), pr.get("body"), self.repo) is not None:
                page.plans.append((pr, None))
                continue
            linked = await self._linked(node, issues)
            page.plans.append((pr, pr_refs(pr, self.repo, linked)))
        return page

    async def _learn_page(self, page: _Page, issues: dict[int, dict[str, Any] | None]) -> None:
        fixes = {int(pr["number"]): [i for i in (issues.get(n) for n in refs) if fix_issue(i)]
                 for pr, refs in page.plans if refs is not None}
        files = await self._fix_files({n for n, found in fixes.items() if found}, page.nodes)
        for pr, refs in page.plans:
            number = int(pr["number"])
            if refs is None:
                outcome = await learn_revert(self.store, self.repo, pr)
                if outcome is not None and outcome[0] == "reverted":
                    self.summary.reverted += 1
                continue
            if fixes[number]:
                await learn_fix(self.store, self.repo, pr, fixes[number], files[number])
                self.summary.learned += 1
        self.summary.pages += 1
        # Saved after the page is learned: an interruption repeats at most the pages read
        # ahead, and learning a PR twice writes the same cluster.
        self.store.set_cursor(self.cursor_name, f"gql-pulls:{page.end or ''}")
        self._progress(f"pull requests: {self.summary.prs_seen} merged seen, "
                       f"{self.summary.learned} learned (page {self.summary.pages})")

    async def _linked(self, node: dict[str, Any],
                      issues: dict[int, dict[str, Any] | None]) -> list[int]:
        """The issue numbers GitHub links as closed by the PR (at most 50, as the REST walk
        reads), their issues kept in ``issues``."""
        conn = node.get("closingIssuesReferences") or {}
        refs = [n for n in conn.get("nodes") or [] if isinstance(n, dict)]
        if int(conn.get("totalCount") or 0) > len(refs):
            # Rare: more than the page asked for; this PR's first 50 in one more call.
            repository = await self._query(graphql_queries.PR_REFS_QUERY,
                                           number=int(node["number"]))
            more = ((repository.get("pullRequest") or {}).get("closingIssuesReferences") or {})
            refs = [n for n in more.get("nodes") or [] if isinstance(n, dict)]
        linked = []
        for ref in refs[:graphql_queries.CLOSING_MAX]:
            if graphql_queries.in_repo(ref, self.repo):
                issues[int(ref["number"])] = graphql_queries.issue_dict(ref)
                linked.append(int(ref["number"]))
        return linked

    async def _lookup(self, numbers: list[int],
                      issues: dict[int, dict[str, Any] | None]) -> None:
        """Issues named by a closing keyword that GitHub did not link, up to 100 a call: an
        Issue as its dict, a pull request marked as one, nothing for a number not there."""
        for start in range(0, len(numbers), graphql_queries.LOOKUP_MAX):
            chunk = numbers[start:start + graphql_queries.LOOKUP_MAX]
            repository = await self._query(graphql_queries.lookup_query(len(chunk)),
                                           **{f"n{i}": n for i, n in enumerate(chunk)})
            for i, number in enumerate(chunk):
                node = repository.get(f"i{i}")
                if not isinstance(node, dict):
                    issues[number] = None
                elif node.get("__typename") == "Issue":
                    issues[number] = graphql_queries.issue_dict(node)
                else:
                    issues[number] = {"number": number, "pull_request": {}}

    async def _fix_files(self, numbers: set[int], nodes: dict[int, dict[str, Any]]
                         ) -> dict[int, list[dict[str, Any]]]:
        """The files of each PR that will be learned: over REST with patches (``diffs``, a few
        at a time), else the paths the page brought, paged further for a PR with more."""
        if self.diffs:
            gate = asyncio.Semaphore(self.concurrency)

            async def read(number: int) -> tuple[int, list[dict[str, Any]]]:
                async with gate:
                    return number, await self.client.pr_files(number)

            if numbers:
                await self._mind_budget()
            return dict(await asyncio.gather(*(read(n) for n in sorted(numbers))))
        found: dict[int, list[dict[str, Any]]] = {}
        for number in sorted(numbers):
            conn = nodes[number].get("files") or {}
            paths = [str(f["path"]) for f in conn.get("nodes") or []
                     if isinstance(f, dict) and f.get("path")]
            info = conn.get("pageInfo") or {}
            # Learning keeps at most MAX_FILES files: no page beyond them is read.
            while info.get("hasNextPage") and len(paths) < MAX_FILES:
                repository = await self._query(graphql_queries.PR_FILES_QUERY, number=number,
                                               after=info.get("endCursor"))
                more = (repository.get("pullRequest") or {}).get("files") or {}
                paths.extend(str(f["path"]) for f in more.get("nodes") or []
                             if isinstance(f, dict) and f.get("path"))
                info = more.get("pageInfo") or {}
            found[number] = [{"filename": p} for p in paths]
        return found

    async def _graphql_duplicates(self, after: str | None) -> None:
        while True:
            repository = await self._query(graphql_queries.ISSUES_QUERY,
                                           first=graphql_queries.ISSUES_PAGE, after=after,
                                           since=self.since)
            conn = repository["issues"]
            nodes = [n for n in conn.get("nodes") or [] if isinstance(n, dict)]
            for node in nodes:
                if node.get("stateReason") != "DUPLICATE":
                    continue
                comments = node.get("comments") or {}
                bodies = [c.get("body") for c in comments.get("nodes") or []
                          if isinstance(c, dict)]
                target = duplicate_target(bodies)
                if target is None and int(comments.get("totalCount") or 0) > len(bodies):
                    # The "Duplicate of" comment may be older than the last few: read all.
                    await self._mind_budget()
                    every = await self.client.issue_comments(int(node["number"]))
                    target = duplicate_target(c.get("body") for c in every)
                issue = graphql_queries.issue_dict(node)
                if await learn_duplicate_of(self.store, self.repo, issue, target) is not None:
                    self.summary.duplicates += 1
            self.summary.pages += 1
            info = conn.get("pageInfo") or {}
            after = info.get("endCursor") or after
            self.store.set_cursor(self.cursor_name, f"gql-issues:{after or ''}")
            self._progress(f"issues: page {self.summary.pages}, "
                           f"{self.summary.duplicates} duplicates")
            if not info.get("hasNextPage") or not nodes:
                return

    # -- REST (GitHub Enterprise without the GraphQL fields) -----------------------------------
    async def _walk_pulls(self, page: int) -> int:
        while True:
            await self._mind_budget()
            # Oldest first, so a later fix of the same bug updates the earlier one's cluster.
            items = await self.client.page(
                "/repos/{+repo}/pulls?state=closed&sort=created&direction=asc"
                "&per_page={per_page}&page={page}", {"per_page": PER_PAGE, "page": page})
            if not items:
                return page
            for pr in items:
                self.summary.prs_seen += 1
                if not pr.get("merged_at"):
                    continue
                if self.since and str(pr["merged_at"]) < self.since:
                    continue
                self.summary.prs_merged += 1
                outcome, _ = await learn_pr(self.client, self.store, self.repo, pr)
                if outcome == "learned":
                    self.summary.learned += 1
                elif outcome == "reverted":
                    self.summary.reverted += 1
            self.summary.pages += 1
            page += 1
            # Saved after the page is done: an interruption repeats at most one page, and
            # learning a PR twice writes the same cluster.
            self.store.set_cursor(self.cursor_name, f"pulls:{page}")
            self._progress(f"pull requests: {self.summary.prs_seen} seen, "
                           f"{self.summary.learned} learned (page {page - 1})")
            if len(items) < PER_PAGE:
                return page

    async def _walk_duplicates(self, page: int) -> None:
        while True:
            await self._mind_budget()
            params: dict[str, Any] = {"per_page": PER_PAGE, "page": page}
            url = ("/repos/{+repo}/issues?state=closed&sort=created&direction=asc"
                   "&per_page={per_page}&page={page}")
            if self.since:
                url += "&since={since}"
                params["since"] = self.since
            items = await self.client.page(url, params)
            if not items:
                return
            for issue in items:
                if "pull_request" in issue or issue.get("state_reason") != "duplicate":
                    continue
                _, updated = await learn_duplicate(self.client, self.store, self.repo, issue)
                if updated is not None:
                    self.summary.duplicates += 1
            self.summary.pages += 1
            page += 1
            self.store.set_cursor(self.cursor_name, f"issues:{page}")
            self._progress(f"issues: page {page - 1}, {self.summary.duplicates} duplicates")
            if len(items) < PER_PAGE:
                return


def _epoch(stamp: Any, clock: Callable[[], float]) -> float:
    """An ISO timestamp (GraphQL's resetAt) as epoch seconds; an hour from now if unreadable."""
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return clock() + 3600.0
