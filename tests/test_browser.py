"""The web page in a real browser: headless Chromium (Debian's package) driven by Playwright,
against the running bot and the fake GitHub (which signs the user in at its OAuth page and
answers their permission). A failing test leaves a screenshot under its temporary directory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bot.settings import ServiceConfig
from bot.web.app import SERVICES
from tests.conftest import REPO, SAMPLE_CLUSTERS, BotFactory, BotUnderTest, issue_payload

playwright_api = pytest.importorskip("playwright.async_api", reason="pip install playwright")
CHROMIUM = os.environ.get("DEJAFIX_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    if os.environ.get("DEJAFIX_REQUIRE_BROWSER"):
        raise RuntimeError(f"DEJAFIX_REQUIRE_BROWSER is set and there is no {CHROMIUM}")
    pytest.skip("no Chromium here (apt-get install -y chromium): the browser tests need it",
                allow_module_level=True)

# A reporter's own words for the sample bug about the /new confirmation hanging.
HANG = {
    "title": "Confirm button after /new never answers on Telegram",
    "body": "Pressing the confirm button after /new freezes the gateway; it seems stuck in "
            "`_handle_reset_command` in gateway/slash_commands.py.",
}
PRIVATE = "octo-org/secret-plans"


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start.
        b = await p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox"])
        try:
            yield b
        finally:
            await b.close()


@contextlib.asynccontextmanager
async def page_of(browser: Any, tmp_path: Path, name: str) -> AsyncIterator[Any]:
    """A fresh browser context and page; a screenshot when the test fails inside."""
    context = await browser.new_context()
    page = await context.new_page()
    try:
        yield page
    except BaseException:
        shot = tmp_path / f"{name}.png"
        with contextlib.suppress(Exception):
            await page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")
        raise
    finally:
        await context.close()


def url(bot: BotUnderTest, path: str) -> str:
    return str(bot.client.make_url(path))


async def sign_in(page: Any, bot: BotUnderTest) -> None:
    """Through the fake's OAuth page, which approves at once as ``fake.oauth_login``."""
    await page.goto(url(bot, "/"))
    await page.wait_for_url(url(bot, "/"))
    assert "signed in as" in await page.inner_text("header")


async def shadow_bot(make_bot: BotFactory) -> BotUnderTest:
    bot = await make_bot(oauth=True,
                         config=ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)]))
    bot.github.add_file(REPO, ".github/dejafix.yml", "mode: shadow\n")
    bot.github.set_role(REPO, bot.github.oauth_login, "triage")
    resp = await bot.deliver("issues", issue_payload(number=4242, **HANG))
    assert resp.status == 202
    await bot.settle()
    return bot


async def test_a_maintainer_signs_in_sees_a_shadow_suggestion_and_tries_the_form(
        make_bot: BotFactory, browser: Any, tmp_path: Path) -> None:
    bot = await shadow_bot(make_bot)
    async with page_of(browser, tmp_path, "maintainer") as page:
        await sign_in(page, bot)
        assert bot.github.calls("GET", "/login/oauth/authorize")
        assert "signed in as maintainer" in await page.inner_text("header")
        await page.click(f"#repos a[href='/repos/{REPO.lower()}']")
        await page.wait_for_selector("#health")

        assert (await page.inner_text("#mode")).startswith("shadow")
        assert "0 of 20" in await page.inner_text("#cap")
        assert "valid" in await page.inner_text("#config")
        row = page.locator("tr.suggestion[data-issue='4242']")
        assert await row.get_attribute("data-mode") == "shadow"
        assert "shadow (not posted)" in await row.locator(".state").inner_text()
        # Recorded, not posted: GitHub received no comment and no label.
        assert not [c for c in bot.github.writes() if "/issues/4242/" in c.path]

        await page.fill("input[name=title]", HANG["title"])
        await page.fill("textarea[name=body]", HANG["body"])
        await page.click("#try button[type=submit]")
        await page.wait_for_selector("#preview-result")
        assert "It would comment" in await page.inner_text("#preview-action")
        comment = page.locator("#preview-comment")
        assert "looks like a known bug that already has a fix" in await comment.inner_text()
        # The comment's markdown rendered as HTML, as GitHub would show it.
        assert await comment.locator("table").count() >= 1
        assert "#52090" in await comment.inner_text()
        assert "shadow mode" in await page.inner_text("#preview-result")
        # Trying the form wrote nothing to GitHub either.
        assert not [c for c in bot.github.writes() if c.method == "POST"
                    and c.path.endswith("/comments")]


