"""Our one comment, written through ``comment_writer``: against the fake GitHub on loopback and
the bot's real SQLite store, with assertions on the exact requests made and the ledger rows
left behind."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import gidgethub
import pytest

from bot.features import guardrails
from bot.features.comment_writer import OwnComment, Written, find_own_comment, write_comment
from bot.features.context import Context
from bot.github.client import DryRunRepoClient, RepoClient
from bot.render.comment import MARKER, body_hash
from bot.repo_config import RepoConfig
from bot.settings import ServiceConfig
from bot.web.app import SERVICES, WORKER
from tests.conftest import REPO, BotFactory, BotUnderTest, issue_payload
from tests.samples import LEARN_REPO as LEARNING_REPO
from tests.samples import NEW_REPORT, merged_pr, seed_history

NUMBER = 7
COMMENTS = f"/repos/{REPO}/issues/{NUMBER}/comments"
EDITS = f"/repos/{REPO}/issues/comments/"
BODY = f"{MARKER}\nThis looks like the bug fixed in #52090."
OTHER = f"{MARKER}\nThis looks like the bug fixed in #35382."
OURS = {"login": "dejafix-test[bot]", "type": "Bot"}


async def context(bot: BotUnderTest, *, action: str = "edited", attempt: int = 1) -> Context:
    """A delivery's context on ``REPO``, as the worker makes it (a dry run's client writes
    nothing)."""
    services = bot.app[SERVICES]
    gh = await services.github.for_installation(77)
    client = (DryRunRepoClient if services.dry_run else RepoClient)(gh, REPO)
    return Context(delivery_id="d-writer", repo_name=REPO, repo=client, services=services,
                   payload={"action": action, "installation": {"id": 77}}, attempt=attempt)


async def write(ctx: Context, body: str = BODY, number: int = NUMBER, *,
                found: OwnComment | None = None, always_edit: bool = False,
                repost_when_gone: bool = True,
                reserve: Callable[[], Awaitable[bool]] | None = None,
                log: logging.Logger | None = None) -> Written:
    """``write_comment`` for cluster 35994 at 0.81."""
    return await write_comment(ctx, number, body, cluster="35994", score=0.81, found=found,
                               always_edit=always_edit, repost_when_gone=repost_when_gone,
                               reserve=reserve,
                               log=log or logging.getLogger("dejafix.comments"))


def refusing(asked: list[int]) -> Callable[[], Awaitable[bool]]:
    async def reserve() -> bool:
        asked.append(1)
        return False

    return reserve


def seen(bot: BotUnderTest) -> int:
    """Requests so far, tokens excluded (minted when the test's client is made)."""
    return len([r for r in bot.github.requests if "/access_tokens" not in r.path])


# -- posting ----------------------------------------------------------------------------------

async def test_posts_when_there_is_none_and_records_it(make_bot: BotFactory) -> None:
    bot = await make_bot()
    ctx = await context(bot, action="opened")
    written = await write(ctx)
    posts = bot.github.calls("POST", COMMENTS)
    assert len(posts) == 1 and posts[0].body == {"body": BODY}
    assert written == Written("commented", bot.github.comments[(REPO.lower(), NUMBER)][0]["id"],
                              recorded=True)
    # An issue opened this moment (first attempt) holds nothing of ours: not looked for.
    assert bot.github.calls("GET", COMMENTS) == []
    row = bot.app[SERVICES].store.get_comment(REPO, NUMBER)
    assert row is not None
    assert (row.comment_id, row.cluster, row.score, row.body_hash) == \
        (written.comment_id, "35994", 0.81, body_hash(BODY))


async def test_a_lost_ledger_row_is_found_by_the_marker_of_our_own_comment(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.comments[(REPO.lower(), NUMBER)] = [
        {"id": 9, "body": "> " + MARKER, "user": {"login": "github-actions[bot]", "type": "Bot"}},
        {"id": 10, "body": MARKER + "\nquoted", "user": {"login": "someone", "type": "User"}},
        {"id": 4444, "body": MARKER + "\nold text", "user": OURS},
    ]
    # A retry of an opened issue looks (the crash between posting and the ledger is behind it).
    ctx = await context(bot, action="opened", attempt=2)
    assert await find_own_comment(ctx, NUMBER) == OwnComment(4444)
    written = await write(ctx)
    assert written == Written("edited", 4444, recorded=True)
    assert [r.path for r in bot.github.writes()] == [f"{EDITS}4444"]
    row = bot.app[SERVICES].store.get_comment(REPO, NUMBER)
    assert row is not None and (row.comment_id, row.body_hash) == (4444, body_hash(BODY))


# -- editing ----------------------------------------------------------------------------------

async def test_edits_when_the_body_differs_and_never_asks_the_reserve(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    ctx = await context(bot)
    first = await write(ctx)
    asked: list[int] = []
    written = await write(ctx, OTHER, reserve=refusing(asked))
    assert written == Written("edited", first.comment_id, recorded=True)
    assert asked == []  # an edit is no new comment: the daily cap does not apply
    patches = bot.github.calls("PATCH")
    assert [(p.path, p.body) for p in patches] == [(f"{EDITS}{first.comment_id}",
                                                    {"body": OTHER})]
    assert len(bot.github.calls("POST", COMMENTS)) == 1
    assert bot.github.comments[(REPO.lower(), NUMBER)][0]["body"] == OTHER
    row = bot.app[SERVICES].store.get_comment(REPO, NUMBER)
    assert row is not None and row.body_hash == body_hash(OTHER)


async def test_no_call_when_the_ledger_says_it_reads_so_unless_always_edit(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    ctx = await context(bot)
    first = await write(ctx)
    before = seen(bot)
    assert await write(ctx) == Written("unchanged", first.comment_id)
    assert seen(bot) == before

    # The commands edit anyway.
    assert await write(ctx, always_edit=True) == Written("edited", first.comment_id, True)
    assert [p.path for p in bot.github.calls("PATCH")] == [f"{EDITS}{first.comment_id}"]


async def test_a_comment_found_already_is_not_looked_up_again(make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.comments[(REPO.lower(), NUMBER)] = [
        {"id": 4444, "body": MARKER + "\nold text", "user": OURS}]
    ctx = await context(bot)
    written = await write(ctx, found=OwnComment(4444))
    assert written == Written("edited", 4444, recorded=True)
    assert bot.github.calls("GET", COMMENTS) == []


# -- a deleted comment ------------------------------------------------------------------------

async def test_a_deleted_comment_is_posted_anew(make_bot: BotFactory,
                                                caplog: pytest.LogCaptureFixture) -> None:
    bot = await make_bot()
    ctx = await context(bot)
    first = await write(ctx)
    bot.github.comments.clear()  # a maintainer deleted it
    with caplog.at_level(logging.INFO, logger="dejafix.test"):
        written = await write(ctx, OTHER, log=logging.getLogger("dejafix.test"))
    assert written.action == "commented" and written.recorded
    assert written.comment_id not in (None, first.comment_id)
    assert len(bot.github.calls("PATCH")) == 1  # tried, got 404
    posts = bot.github.calls("POST", COMMENTS)
    assert [p.body for p in posts] == [{"body": BODY}, {"body": OTHER}]
    row = bot.app[SERVICES].store.get_comment(REPO, NUMBER)
    assert row is not None and (row.comment_id, row.body_hash) == \
        (written.comment_id, body_hash(OTHER))
    # Said on the caller's logger, with the delivery.
    said = [r.getMessage() for r in caplog.records if r.name == "dejafix.test"]
    assert said == [f"delivery d-writer: {REPO}#{NUMBER} comment {first.comment_id} is gone, "
                    "posting anew"]


async def test_a_deleted_comment_is_left_deleted_when_asked(make_bot: BotFactory) -> None:
    bot = await make_bot()
    ctx = await context(bot)
    first = await write(ctx)
    bot.github.comments.clear()
    written = await write(ctx, OTHER, repost_when_gone=False)
    assert written == Written("gone")
    assert len(bot.github.calls("PATCH")) == 1
    assert len(bot.github.calls("POST", COMMENTS)) == 1  # the first one only
    row = bot.app[SERVICES].store.get_comment(REPO, NUMBER)
    assert row is not None and (row.comment_id, row.body_hash) == \
        (first.comment_id, body_hash(BODY))


async def test_another_refused_edit_raises_and_posts_nothing(make_bot: BotFactory) -> None:
    bot = await make_bot()
    ctx = await context(bot)
    first = await write(ctx)
    bot.github.failures[f"PATCH {EDITS}"] = [422]
    with pytest.raises(gidgethub.BadRequest) as raised:
        await write(ctx, OTHER)
    assert raised.value.status_code == 422
    assert len(bot.github.calls("POST", COMMENTS)) == 1
    row = bot.app[SERVICES].store.get_comment(REPO, NUMBER)
    assert row is not None and (row.comment_id, row.body_hash) == \
        (first.comment_id, body_hash(BODY))


# -- dry run ----------------------------------------------------------------------------------

async def test_a_dry_run_posts_nothing_and_writes_no_ledger_row(make_bot: BotFactory) -> None:
    bot = await make_bot(dry_run=True)
    ctx = await context(bot, action="opened")
    assert await write(ctx) == Written("commented", 0, recorded=False)
    # An earlier live run's comment, found by its marker: "edited", yet nothing sent.
    bot.github.comments[(REPO.lower(), NUMBER + 1)] = [
        {"id": 4444, "body": MARKER + "\nold text", "user": OURS}]
    edited = await write(await context(bot), number=NUMBER + 1)
    assert edited == Written("edited", 4444, recorded=False)
    assert bot.github.writes() == []
    store = bot.app[SERVICES].store
    assert store.get_comment(REPO, NUMBER) is None
    assert store.get_comment(REPO, NUMBER + 1) is None
    assert store.comments_in_last(REPO, 3600) == 0


# -- the daily cap ----------------------------------------------------------------------------

async def test_a_refusing_reserve_posts_nothing(make_bot: BotFactory) -> None:
    bot = await make_bot()
    ctx = await context(bot)
    asked: list[int] = []
    assert await write(ctx, reserve=refusing(asked)) == Written("capped")
    assert asked == [1]
    assert bot.github.writes() == []
    assert bot.app[SERVICES].store.get_comment(REPO, NUMBER) is None


async def test_the_reserve_is_asked_before_posting_anew_after_a_404(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    ctx = await context(bot)
    await write(ctx)
    bot.github.comments.clear()
    asked: list[int] = []
    assert await write(ctx, OTHER, reserve=refusing(asked)) == Written("capped")
    assert asked == [1]
    assert len(bot.github.calls("POST", COMMENTS)) == 1


async def test_the_daily_cap_through_the_guardrail(make_bot: BotFactory) -> None:
    bot = await make_bot()
    ctx = await context(bot)
    config = RepoConfig(max_comments_per_day=1)

    def cap(number: int) -> Callable[[], Awaitable[bool]]:
        return lambda: guardrails.reserve_comment(ctx, config, number)

    assert (await write(ctx, reserve=cap(NUMBER))).action == "commented"
    assert await write(ctx, number=NUMBER + 1, reserve=cap(NUMBER + 1)) == Written("capped")
    # The issue that has its comment is edited: the cap counts new comments only.
    assert (await write(ctx, OTHER, reserve=cap(NUMBER))).action == "edited"
    assert [r.path for r in bot.github.writes() if r.method == "POST"] == [COMMENTS]


# -- a caller: the correction after a revert ---------------------------------------------------

async def test_a_revert_skips_a_deleted_comment_and_corrects_the_others(
        make_bot: BotFactory, tmp_path: Path) -> None:
    folder = tmp_path / "no-clusters"
    folder.mkdir()
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(folder)], cluster_reload=0))
    # Were the deleted comment's 404 to fail the delivery, its retries end fast.
    bot.app[WORKER].retry_base = 0.0
    seed_history(bot.github)
    await bot.deliver("pull_request", merged_pr())
    await bot.settle()
    for number in (12, 13):
        await bot.deliver("issues", issue_payload(**NEW_REPORT, repo=LEARNING_REPO,
                                                  number=number))
    await bot.settle()
    ids = {n: bot.github.comments[(LEARNING_REPO, n)][0]["id"] for n in (12, 13)}
    del bot.github.comments[(LEARNING_REPO, 12)]  # a maintainer deleted the first

    await bot.deliver("pull_request", merged_pr(
        60, title='Revert "fix(exporter): bound flush_queue with a timeout"',
        body=f"Reverts {LEARNING_REPO}#50"))
    await bot.settle()
    # Issue 12's edit got its 404 (and nothing was posted in its place); 13 was corrected.
    patches = bot.github.calls("PATCH")
    assert [p.path.rsplit("/", 1)[-1] for p in patches] == [str(ids[12]), str(ids[13])]
    assert (LEARNING_REPO, 12) not in bot.github.comments
    assert "was reverted by #60" in bot.github.comments[(LEARNING_REPO, 13)][0]["body"]
    store = bot.app[SERVICES].store
    assert store.failed_count() == 0
    row = store.get_comment(LEARNING_REPO, 13)
    assert row is not None and row.body_hash == \
        body_hash(bot.github.comments[(LEARNING_REPO, 13)][0]["body"])
