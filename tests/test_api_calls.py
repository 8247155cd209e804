"""What an answered issue costs of the installation's API budget, counted by the fake GitHub
and by the bot's own metric (``dejafix_github_calls_per_delivery``), per kind of delivery:
opened and matched, opened and silent, edited, a comment command; a repository warm (its
token, config and templates cached) and cold."""

from __future__ import annotations

import asyncio

from bot.settings import ServiceConfig
from bot.web.app import METRICS, SERVICES
from tests.conftest import REPO, SAMPLE_CLUSTERS, BotFactory, BotUnderTest, issue_payload
from tests.samples import RESET_HANG, UNRELATED


def calls(bot: BotUnderTest, since: int) -> list[tuple[str, str]]:
    return [(r.method, r.path) for r in bot.github.requests[since:]]


async def answer(bot: BotUnderTest, number: int, fields: dict[str, str],
                 action: str = "opened", **extra: object) -> list[tuple[str, str]]:
    before = len(bot.github.requests)
    resp = await bot.deliver("issues", issue_payload(action, number=number, **fields, **extra))
    assert resp.status == 202
    await bot.settle()
    return calls(bot, before)


def per_delivery(bot: BotUnderTest, kind: str) -> tuple[float, float]:
    """(deliveries, calls) of ``kind`` from the bot's own histogram."""
    registry = bot.app[METRICS].registry
    count = registry.get_sample_value("dejafix_github_calls_per_delivery_count", {"kind": kind})
    total = registry.get_sample_value("dejafix_github_calls_per_delivery_sum", {"kind": kind})
    return count or 0.0, total or 0.0


