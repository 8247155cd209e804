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
from typing import Any, TextIO

from bot.db.store import Store
from bot.features.learning import learn_duplicate, learn_pr
from bot.github.client import RepoClient

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


class Backfill:
    def __init__(self, client: RepoClient, store: Store, repo: str, *, since: str | None = None,
                 out: TextIO | None = None, sleep: Callable[[float], Any] = asyncio.sleep,
                 clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.store = store
        self.repo = repo
        self.since = since
        self.out = out if out is not None else sys.stderr
        self.sleep = sleep
        self.clock = clock
        self.summary = Summary()

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

    def _progress(self, text: str, *, end: str = "") -> None:
        # One line rewritten in place; a line that must stay readable (a wait) ends it.
        self.out.write(f"\r{self.repo}: {text}".ljust(78) + end)
        self.out.flush()

    async def run(self) -> Summary:
        cursor = self.store.get_cursor(self.cursor_name)
        phase, _, page_text = (cursor or "pulls:1").partition(":")
        page = int(page_text or 1)
        if cursor:
            self.summary.resumed_from = cursor
        if phase == "pulls":
            page = await self._walk_pulls(page)
            phase, page = "issues", 1
            self.store.set_cursor(self.cursor_name, f"{phase}:{page}")
        if phase == "issues":
            await self._walk_duplicates(page)
        self.store.set_cursor(self.cursor_name, "done:0")
        self.out.write("\n")
        return self.summary

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
