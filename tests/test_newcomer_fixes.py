"""What a newcomer noticed: a dry run's answer is shown on the page as a suggestion (marked as a
dry run's) rather than as nothing, and a repository whose releases GitHub answers 404 is asked,
and logged, once per cache time rather than on every delivery naming a version."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bot.db.sqlite import SQLiteStore
from bot.db.store import CommentRecord, Suggestion
from bot.web.dashboard import suggestion_state
from tests.conftest import REPO, BotFactory, issue_payload
from tests.samples import RESET_HANG, SAMPLES

RELEASES = f"/repos/{REPO}/releases"


def with_version(version: str) -> dict[str, str]:
    """The sample bug through an issue form that asks for the version."""
    return {"title": RESET_HANG["title"],
            "body": RESET_HANG["body"] + f"\n### Version\n\n{version}\n"}


async def test_releases_answered_404_are_asked_and_logged_once_per_cache_time(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    bot = await make_bot(config=SAMPLES)
    bot.github.failures[f"GET {RELEASES}"] = [404] * 10
    with caplog.at_level(logging.INFO, logger="dejafix.known_fix"):
        for number in (90001, 90002, 90003):
            await bot.deliver("issues", issue_payload(**with_version("1.4.0"), number=number))
            await bot.settle()
    # Every issue is still answered; the releases were asked for once.
    for number in (90001, 90002, 90003):
        assert len(bot.github.calls("POST", f"/repos/{REPO}/issues/{number}/comments")) == 1
    assert len(bot.github.calls("GET", RELEASES)) == 1
    logged = [r for r in caplog.records if "releases unavailable" in r.getMessage()]
    assert len(logged) == 1 and "BadRequest" in logged[0].getMessage()


def suggestion(mode: str) -> Suggestion:
    return Suggestion(repo=REPO.lower(), issue=7, cluster="35994", score=0.9, mode=mode,
                      body="…", evidence="{}", created_at=1.0, updated_at=1.0)


def test_a_comment_suggestion_without_a_posted_comment_is_a_dry_run_s() -> None:
    assert suggestion_state(suggestion("comment"), None, []) == "dry run (not posted)"
    posted = CommentRecord(REPO.lower(), 7, 555, "35994", 0.9, "h", 1.0, 1.0)
    assert suggestion_state(suggestion("comment"), posted, []) == "posted"
    assert suggestion_state(suggestion("shadow"), None, []) == "shadow (not posted)"


def test_the_store_keeps_a_dry_run_suggestion_the_page_reads_back(tmp_path: Path) -> None:
    """The page reads what ``known_fix`` records: a dry run's comment suggestion (no ledger
    row, since nothing was posted) comes back marked as a dry run's."""
    store = SQLiteStore(tmp_path / "data")
    try:
        store.record_suggestion(REPO, 7, "35994", 0.9, "comment", "body", "{}")
        [row] = store.suggestions(REPO)
        comments = store.comments_on(REPO, [row.issue])
        assert suggestion_state(row, comments.get(row.issue), []) == "dry run (not posted)"
    finally:
        store.close()
