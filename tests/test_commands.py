"""Commands in issue comments and the guardrails, end to end: signed deliveries into the running
bot, GitHub faked on loopback, assertions on the exact requests the bot made."""

from __future__ import annotations

from typing import Any

import pytest

import bot.features
import bot.jobs.dispatch
from bot.features import commands
from bot.features.commands import parse_commands
from bot.features.guardrails import PAUSE_TITLE
from bot.render.comment import MARKER
from bot.web.app import SERVICES
from tests.conftest import REPO, BotFactory, BotUnderTest, issue_payload
from tests.samples import AUTHOR, INTERRUPT_LEAK, RESET_HANG, UNRELATED, comment_payload

COMMENTS = f"/repos/{REPO}/issues/90001/comments"
MAINTAINER = "maint"
STRANGER = "passer-by"


def test_the_commands_router_is_registered() -> None:
    assert commands.router in bot.features.ROUTERS
    assert bot.jobs.dispatch.wants("issue_comment", {"action": "created"})



async def make(make_bot: BotFactory, config: str | None = None) -> BotUnderTest:
    bot = await make_bot()
    bot.github.set_role(REPO, MAINTAINER, "triage")
    if config is not None:
        bot.github.add_file(REPO, ".github/dejafix.yml", config)
    return bot


async def say(bot: BotUnderTest, body: str, **kwargs: Any) -> None:
    await bot.deliver("issue_comment", comment_payload(body, **kwargs))
    await bot.settle()


async def open_issue(bot: BotUnderTest, number: int = 90001,
                     text: dict[str, str] | None = None) -> None:
    await bot.deliver("issues", issue_payload(**(text or RESET_HANG), number=number))
    await bot.settle()


def replies(bot: BotUnderTest, number: int = 90001) -> list[str]:
    return [r.body["body"] for r in bot.github.calls("POST", f"/issues/{number}/comments")
            if MARKER not in r.body["body"]]


def failed(bot: BotUnderTest) -> int:
    return int(bot.app[SERVICES].store.failed_count())


# -- parsing ----------------------------------------------------------------------------------

def test_commands_in_quotes_code_and_html_comments_do_not_count() -> None:
    body = "\n".join([
        "> /dejafix not-this",
        "```",
        "/dejafix recheck",
        "```",
        "~~~~text",
        "/dejafix resume",
        "~~~~",
        "`/dejafix same-as #1`",
        "<!-- /dejafix help -->",
        "    /dejafix indented-code",
        "see /dejafix mid-line",
        "/dejafix not-this",
        "/DEJAFIX  same-as  #35994  please",
        "/dejafix",
        "/dejafixes nothing",
    ])
    found = parse_commands(body)
    assert [(c.name, c.args) for c in found] == [
        ("not-this", []), ("same-as", ["#35994", "please"]), ("help", [])]


def test_an_unclosed_fence_hides_the_rest() -> None:
    assert parse_commands("```\n/dejafix not-this\n") == []
    assert [c.name for c in parse_commands("```py\nx\n```\n/dejafix help")] == ["help"]


def test_a_command_after_a_long_quote_is_read_up_to_githubs_limit() -> None:
    # GitHub keeps comments to 65,536 characters, so a command after a long quoted block is
    # still read; nothing beyond that length is, whoever sent it.
    quote = "> " + "x" * 60000 + "\n"
    assert [c.name for c in parse_commands(quote + "/dejafix recheck")] == ["recheck"]
    assert parse_commands("x" * commands.MAX_BODY_CHARS + "\n/dejafix recheck") == []


def test_a_line_of_backticks_does_not_hide_or_stall_a_command() -> None:
    # The reported body: one run of backticks as long as GitHub allows, after a command.
    assert [c.name for c in parse_commands("/dejafix help\n" + "`" * 65536)] == ["help"]
    assert [c.name for c in parse_commands("a `` /dejafix x ` ``\n/dejafix help")] == ["help"]


# -- not-this ---------------------------------------------------------------------------------

