"""Backfill: walk a repository's merged PRs and duplicate-closed issues once, learning the same
clusters the live handlers learn. Resumable (a cursor per repository in SQLite, saved after each
page), and careful with the rate limit (it waits when the budget runs low).

Paths first, diffs after: every cluster is learned from GraphQL with its fix's paths (the
repository is matched on files, titles and bodies as soon as that is done), then a last phase
reads the learned fixes' patches over REST for their diff hunks. Its progress is one
``BackfillProgress`` the run updates in place."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import gidgethub

from bot.clusters.learning import MAX_FILES, duplicate_target, reverted_number
from bot.db.store import Store
from bot.features.learning import (
    fix_issue,
    learn_duplicate,
    learn_duplicate_of,
    learn_fix,
    learn_fix_hunks,
    learn_pr,
    learn_revert,
    pr_refs,
)
from bot.github import graphql as graphql_queries
from bot.github.client import CALLS, CallTally, RepoClient
from bot.github.graphql import schema_errors
from bot.github.payloads import iso_seconds

log = logging.getLogger("dejafix.backfill")
_T = TypeVar("_T")

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
    diffs: int = 0
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
            f"fixes given their diff hunks {self.diffs}",
        ]


# The phases, in order: "clusters" are learned by the end of "duplicates"; "diffs" adds hunks.
PHASES = ("pulls", "duplicates", "diffs", "done")


@dataclass
class BackfillProgress:
    """What a backfill has done, updated in place as it runs: the figures the CLI draws, kept in
    one typed object so that another view (the web page, /metrics) can show the same ones.
    Counts are of this repository's walk (``*_read`` carry over a resumed run); ``calls`` are
    this process's requests to GitHub. A total is None until GitHub has said it (the REST walk
    never does)."""

    repo: str
    phase: str = "pulls"
    prs_read: int = 0
    prs_total: int | None = None
    issues_read: int = 0
    issues_total: int | None = None
    fixes_read: int = 0
    fixes_total: int | None = None
    clusters: int = 0
    duplicates: int = 0
    calls: int = 0
    pages: int = 0
    started_at: float = 0.0
    waiting_until: float | None = None
    # When every cluster was learned (the end of the duplicates phase), and the calls by then.
    clusters_at: float | None = None
    calls_to_clusters: int | None = None
    # Where the current phase began (time, work done by then): its rate gives the time left.
    phase_started_at: float = 0.0
    phase_done_at_start: int = 0

    def done_and_total(self) -> tuple[int, int | None]:
        """The current phase's work: (done, total or None)."""
        if self.phase == "duplicates":
            return self.issues_read, self.issues_total
        if self.phase == "diffs":
            return self.fixes_read, self.fixes_total
        return self.prs_read, self.prs_total

    def seconds_left(self, now: float) -> float | None:
        """The current phase's time left at the rate it has gone so far; None until known."""
        done, total = self.done_and_total()
        did, elapsed = done - self.phase_done_at_start, now - self.phase_started_at
        if total is None or did <= 0 or elapsed <= 0:
            return None
        return max(0, total - done) * elapsed / did

    def enter(self, phase: str, now: float) -> None:
        self.phase = phase
        self.phase_started_at = now
        self.phase_done_at_start = self.done_and_total()[0]


# Pages of pull requests read before their keyword-only issues are looked up in one call.
LOOKAHEAD_PAGES = 8
# Fixes whose patches are read between two saves of the diffs phase's cursor.
DIFFS_BATCH = 32


@dataclass
class _Page:
    """A page of merged PRs read, not yet learned: each PR with the issue numbers it may fix
    (None: a revert), and where the walk resumes once it is learned."""

    end: str | None
    plans: list[tuple[dict[str, Any], list[int] | None]] = field(default_factory=list)
    nodes: dict[int, dict[str, Any]] = field(default_factory=dict)
    # PRs read up to the end of this page (kept with the cursor, for a resumed run's figures).
    read: int = 0


class BackfillPaused(Exception):
    """The run stopped at a saved cursor because its caller asked it to (``should_pause``): the
    next run resumes there. A backfill run as queued jobs does a slice at a time, so that it
    never holds a worker for long."""


