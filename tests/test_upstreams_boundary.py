"""``upstreams`` stays inside what the repository's own readers may see: an upstream counts only
when the App's installation can see it (one of its repositories, or public) and it is no more
private than the repository naming it. Over real HTTP: signed deliveries into the running bot
(and the page's preview, signed in), GitHub faked on loopback with two installations and
private repositories; assertions on the exact requests the bot made."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import gidgethub
import pytest
from pydantic import SecretStr
from yarl import URL

from bot.features.preview import page_context, repo_config_or_error
from bot.features.upstreams import decide
from bot.github.client import Visibility, repo_visibility
from bot.settings import PrivateKey, ServiceConfig, Settings
from bot.web.app import SERVICES, create_app
from tests.conftest import (
    APP_ID,
    REPO,
    SAMPLE_CLUSTERS,
    SECRET,
    BotFactory,
    BotUnderTest,
    issue_payload,
)
from tests.fake_github import FakeGitHub
from tests.samples import RESET_HANG

# The sample clusters are REPO's; bug 35994 was fixed by REPO#52090, which RESET_HANG matches.
UPSTREAM = REPO
FIX = "52090"
CLUSTER = "35994"
OURS = 77  # the installation every delivery here comes from
THEIRS = 2  # another account's installation of the same App
FORK = "someone/hermes-fork"
CONFIG = ".github/dejafix.yml"


def fork_issue(fork: str = FORK, *, number: int = 7,
               private: bool | None = False) -> dict[str, Any]:
    """An issue opened on ``fork``; its ``repository`` says how it is shown, as GitHub's do
    (``private=None``: a hand-made payload that does not say)."""
    payload = issue_payload(**RESET_HANG, repo=fork, number=number, installation=OURS)
    if private is not None:
        payload["repository"].update(private=private,
                                     visibility="private" if private else "public")
    return payload


def naming(fake: FakeGitHub, fork: str = FORK, *, private: bool = False) -> None:
    fake.add_repo(fork, private=private, installation=OURS)
    fake.add_file(fork, CONFIG, f"upstreams: [{UPSTREAM}]\n")


def upstream_leaks(fake: FakeGitHub) -> list[str]:
    """Every request that carried the upstream's cluster (its fix, its id) or read anything of
    the upstream beyond whether it may be seen."""
    found = []
    for r in fake.requests:
        body = r.body.decode("utf-8", "replace") if isinstance(r.body, bytes) else r.body
        text = json.dumps(body) if body is not None else ""
        if FIX in text or CLUSTER in text:
            found.append(f"{r.method} {r.path}: carries the upstream's cluster")
        if r.path.lower().startswith(f"/repos/{UPSTREAM.lower()}/"):
            found.append(f"{r.method} {r.path}: reads the upstream")
    return found


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "dejafix.upstreams" and "not used" in r.getMessage()]


async def answered(bot: BotUnderTest, payload: dict[str, Any]) -> list[str]:
    """Deliver ``payload`` and wait: the comments posted on its issue."""
    resp = await bot.deliver("issues", payload)
    assert resp.status == 202, await resp.text()
    await bot.settle()
    repo, number = payload["repository"]["full_name"], payload["issue"]["number"]
    return [r.body["body"] for r in bot.github.calls("POST", f"/repos/{repo}/issues/{number}/"
                                                     "comments")]


# -- (a) a private upstream of another installation -------------------------------------------

@pytest.mark.parametrize("fork_private", [False, True])
async def test_a_private_upstream_of_another_installation_is_never_used(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture, fork_private: bool) -> None:
    """The upstream's clusters are not anyone's to read here, whether the naming repository is
    public or private itself: nothing of it is posted, no request carries it."""
    caplog.set_level(logging.INFO)
    bot = await make_bot()
    fake = bot.github
    fake.add_repo(UPSTREAM, private=True, installation=THEIRS)
    naming(fake, private=fork_private)

    assert await answered(bot, fork_issue(private=fork_private)) == []
    assert fake.writes() == []
    assert upstream_leaks(fake) == []
    # Asked once, with our installation's token, which GitHub answers "not found".
    asked = fake.calls("GET", f"/repos/{UPSTREAM}")
    assert [r.path for r in asked] == [f"/repos/{UPSTREAM}"]
    assert fake.tokens[asked[0].headers["Authorization"][6:]] == OURS
    said = refusals(caplog)
    assert len(said) == 1 and f"upstream {UPSTREAM} not used" in said[0]
    assert "not visible to this installation" in said[0] and FORK in said[0]

    # A second issue is refused too, from the cache: no second read, no second log line.
    assert await answered(bot, fork_issue(number=8, private=fork_private)) == []
    assert len(fake.calls("GET", f"/repos/{UPSTREAM}")) == 1
    assert len(refusals(caplog)) == 1
    assert upstream_leaks(fake) == []


async def test_the_fake_lists_each_installations_repositories_to_its_own_token(
        make_bot: BotFactory) -> None:
    """The fake the tests above stand on: GET /installation/repositories answers each
    installation's token with its own repositories, and a private repository of another
    installation is hidden from GET /repos, as GitHub does."""
    bot = await make_bot()
    fake = bot.github
    fake.add_repo(UPSTREAM, private=True, installation=THEIRS)
    naming(fake)
    services = bot.app[SERVICES]
    listed: dict[int, list[str]] = {}
    for installation in (OURS, THEIRS):
        gh = await services.github.for_installation(installation)
        data = await gh.getitem("/installation/repositories")
        listed[installation] = [r["full_name"] for r in data["repositories"]]
        hidden = await _status(gh, f"/repos/{UPSTREAM}")
        assert hidden == (200 if installation == THEIRS else 404)
    assert listed == {OURS: [FORK.lower()], THEIRS: [UPSTREAM.lower()]}


async def _status(gh: Any, path: str) -> int:
    try:
        await gh.getitem(path)
    except gidgethub.BadRequest as exc:
        return int(exc.status_code)
    return 200


# -- (b) a private upstream of the same installation ------------------------------------------

async def test_a_private_upstream_of_the_same_installation_serves_a_private_repository_only(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    bot = await make_bot()
    fake = bot.github
    fake.add_repo(UPSTREAM, private=True, installation=OURS)
    public_fork, private_fork = "someone/public-fork", "someone/private-fork"
    naming(fake, public_fork, private=False)
    naming(fake, private_fork, private=True)

    # Public: its comments are world-readable, the upstream's clusters are not.
    assert await answered(bot, fork_issue(public_fork, private=False)) == []
    assert upstream_leaks(fake) == []
    said = refusals(caplog)
    assert len(said) == 1 and public_fork in said[0]
    assert "it is private and someone/public-fork is public" in said[0]

    # Private, in the same installation: its readers are the upstream owner's too.
    posts = await answered(bot, fork_issue(private_fork, private=True))
    assert len(posts) == 1 and f"{UPSTREAM}#{FIX}" in posts[0]
    # A payload that does not say how the repository is shown: GitHub is asked (and says
    # private).
    posts = await answered(bot, fork_issue(private_fork, number=9, private=None))
    assert len(posts) == 1 and f"{UPSTREAM}#{FIX}" in posts[0]
    assert len([r for r in fake.calls("GET") if r.path == f"/repos/{private_fork}"]) == 1
    assert len(refusals(caplog)) == 1


async def test_a_repository_gone_public_since_its_delivery_loses_a_private_upstream(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    """A job retried hours later carries the delivery's word ("private"); the repository has
    been made public since. GitHub's answer now is read too, and the more public wins."""
    caplog.set_level(logging.INFO)
    bot = await make_bot()
    fake = bot.github
    fake.add_repo(UPSTREAM, private=True, installation=OURS)
    naming(fake, FORK, private=False)  # public now

    assert await answered(bot, fork_issue(FORK, private=True)) == []  # the old payload
    assert upstream_leaks(fake) == []
    said = refusals(caplog)
    assert len(said) == 1 and f"it is private and {FORK} is public" in said[0]