async def test_not_this_by_the_author_dismisses_and_it_is_never_suggested_again(
        make_bot: BotFactory) -> None:
    bot = await make(make_bot, "label: known-fix\n")
    await open_issue(bot)
    posted = bot.github.calls("POST", COMMENTS)
    assert len(posted) == 1 and "#52090" in posted[0].body["body"]

    await say(bot, "Thanks, but no.\n/dejafix not-this")
    patches = bot.github.calls("PATCH", "/issues/comments/")
    assert len(patches) == 1
    edited = patches[0].body["body"]
    assert edited.startswith(MARKER) and "dismissed" in edited.lower()
    assert "#52090" in edited  # the link stays for the record
    assert [r.path for r in bot.github.calls("DELETE")] == [
        f"/repos/{REPO}/issues/90001/labels/known-fix"]
    assert replies(bot) == []  # answered by the edit
    store = bot.app[SERVICES].store
    assert store.feedback_for(REPO, 90001) == {"35994": "dismissed"}

    # Redelivered, edited, reopened: the dismissed cluster is not offered again.
    before = len(bot.github.writes())
    await bot.deliver("issues", issue_payload(**RESET_HANG), delivery="again")
    await bot.deliver("issues", issue_payload("edited", **RESET_HANG,
                                              changes={"body": {"from": "x"}}))
    await bot.deliver("issues", issue_payload("reopened", **RESET_HANG))
    await bot.settle()
    assert len(bot.github.writes()) == before
    assert "dismissed" in bot.github.comments[(REPO.lower(), 90001)][0]["body"].lower()
    assert failed(bot) == 0