class GraphQLMissing(Exception):
    """This GitHub lacks a field the GraphQL walk needs (an older GitHub Enterprise)."""


class Backfill:
    """``graphql`` (the default) walks merged PRs 100 a page with their closing issues and their
    files' paths in the same query, and closed issues with their last comments for the
    duplicates: every cluster is then learned, with its fix's paths and no diff hunks. With
    ``diffs`` (the default), a last phase reads each learned fix's files over REST with their
    patches (``concurrency`` at a time; GraphQL has no patches) and writes their hunks into the
    cluster as it is then; the clusters end equal to the REST walk's. The REST walk is kept for
    a GitHub without those fields, and used when it answers so. ``progress`` is called with
    ``self.progress`` whenever a figure of it changes."""

    def __init__(self, client: RepoClient, store: Store, repo: str, *, since: str | None = None,
                 sleep: Callable[[float], Any] = asyncio.sleep,
                 clock: Callable[[], float] = time.time, graphql: bool = True,
                 diffs: bool = True, concurrency: int = 8,
                 progress: Callable[[BackfillProgress], None] | None = None,
                 should_pause: Callable[[], bool] | None = None) -> None:
        self.client = client
        self.store = store
        self.repo = repo
        self.since = since
        self.sleep = sleep
        self.clock = clock
        self.graphql = graphql
        self.diffs = diffs
        self.concurrency = max(1, concurrency)
        self.summary = Summary()
        self.progress = BackfillProgress(repo=repo)
        self._on_progress = progress
        self._should_pause = should_pause
        self._tally = CallTally("backfill")
        # The GraphQL budget, from the last answer's rateLimit: (remaining, reset epoch).
        self._gql_budget: tuple[int, float] | None = None
        # Concurrent readers of the diffs phase wait for one reset once, not once each.
        self._budget_lock = asyncio.Lock()
        self._waited_for: float | None = None

    @property
    def cursor_name(self) -> str:
        return f"backfill:{self.repo.lower()}:{self.since or ''}"

    @property
    def _read_name(self) -> str:
        # Beside the cursor, not under its prefix (the web page lists those as backfills).
        return f"backfill-read:{self.repo.lower()}:{self.since or ''}"

    async def _mind_budget(self) -> None:
        async with self._budget_lock:
            budget = self.client.rate_remaining()
            if budget is None:
                return
            remaining, reset = budget
            # The figure is the last answer's: once waited for, a reset is not waited for again.
            if remaining < LOW_BUDGET and reset != self._waited_for:
                await self._wait(reset, f"rate limit nearly spent ({remaining} left)")
                self._waited_for = reset

    async def _mind_graphql_budget(self) -> None:
        # GraphQL points are a budget of their own, reported in each answer's rateLimit.
        if self._gql_budget is None:
            return
        remaining, reset = self._gql_budget
        if remaining < LOW_BUDGET:
            await self._wait(reset, f"GraphQL rate limit nearly spent ({remaining} points left)")
            self._gql_budget = None

    async def _wait(self, reset: float, why: str) -> None:
        now = self.clock()
        wait = min(MAX_WAIT, max(0.0, reset - now) + 1)
        log.info("%s: %s: waiting %.0fs", self.repo, why, wait)
        self.progress.waiting_until = now + wait
        self._report()
        try:
            await self.sleep(wait)
        finally:
            self.progress.waiting_until = None
            self._report()

    def _report(self) -> None:
        self.progress.calls = self._tally.calls
        if self._on_progress is not None:
            self._on_progress(self.progress)

    def _checkpoint(self) -> None:
        """Called right after a cursor was saved with more to do: stop here if asked to."""
        if self._should_pause is not None and self._should_pause():
            raise BackfillPaused(self.store.get_cursor(self.cursor_name) or "")

    def _enter(self, phase: str) -> None:
        if phase == "diffs" or (phase == "done" and self.progress.clusters_at is None):
            # Every cluster is learned: the repository is matched on files, titles and bodies.
            self.progress.clusters_at = self.clock()
            self.progress.calls_to_clusters = self._tally.calls
        self.progress.enter(phase, self.clock())
        self._report()

    def _save(self, cursor: str) -> None:
        self.store.set_cursor(self.cursor_name, cursor)
        self.store.set_cursor(self._read_name,
                              f"{self.progress.prs_read},{self.progress.issues_read}")

    async def run(self) -> Summary:
        # Every request through the client counts here (``RetryingGitHubAPI``), the concurrent
        # readers' too (they share this context's tally); a caller's own tally still sees them.
        outer = CALLS.get()
        token = CALLS.set(self._tally)
        try:
            return await self._run()
        finally:
            CALLS.reset(token)
            if outer is not None:
                outer.calls += self._tally.calls
                outer.conditional += self._tally.conditional

    async def _run(self) -> Summary:
        cursor = self.store.get_cursor(self.cursor_name)
        if cursor:
            self.summary.resumed_from = cursor
        read = (self.store.get_cursor(self._read_name) or "").split(",")
        if cursor and len(read) == 2 and all(part.isdigit() for part in read):
            self.progress.prs_read, self.progress.issues_read = int(read[0]), int(read[1])
        self.progress.started_at = self.clock()
        self.progress.clusters = await asyncio.to_thread(self.store.learned_count, self.repo)
        default = "gql-pulls:" if self.graphql else "pulls:1"
        phase, _, at = (cursor or default).partition(":")
        if phase == "done-paths" and self.diffs:
            # A run without diffs finished: this one adds them.
            phase, at = "diffs", ""
        if phase != "diffs":
            # The diffs phase is entered once its total is known (``_fill_diffs``).
            self._enter({"gql-pulls": "pulls", "pulls": "pulls", "gql-issues": "duplicates",
                         "issues": "duplicates"}.get(phase, "done"))
        if phase == "gql-pulls":
            try:
                await self._graphql_pulls(at or None)
                phase, at = "gql-issues", ""
            except GraphQLMissing as exc:
                log.warning("%s: GraphQL backfill unavailable (%s); walking pull requests over "
                            "REST", self.repo, exc)
                phase, at = "pulls", "1"
            self._save(f"{phase}:{at}")
        if phase == "pulls":
            await self._walk_pulls(int(at or 1))
            phase, at = ("gql-issues", "") if self.graphql else ("issues", "1")
            self._save(f"{phase}:{at}")
        if phase in ("gql-issues", "issues") and self.progress.phase != "duplicates":
            self._enter("duplicates")
        if phase == "gql-issues":
            try:
                await self._graphql_duplicates(at or None)
                phase, at = "diffs", ""
            except GraphQLMissing as exc:
                log.warning("%s: GraphQL backfill unavailable (%s); walking issues over REST",
                            self.repo, exc)
                phase, at = "issues", "1"
                self._save(f"{phase}:{at}")
        if phase == "issues":
            await self._walk_duplicates(int(at or 1))
            phase, at = "diffs", ""
        if phase == "diffs":
            if self.diffs:
                self._save(f"diffs:{at}")
                await self._fill_diffs(int(at or 0))
                phase = "done"
            else:
                # Finished without the hunks: a later run with diffs reads only those.
                phase = "done-paths"
        self.store.set_cursor(self.cursor_name, f"{phase}:0")
        self.store.set_cursor(self._read_name, None)
        self._enter("done")
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
        # Paths only: the patches are the diffs phase's, once every cluster is learned.
        query = graphql_queries.pulls_query(with_files=True)
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
            if isinstance(conn.get("totalCount"), int):
                self.progress.prs_total = int(conn["totalCount"])
            nodes = [n for n in conn.get("nodes") or [] if isinstance(n, dict)]
            info = conn.get("pageInfo") or {}
            after = info.get("endCursor") or after
            ahead.append(await self._plan_page(nodes, after, issues))
            self.progress.pages += 1
            self._report()
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
                if not last:
                    self._checkpoint()
            if last:
                return

    async def _plan_page(self, nodes: list[dict[str, Any]], end: str | None,
                         issues: dict[int, dict[str, Any] | None]) -> _Page:
        page = _Page(end=end)
        for node in nodes:
            self.summary.prs_seen += 1
            self.progress.prs_read += 1
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
        page.read = self.progress.prs_read
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
        self.store.set_cursor(self._read_name, f"{page.read},{self.progress.issues_read}")
        self.progress.clusters = await asyncio.to_thread(self.store.learned_count, self.repo)
        self._report()

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
        """The paths of each PR that will be learned, from its page, paged further for a PR with
        more (no patches: the diffs phase reads those)."""
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
            if isinstance(conn.get("totalCount"), int):
                self.progress.issues_total = int(conn["totalCount"])
            nodes = [n for n in conn.get("nodes") or [] if isinstance(n, dict)]
            self.progress.issues_read += len(nodes)
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
                    self.progress.duplicates += 1
            self.summary.pages += 1
            self.progress.pages += 1
            info = conn.get("pageInfo") or {}
            after = info.get("endCursor") or after
            self._save(f"gql-issues:{after or ''}")
            self._report()
            if not info.get("hasNextPage") or not nodes:
                return
            self._checkpoint()

    # -- diffs: the learned fixes' patches over REST -------------------------------------------
    async def _fill_diffs(self, after: int) -> None:
        """Each learned fix PR above ``after`` whose files have no hunks yet, in PR order: its
        files over REST with patches, ``concurrency`` at a time, the hunks written into its
        cluster as the store has it now. The cursor (the last PR done) is saved after each
        batch, so an interruption repeats at most one batch."""
        clusters = await asyncio.to_thread(self.store.learned_clusters, self.repo)
        fixes = sorted({m.number for c in clusters for m in c.members
                        if m.is_pr and m.files_changed})
        lacking = {m.number for c in clusters for m in c.members
                   if m.is_pr and m.files_changed and not m.fix_hunks}
        del clusters
        todo = [n for n in fixes if n > after and n in lacking]
        self.progress.fixes_read = sum(1 for n in fixes if n <= after)
        self.progress.fixes_total = self.progress.fixes_read + len(todo)
        self._enter("diffs")
        gate = asyncio.Semaphore(self.concurrency)

        async def read(number: int) -> list[dict[str, Any]]:
            async with gate:
                await self._mind_budget()
                # Learning keeps MAX_FILES files: no page beyond them is read.
                return await self.client.pr_files(number, limit=MAX_FILES)

        for start in range(0, len(todo), DIFFS_BATCH):
            batch = todo[start:start + DIFFS_BATCH]
            files = await _all_or_none([read(n) for n in batch])
            for number, found in zip(batch, files, strict=True):
                if await learn_fix_hunks(self.store, self.repo, number, found) is not None:
                    self.summary.diffs += 1
            self.progress.fixes_read += len(batch)
            self.progress.pages += 1
            self._save(f"diffs:{batch[-1]}")
            self._report()
            if start + DIFFS_BATCH < len(todo):
                self._checkpoint()

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
                self.progress.prs_read += 1
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
            self.progress.pages += 1
            page += 1
            # Saved after the page is done: an interruption repeats at most one page, and
            # learning a PR twice writes the same cluster.
            self._save(f"pulls:{page}")
            self.progress.clusters = await asyncio.to_thread(self.store.learned_count,
                                                             self.repo)
            self._report()
            if len(items) < PER_PAGE:
                return page
            self._checkpoint()

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
            self.progress.issues_read += sum(1 for i in items if "pull_request" not in i)
            for issue in items:
                if "pull_request" in issue or issue.get("state_reason") != "duplicate":
                    continue
                _, updated = await learn_duplicate(self.client, self.store, self.repo, issue)
                if updated is not None:
                    self.summary.duplicates += 1
                    self.progress.duplicates += 1
            self.summary.pages += 1
            self.progress.pages += 1
            page += 1
            self._save(f"issues:{page}")
            self._report()
            if len(items) < PER_PAGE:
                return
            self._checkpoint()


async def _all_or_none(calls: list[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Every call's answer, in order; when one fails, the others are cancelled before its error
    is raised as it is: none is left reading (or retrying) after the run has stopped."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _epoch(stamp: Any, clock: Callable[[], float]) -> float:
    """An ISO timestamp (GraphQL's resetAt) as epoch seconds; an hour from now if unreadable."""
    seconds = iso_seconds(stamp)
    return seconds if seconds is not None else clock() + 3600.0