# -- (c) a public upstream of another installation --------------------------------------------

async def test_a_public_upstream_of_another_installation_is_used(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    bot = await make_bot()
    fake = bot.github
    fake.add_repo(UPSTREAM, private=False, installation=THEIRS)
    naming(fake)
    posts = await answered(bot, fork_issue())
    assert len(posts) == 1 and f"{UPSTREAM}#{FIX}" in posts[0]
    assert refusals(caplog) == []


# -- the rule itself ---------------------------------------------------------------------------

SHOWN: list[Visibility | None] = ["public", "internal", "private", "unknown", None]
READER: list[Visibility] = ["public", "internal", "private", "unknown"]
ALLOWED = {
    # (upstream as shown to the installation, the naming repository): allowed
    ("public", "public"), ("public", "internal"), ("public", "private"), ("public", "unknown"),
    ("internal", "internal"), ("internal", "private"),
    ("private", "private"),
    ("unknown", "private"),  # unclear counts as private for an upstream...
}  # ...and as public for the repository naming it; hidden (None) is never allowed


@pytest.mark.parametrize("shown", SHOWN)
@pytest.mark.parametrize("reader", READER)
def test_an_upstream_is_never_more_private_than_its_reader(shown: Visibility | None,
                                                          reader: Visibility) -> None:
    reason = decide(shown, "o/reader", reader)
    assert (reason is None) == ((shown, reader) in ALLOWED), reason


@pytest.mark.parametrize(("data", "shown"), [
    ({"private": False, "visibility": "public"}, "public"),
    ({"private": False}, "public"),
    ({"private": True, "visibility": "private"}, "private"),
    ({"private": True}, "private"),
    ({"private": True, "visibility": "internal"}, "internal"),
    ({"private": False, "visibility": "private"}, "unknown"),
    ({"private": True, "visibility": "public"}, "unknown"),
    ({"private": "false"}, "unknown"),
    ({}, "unknown"),
    (None, "unknown"),
])
def test_visibility_is_read_plainly_or_not_at_all(data: Any, shown: Visibility) -> None:
    assert repo_visibility(data) == shown


# -- the page's preview ------------------------------------------------------------------------

PageFactory = Callable[..., Awaitable[BotUnderTest]]
MAINTAINER = "maintainer"


@pytest.fixture
def make_page(github: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path,
              aiohttp_client: Any) -> PageFactory:
    """The bot with its page, signed in through the fake's OAuth client."""
    fake, base_url = github

    async def factory() -> BotUnderTest:
        settings = Settings(
            app_id=APP_ID, private_key=PrivateKey(key_pair[0], source="test"),
            webhook_secret=SecretStr(SECRET), github_url=base_url,
            data_dir=tmp_path / "data", github_web_url=base_url,
            oauth_client_id=fake.oauth_client_id,
            oauth_client_secret=SecretStr(fake.oauth_client_secret))
        app = create_app(settings, ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)]))
        client = await aiohttp_client(app)
        bot = BotUnderTest(client=client, app=app, github=fake, data_dir=tmp_path / "data")
        await _sign_in(bot)
        return bot

    return factory