async def test_not_this_by_a_triager_works_and_by_a_stranger_is_refused(
        make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await open_issue(bot)
    await say(bot, "/dejafix not-this", login=STRANGER)
    assert bot.github.calls("PATCH") == []
    assert len(replies(bot)) == 1 and "Sorry" in replies(bot)[0]
    assert bot.app[SERVICES].store.feedback_for(REPO, 90001) == {}
    # The permission was asked of GitHub for the stranger.
    assert bot.github.calls("GET", f"/collaborators/{STRANGER}/permission")

    await say(bot, "/dejafix not-this", login=MAINTAINER)
    assert len(bot.github.calls("PATCH")) == 1
    assert bot.app[SERVICES].store.feedback_for(REPO, 90001) == {"35994": "dismissed"}


async def test_read_role_is_not_triage_even_if_the_legacy_field_says_read(
        make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    bot.github.set_role(REPO, "reader", "read")
    bot.github.set_role(REPO, "boss", "maintain")
    await open_issue(bot)
    await say(bot, "/dejafix not-this", login="reader")
    assert bot.github.calls("PATCH") == []
    await say(bot, "/dejafix not-this", login="boss")
    assert len(bot.github.calls("PATCH")) == 1


@pytest.mark.parametrize("body", [
    "> /dejafix not-this",
    "```\n/dejafix not-this\n```",
    "`/dejafix not-this`",
    "I would not write /dejafix not-this here",
])
async def test_quoted_or_code_commands_do_nothing(make_bot: BotFactory, body: str) -> None:
    bot = await make(make_bot)
    await open_issue(bot)
    writes = len(bot.github.writes())
    for login in (AUTHOR, STRANGER, MAINTAINER):
        await say(bot, body, login=login)
    assert len(bot.github.writes()) == writes
    assert bot.github.calls("GET", "/permission") == []


async def test_bots_cannot_command(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await open_issue(bot)
    writes = len(bot.github.writes())
    await say(bot, "/dejafix not-this", login="dejafix-test[bot]", user_type="Bot")
    await say(bot, "/dejafix help", login="other-bot[bot]", user_type="Bot")
    await say(bot, "/dejafix help", login="legacy-ci", user_type="Bot")
    assert len(bot.github.writes()) == writes
    # Control: the same comment from a person is answered.
    await say(bot, "/dejafix help", login=STRANGER)
    assert len(bot.github.writes()) == writes + 1


async def test_not_this_without_a_suggestion_gets_a_reply(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await open_issue(bot, text=UNRELATED)
    await say(bot, "/dejafix not-this")
    assert len(replies(bot)) == 1 and "no Dejafix suggestion" in replies(bot)[0]


async def test_missing_label_on_dismissal_is_fine(make_bot: BotFactory) -> None:
    bot = await make(make_bot, "label: known-fix\n")
    await open_issue(bot)
    bot.github.issue_labels[(REPO.lower(), 90001)] = []  # someone already took it off
    await say(bot, "/dejafix not-this")
    deletes = bot.github.calls("DELETE")
    assert len(deletes) == 1
    assert failed(bot) == 0 and bot.app[SERVICES].store.pending_count() == 0
    assert bot.app[SERVICES].store.feedback_for(REPO, 90001) == {"35994": "dismissed"}


# -- same-as ----------------------------------------------------------------------------------

async def test_same_as_by_a_triager_adds_the_issue_to_the_cluster(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await open_issue(bot, text=UNRELATED)
    assert bot.github.calls("POST", COMMENTS) == []
    services = bot.app[SERVICES]
    assert services.store.find_learned(REPO, "issue", 90001) is None

    await say(bot, "/dejafix same-as #52090", login=MAINTAINER)  # the fix PR names the bug
    learned = services.store.find_learned(REPO, "issue", 90001)
    assert learned is not None and learned.public_id == "35994"
    index = await services.index.view([REPO])
    indexed = [c for c in index.clusters(REPO) if c.public_id == "35994"]
    assert any(m.number == 90001 for m in indexed[0].members)
    posts = bot.github.calls("POST", COMMENTS)
    assert len(posts) == 1 and posts[0].body["body"].startswith(MARKER)
    assert "Confirmed" in posts[0].body["body"] and "#52090" in posts[0].body["body"]

    # The matcher does not overwrite a maintainer's word on a later edit.
    await bot.deliver("issues", issue_payload("edited", **INTERRUPT_LEAK,
                                              changes={"title": {"from": "x"}}))
    await bot.settle()
    assert bot.github.calls("PATCH") == [] and len(bot.github.calls("POST", COMMENTS)) == 1


async def test_same_as_edits_an_existing_suggestion(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await open_issue(bot)
    await say(bot, "/dejafix same-as #35994", login=MAINTAINER)
    patches = bot.github.calls("PATCH")
    assert len(patches) == 1 and "Confirmed" in patches[0].body["body"]
    assert len(bot.github.calls("POST", COMMENTS)) == 1


async def test_same_as_by_the_author_or_a_stranger_is_refused(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await open_issue(bot, text=UNRELATED)
    await say(bot, "/dejafix same-as #35994", login=AUTHOR)
    await say(bot, "/dejafix same-as #35994", login=STRANGER)
    assert [("Sorry" in r) for r in replies(bot)] == [True, True]
    assert bot.app[SERVICES].store.find_learned(REPO, "issue", 90001) is None


async def test_same_as_unknown_target_gets_a_reply(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await open_issue(bot, text=UNRELATED)
    await say(bot, "/dejafix same-as #424242", login=MAINTAINER)
    await say(bot, "/dejafix same-as", login=MAINTAINER)
    texts = replies(bot)
    assert len(texts) == 2 and "knows no bug" in texts[0] and "Usage" in texts[1]
    assert bot.app[SERVICES].store.learned_clusters(REPO) == []


# -- recheck, help, unknown -------------------------------------------------------------------

async def test_recheck_matches_the_issue_as_it_is_now(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await open_issue(bot, text=UNRELATED)
    assert bot.github.calls("POST", COMMENTS) == []
    # The reporter rewrote the issue (and the edit's delivery was lost).
    bot.github.add_issue(REPO, issue_payload(**RESET_HANG)["issue"])

    await say(bot, "/dejafix recheck", login=STRANGER)
    assert bot.github.calls("GET", f"/repos/{REPO}/issues/90001") == []
    assert len(replies(bot)) == 1 and "Sorry" in replies(bot)[0]

    await say(bot, "/dejafix recheck", login=AUTHOR)
    posts = [p for p in bot.github.calls("POST", COMMENTS) if MARKER in p.body["body"]]
    assert len(posts) == 1 and "#52090" in posts[0].body["body"]

    await say(bot, "/dejafix recheck", login=MAINTAINER)  # nothing changed since
    assert "still stands" in replies(bot)[-1]


async def test_help_is_for_anyone_and_quoted_help_is_ignored(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await say(bot, "> /dejafix help", login=STRANGER)
    assert replies(bot) == []
    await say(bot, "/dejafix help", login=STRANGER)
    assert len(replies(bot)) == 1
    text = replies(bot)[0]
    for name in ("not-this", "same-as", "recheck", "resume", "help"):
        assert f"/dejafix {name}" in text


async def test_unknown_command_gets_one_inert_reply(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await say(bot, "/dejafix frobnicate @everyone <img src=x>", login=STRANGER)
    texts = replies(bot)
    assert len(texts) == 1
    assert "`/dejafix frobnicate @everyone <img src=x>`" in texts[0]
    assert "@everyone" not in texts[0].replace("`/dejafix frobnicate @everyone <img src=x>`", "")
    assert failed(bot) == 0


async def test_commands_on_a_pull_request_get_a_reply(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    pr = {"pull_request": {"url": "https://api.github.com/repos/x/y/pulls/1"}}
    payload = comment_payload("/dejafix not-this", login=MAINTAINER)
    payload["issue"].update(pr)
    await bot.deliver("issue_comment", payload)
    await bot.settle()
    assert len(replies(bot)) == 1 and "not pull requests" in replies(bot)[0]
    assert bot.github.calls("PATCH") == []


# -- guardrails -------------------------------------------------------------------------------

async def test_daily_cap_stops_new_comments(make_bot: BotFactory) -> None:
    bot = await make(make_bot, "max_comments_per_day: 1\n")
    await open_issue(bot, 90001)
    await open_issue(bot, 90002, INTERRUPT_LEAK)
    assert len(bot.github.calls("POST", "/issues/90001/comments")) == 1
    assert bot.github.calls("POST", "/issues/90002/comments") == []

    bot.github.add_file(REPO, ".github/dejafix.yml", "max_comments_per_day: 2\n")
    bot.app[SERVICES].repo_configs.clear()
    await open_issue(bot, 90003, INTERRUPT_LEAK)
    assert len(bot.github.calls("POST", "/issues/90003/comments")) == 1


async def test_too_many_dismissals_pause_once_and_resume_lifts_it(make_bot: BotFactory) -> None:
    bot = await make(make_bot, "pause_window: 2\npause_dismissal_rate: 0.3\n")
    store = bot.app[SERVICES].store
    await open_issue(bot, 90001)
    await open_issue(bot, 90002, INTERRUPT_LEAK)
    await say(bot, "/dejafix not-this", number=90001)  # 1 of 2 dismissed: over 30%
    pause = store.get_pause(REPO)
    assert pause is not None and pause.paused
    opened = bot.github.calls("POST", f"/repos/{REPO}/issues")
    opened = [r for r in opened if r.path == f"/repos/{REPO}/issues"]
    assert len(opened) == 1 and opened[0].body["title"] == PAUSE_TITLE
    assert "/dejafix resume" in opened[0].body["body"]
    announced = pause.issue
    assert announced is not None

    await say(bot, "/dejafix not-this", number=90002)  # still paused: not announced again
    assert len([r for r in bot.github.calls("POST") if r.path == f"/repos/{REPO}/issues"]) == 1

    await open_issue(bot, 90003)  # paused: no new comments
    assert bot.github.calls("POST", "/issues/90003/comments") == []

    bot_author = {"login": "dejafix-test[bot]"}
    await say(bot, "/dejafix resume", number=announced, login=STRANGER, author=bot_author["login"])
    await say(bot, "/dejafix resume", number=90003, login=MAINTAINER)  # not where announced
    texts = replies(bot, announced) + replies(bot, 90003)
    assert "Sorry" in texts[0] and f"#{announced}" in texts[1]
    assert store.get_pause(REPO).paused  # type: ignore[union-attr]

    await say(bot, "/dejafix resume", number=announced, login=MAINTAINER,
              author=bot_author["login"])
    assert "Resumed" in replies(bot, announced)[-1]
    assert not store.get_pause(REPO).paused  # type: ignore[union-attr]
    await open_issue(bot, 90004)
    assert len(bot.github.calls("POST", "/issues/90004/comments")) == 1


async def test_a_config_change_lifts_the_pause(make_bot: BotFactory) -> None:
    bot = await make(make_bot, "pause_window: 1\npause_issue: false\n")
    store = bot.app[SERVICES].store
    await open_issue(bot, 90001)
    await say(bot, "/dejafix not-this", number=90001)
    assert store.get_pause(REPO) is not None and store.get_pause(REPO).paused  # type: ignore
    # pause_issue: false: paused, but no issue opened.
    assert [r for r in bot.github.calls("POST") if r.path == f"/repos/{REPO}/issues"] == []
    await open_issue(bot, 90002, INTERRUPT_LEAK)
    assert bot.github.calls("POST", "/issues/90002/comments") == []

    bot.github.add_file(REPO, ".github/dejafix.yml",
                        "pause_window: 1\npause_issue: false\nthreshold: 0.6\n")
    bot.app[SERVICES].repo_configs.clear()
    await open_issue(bot, 90003, INTERRUPT_LEAK)
    assert len(bot.github.calls("POST", "/issues/90003/comments")) == 1
    assert not store.get_pause(REPO).paused  # type: ignore[union-attr]


async def test_few_dismissals_under_the_window_do_not_pause(make_bot: BotFactory) -> None:
    bot = await make(make_bot, "pause_window: 3\n")
    await open_issue(bot, 90001)
    await open_issue(bot, 90002, INTERRUPT_LEAK)
    await say(bot, "/dejafix not-this", number=90001)  # 1 of 2: fewer than the window
    assert bot.app[SERVICES].store.get_pause(REPO) is None
    await open_issue(bot, 90003)
    assert len(bot.github.calls("POST", "/issues/90003/comments")) == 1


async def test_resume_when_not_paused_gets_a_reply(make_bot: BotFactory) -> None:
    bot = await make(make_bot)
    await say(bot, "/dejafix resume", login=MAINTAINER)
    await say(bot, "/dejafix resume", login=AUTHOR)
    texts = replies(bot)
    assert len(texts) == 2 and "not paused" in texts[0] and "Sorry" in texts[1]