async def test_a_warm_repository_costs_one_call_per_matched_issue_and_none_per_silent(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    cold = await answer(bot, 1, RESET_HANG)
    # Cold: the installation token; the config and the issue templates in one GraphQL call;
    # the repository has no config of its own, so its owner's .github fallback; the comment.
    # A newly opened issue is not searched for an earlier comment of ours, and its text names
    # no version, so no releases are read.
    assert cold == [
        ("POST", "/app/installations/77/access_tokens"),
        ("POST", "/graphql"),
        ("GET", "/repos/NousResearch/.github/contents/.github/dejafix.yml"),
        ("POST", f"/repos/{REPO}/issues/1/comments"),
    ]
    assert await answer(bot, 2, RESET_HANG) == [("POST", f"/repos/{REPO}/issues/2/comments")]
    assert await answer(bot, 3, UNRELATED) == []
    assert per_delivery(bot, "opened_matched") == (2.0, 5.0)
    assert per_delivery(bot, "opened_silent") == (1.0, 0.0)


async def test_without_graphql_a_cold_repository_reads_its_files_over_rest(
        make_bot: BotFactory) -> None:
    bot = await make_bot()
    bot.github.graphql_files_off = True  # as a GitHub Enterprise that does not answer it
    cold = await answer(bot, 1, RESET_HANG)
    assert cold[0] == ("POST", "/app/installations/77/access_tokens")
    assert sorted(cold[2:5]) == [
        ("GET", "/repos/NousResearch/.github/contents/.github/dejafix.yml"),
        ("GET", f"/repos/{REPO}/contents/.github/ISSUE_TEMPLATE"),
        ("GET", f"/repos/{REPO}/contents/.github/dejafix.yml"),
    ]
    assert cold[5:] == [("POST", f"/repos/{REPO}/issues/1/comments")]


async def test_a_repository_s_templates_and_config_come_in_one_call(
        make_bot: BotFactory) -> None:
    """Three templates and a config file: one GraphQL call reads them all (over REST, the
    folder and each file take one each), and the config it read is the one applied."""
    bot = await make_bot()
    for name in ("bug.md", "feature.yml", "question.md"):
        bot.github.add_file(REPO, f".github/ISSUE_TEMPLATE/{name}",
                            "### What happened?\n\n### Steps to reproduce\n")
    # Not a template: left out of what the templates teach.
    bot.github.add_file(REPO, ".github/ISSUE_TEMPLATE/screenshot.png", "PNG pixels here\n")
    bot.github.add_file(REPO, ".github/dejafix.yml", "label: known-fix-seen\n")
    cold = await answer(bot, 1, RESET_HANG)
    assert cold[:2] == [("POST", "/app/installations/77/access_tokens"), ("POST", "/graphql")]
    assert ("POST", f"/repos/{REPO}/issues/1/labels") in cold
    assert not [c for c in cold if "/contents/" in c[1]]
    services = bot.app[SERVICES]
    boilerplate = services.boilerplates[REPO.lower()]
    assert boilerplate.lines  # learned from the templates GraphQL returned
    not_template = "PNG pixels here"
    assert boilerplate.strip(not_template) == not_template


async def test_an_edit_and_a_command_are_counted_by_kind(make_bot: BotFactory) -> None:
    bot = await make_bot()
    await answer(bot, 1, RESET_HANG)
    # An edit that changes nothing the comment says: the ledger has the comment, no call.
    edited = await answer(bot, 1, {**RESET_HANG, "body": RESET_HANG["body"] + "\nthanks"},
                          "edited", changes={"body": {"from": RESET_HANG["body"]}})
    assert edited == []
    assert per_delivery(bot, "edited") == (1.0, 0.0)
    before = len(bot.github.requests)
    payload = issue_payload(number=1, **RESET_HANG)
    payload.update(action="created", comment={"id": 9, "body": "/dejafix not-this",
                                              "user": {"login": "reporter", "type": "User"}})
    resp = await bot.deliver("issue_comment", payload)
    assert resp.status == 202
    await bot.settle()
    made = calls(bot, before)
    assert made and all(path.startswith(f"/repos/{REPO}/") for _, path in made)
    assert per_delivery(bot, "comment_command") == (1.0, float(len(made)))


async def test_a_config_read_again_after_its_cache_time_is_a_304(
        make_bot: BotFactory) -> None:
    bot = await make_bot(config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)],
                                              repo_config_ttl=0.05))
    bot.github.add_file(REPO, ".github/dejafix.yml", "label: known-fix\n")
    # Cold, the file comes with the templates over GraphQL, which gives no ETag: the first
    # read after the cache time is a whole one (and keeps its ETag), the next a 304.
    await answer(bot, 1, RESET_HANG)
    await asyncio.sleep(0.1)  # past the cache time
    await answer(bot, 2, RESET_HANG)
    await asyncio.sleep(0.1)
    again = await answer(bot, 3, RESET_HANG)
    config_reads = [r for r in bot.github.requests
                    if r.path == f"/repos/{REPO}/contents/.github/dejafix.yml"]
    assert len(config_reads) == 2
    assert config_reads[1].headers.get("If-None-Match")  # asked conditionally
    assert ("GET", f"/repos/{REPO}/contents/.github/dejafix.yml") in again
    registry = bot.app[METRICS].registry
    assert registry.get_sample_value("dejafix_github_not_modified_total",
                                     {"kind": "opened_matched"}) == 1.0


async def test_an_owners_fallback_config_is_read_once_for_its_repositories(
        make_bot: BotFactory) -> None:
    # Two repositories of one owner, neither with a file of its own: the owner's .github
    # config is read for the first and reused for the second (within the cache time).
    bot = await make_bot()
    bot.github.add_org_file("NousResearch", ".github/dejafix.yml", "label: known-fix\n")
    await answer(bot, 1, UNRELATED)
    await answer(bot, 2, UNRELATED, repo="NousResearch/other-repo")
    org_reads = [r for r in bot.github.requests
                 if r.path == "/repos/NousResearch/.github/contents/.github/dejafix.yml"]
    # Each repository's own file was looked for (with its templates, one GraphQL call each).
    own_reads = sorted(r.body["variables"]["name"] for r in bot.github.requests
                       if r.path == "/graphql")
    assert len(org_reads) == 1
    assert own_reads == ["hermes-agent", "other-repo"]
    # A push to the owner's .github drops it for every repository (the config check's job).
    bot.app[SERVICES].forget_repo_config("NousResearch/.github")
    await answer(bot, 3, UNRELATED)
    assert len([r for r in bot.github.requests if r.path == org_reads[0].path]) == 2