async def _sign_in(bot: BotUnderTest) -> None:
    """GitHub's sign-in by hand: /login, the fake's authorize page (it approves at once), the
    callback."""
    http = bot.client.session
    base = bot.client.make_url("/")
    async with http.get(base / "login", allow_redirects=False) as resp:
        assert resp.status == 302, await resp.text()
        authorize = resp.headers["Location"]
    async with aiohttp.ClientSession() as outside, \
            outside.get(authorize, allow_redirects=False) as resp:
        assert resp.status == 302, await resp.text()
        callback = URL(resp.headers["Location"])
    async with http.get(base.with_path(callback.path).with_query(callback.query),
                        allow_redirects=False) as resp:
        await resp.read()
        assert resp.status == 302


async def _preview(bot: BotUnderTest, repo: str) -> str:
    """The page's "what would Dejafix say?" for RESET_HANG on ``repo``: the HTML answered."""
    page = await bot.client.get(f"/repos/{repo}", allow_redirects=False)
    text = await page.text()
    assert page.status == 200, text[:500]
    marker = 'name="csrf" value="'
    csrf = text[text.index(marker) + len(marker):].split('"', 1)[0]
    resp = await bot.client.post(f"/repos/{repo}/preview", allow_redirects=False,
                                 data={"csrf": csrf, **RESET_HANG})
    html = await resp.text()
    assert resp.status == 200, html[:500]
    return html


async def test_the_preview_keeps_to_the_same_rule(make_page: PageFactory) -> None:
    bot = await make_page()
    fake = bot.github
    fake.add_repo(UPSTREAM, private=True, installation=THEIRS)
    naming(fake)
    fake.set_role(FORK, MAINTAINER, "triage")
    html = await _preview(bot, FORK)
    assert FIX not in html and CLUSTER not in html
    assert "It would comment" not in html
    assert upstream_leaks(fake) == []

    # Control: the same upstream made public (a minute later, when the answer is read again).
    fake.add_repo(UPSTREAM, private=False, installation=THEIRS)
    bot.app[SERVICES].visibilities.clear()
    html = await _preview(bot, FORK)
    assert FIX in html and "It would comment" in html