async def test_without_triage_a_user_is_refused_and_a_private_repository_is_invisible(
        make_bot: BotFactory, browser: Any, tmp_path: Path) -> None:
    bot = await make_bot(oauth=True)
    fake = bot.github
    fake.set_role(REPO, fake.oauth_login, "read")
    fake.private_repos.add(PRIVATE)
    # The private repository has suggestions of its own, which nobody here may see.
    await asyncio.to_thread(
        bot.app[SERVICES].store.record_suggestion, PRIVATE, 7, "c1", 0.91, "comment",
        "secret body", json.dumps({"matched_terms": ["classified"]}))
    async with page_of(browser, tmp_path, "no-triage") as page:
        await sign_in(page, bot)
        assert await page.locator("#no-repos").count() == 1
        assert PRIVATE not in await page.content()
        refused = await page.goto(url(bot, f"/repos/{REPO}"))
        assert refused is not None and refused.status == 403
        assert "triage permission" in await page.inner_text("body")
        hidden = await page.goto(url(bot, f"/repos/{PRIVATE}"))
        assert hidden is not None and hidden.status == 404
        assert "secret body" not in await page.content()
        assert "classified" not in await page.content()


async def test_a_forged_form_post_from_another_page_is_rejected(
        make_bot: BotFactory, browser: Any, tmp_path: Path) -> None:
    bot = await shadow_bot(make_bot)
    async with page_of(browser, tmp_path, "forged") as page:
        await sign_in(page, bot)
        # Another page on the same site (this host, another port: the session cookie goes
        # along) posts the form without the page's CSRF token.
        evil = "http://127.0.0.1:9/evil.html"
        target = url(bot, f"/repos/{REPO}/preview")

        async def serve_evil(route: Any) -> None:
            await route.fulfill(content_type="text/html", body=(
                f'<form id="f" method="post" action="{target}">'
                f'<input name="title" value="{HANG["title"]}"></form>'
                '<script>document.getElementById("f").submit()</script>'))

        await page.route(evil, serve_evil)
        async with page.expect_response(target) as answer:
            await page.goto(evil)
        response = await answer.value
        assert response.status == 403
        assert "reload the page" in await page.inner_text("body")
        # The real form, with its token, still works in the same session.
        await page.goto(url(bot, f"/repos/{REPO}"))
        await page.fill("input[name=title]", HANG["title"])
        await page.click("#try button[type=submit]")
        await page.wait_for_selector("#preview-result")


async def test_the_page_shows_a_running_backfill_and_its_rate_limit_wait(
        make_bot: BotFactory, browser: Any, tmp_path: Path) -> None:
    from bot.features.installs import BackfillRecord, save_record

    bot = await shadow_bot(make_bot)
    store = bot.app[SERVICES].store
    # A backfill in its first phase, waiting for GitHub's reset, as a slice leaves it.
    save_record(store, BackfillRecord(repo=REPO, state="waiting", phase="pulls", prs_read=300,
                                      prs_total=1200, clusters=41, calls=7, slices=2,
                                      started_at=1.0, waiting_until=4_102_444_800.0))
    async with page_of(browser, tmp_path, "backfill") as page:
        await sign_in(page, bot)
        await page.goto(url(bot, f"/repos/{REPO.lower()}"))
        await page.wait_for_selector("#backfill-progress")
        bar = page.locator("#backfill-progress progress")
        assert await bar.get_attribute("value") == "300"
        assert await bar.get_attribute("max") == "1200"
        text = await page.inner_text("#backfill-progress")
        assert "41" in text and "7" in text, text
        assert "rate limit" in text and "2100" in text, text