async def test_the_preview_goes_on_without_upstreams_github_cannot_check(
        make_page: PageFactory, caplog: pytest.LogCaptureFixture) -> None:
    """As the page does: GitHub failing on the upstream's visibility leaves the upstreams out
    (a warning, a note in the preview), never a 500 and never an unchecked upstream."""
    caplog.set_level(logging.INFO)
    bot = await make_page()
    fake = bot.github
    fake.add_repo(UPSTREAM, private=False, installation=THEIRS)  # usable, once GitHub says so
    naming(fake)
    fake.set_role(FORK, MAINTAINER, "triage")
    fake.failures[f"GET /repos/{UPSTREAM}"] = [502] * 20
    html = await _preview(bot, FORK)
    assert FIX not in html and "It would comment" not in html
    assert "could not say just now which of the repository" in html
    warned = [r.getMessage() for r in caplog.records
              if r.name == "dejafix.preview" and r.levelno == logging.WARNING]
    assert f"{FORK}: upstreams not checked (GitHubBroken); the preview shows none" in warned, \
        warned
    assert upstream_leaks(fake) == []


# -- the config check ------------------------------------------------------------------------

def push(repo: str, sha: str) -> dict[str, Any]:
    """A push to ``repo``'s default branch changing the config file, as GitHub sends it
    (trimmed to what the handler reads); ``repo`` is public."""
    owner, name = repo.split("/")
    return {
        "ref": "refs/heads/main", "before": "0" * 40, "after": sha, "created": False,
        "deleted": False, "forced": False,
        "commits": [{"id": sha, "added": [], "removed": [], "modified": [CONFIG]}],
        "repository": {"full_name": repo, "name": name, "owner": {"login": owner},
                       "default_branch": "main", "html_url": f"https://github.com/{repo}",
                       "private": False, "visibility": "public"},
        "sender": {"login": "maintainer", "type": "User"}, "installation": {"id": OURS},
    }


async def test_the_config_check_names_an_unused_upstream_without_telling_why(
        make_bot: BotFactory) -> None:
    """The check run says which upstreams are not used, in one wording for every reason: a
    public repository's check runs are public, and a pull request can name any repository,
    so it must not tell a private repository of this installation from another's."""
    bot = await make_bot()
    fake = bot.github
    same, other, public = "acme/secret-same", "acme/secret-other", "acme/open-lib"
    fake.add_repo(same, private=True, installation=OURS)
    fake.add_repo(other, private=True, installation=THEIRS)
    fake.add_repo(public, private=False, installation=THEIRS)
    summaries = []
    for n, upstream in enumerate((same, other), start=1):
        fork, sha = f"someone/fork-{n}", str(n) * 40
        fake.add_repo(fork, installation=OURS)
        fake.add_file_at(fork, sha, CONFIG, f"upstreams: [{upstream}, {public}]\n")
        resp = await bot.deliver("push", push(fork, sha))
        assert resp.status == 202
        await bot.settle()
        [run] = fake.check_runs[fork.lower()]
        assert run["conclusion"] == "neutral"
        assert run["output"]["title"] == f"{CONFIG} is valid; 1 upstream not used"
        summary = run["output"]["summary"]
        assert f"`{upstream}`" in summary and public not in summary
        summaries.append(summary.replace(upstream, "UPSTREAM").replace(fork, "FORK")
                         .replace(sha, "SHA"))
    assert summaries[0] == summaries[1]
    assert "private to another" not in summaries[0] and "it is private" not in summaries[0]

    # Control: only usable upstreams, and the check passes as before.
    fork, sha = "someone/fork-3", "3" * 40
    fake.add_repo(fork, installation=OURS)
    fake.add_file_at(fork, sha, CONFIG, f"upstreams: [{public}]\n")
    await bot.deliver("push", push(fork, sha))
    await bot.settle()
    assert [r["conclusion"] for r in fake.check_runs[fork.lower()]] == ["success"]


async def test_the_page_reads_the_config_with_only_the_upstreams_it_may_use(
        make_bot: BotFactory, caplog: pytest.LogCaptureFixture) -> None:
    """What the repository page ranks and looks clusters up in (``repo_config_or_error``, as
    bot/web/pages.py calls it): the repository's own visibility asked of GitHub, the page
    having no delivery to read it from."""
    caplog.set_level(logging.INFO)
    bot = await make_bot()
    fake = bot.github
    fake.add_repo(UPSTREAM, private=True, installation=THEIRS)
    fake.add_repo("acme/open-lib", private=False, installation=THEIRS)
    fake.add_repo(FORK, installation=OURS)
    fake.add_file(FORK, CONFIG, f"upstreams: [{UPSTREAM}, acme/open-lib]\n")
    services = bot.app[SERVICES]
    ctx = await page_context(services, FORK, "page")
    config, errors = await repo_config_or_error(ctx)
    assert (config.upstreams, errors) == (["acme/open-lib"], [])
    assert len([r for r in fake.calls("GET") if r.path == f"/repos/{FORK}"]) == 1
    assert [m for m in refusals(caplog) if UPSTREAM in m]
    assert upstream_leaks(fake) == []
