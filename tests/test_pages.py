"""The web page (issue 16, part 2), over real HTTP: the bot's own server against the fake GitHub
on loopback, signed in through the fake's OAuth pages, assertions on the HTML served (parsed,
by element id) and on the exact requests the bot made to GitHub."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Awaitable, Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.fernet import Fernet
from pydantic import SecretStr
from yarl import URL

from bot.settings import PrivateKey, ServiceConfig, Settings
from bot.web.app import SERVICES, create_app
from bot.web.auth import COOKIE, session_key
from bot.web.pages import comment_html
from tests.conftest import APP_ID, REPO, SAMPLE_CLUSTERS, SECRET, BotUnderTest, issue_payload
from tests.fake_github import FakeGitHub

# The operator token's file in the data directory (the README names it).
OPERATOR_TOKEN_FILE = "operator-token"

# A reporter's words for the sample bug 35994 ("Telegram /new confirm button hangs"), naming
# the file and the function its fix (#52090) changed.
FROZEN_RESET = {
    "title": "Gateway freezes on Telegram when I confirm /new with the button",
    "body": (
        "I send /new in Telegram, press the confirm button, and the gateway never answers "
        "again until it is restarted.\n\nThe traceback ends in `_handle_reset_command` in "
        "gateway/slash_commands.py, waiting on the agent cleanup.\n"
    ),
}
OFF_TOPIC = {
    "title": "Please add a French translation of the installation guide",
    "body": "Our team reads French; a translated install guide would help us onboard.",
}
MAINTAINER = "maintainer"
OTHER = "acme/private-widgets"


# -- a small HTML reader ------------------------------------------------------------------

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


class Node:
    def __init__(self, tag: str, attrs: dict[str, str], parent: Node | None) -> None:
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[Node | str] = []

    def text(self) -> str:
        return " ".join("".join(c if isinstance(c, str) else " " + c.text() + " "
                                for c in self.children).split())

    def iter(self) -> list[Node]:
        out: list[Node] = []
        for c in self.children:
            if isinstance(c, Node):
                out.append(c)
                out.extend(c.iter())
        return out

    def find_all(self, tag: str | None = None, cls: str | None = None,
                 **attrs: str) -> list[Node]:
        return [n for n in self.iter()
                if (tag is None or n.tag == tag)
                and (cls is None or cls in n.attrs.get("class", "").split())
                and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def by_id(self, ident: str) -> Node | None:
        found = self.find_all(id=ident)
        return found[0] if found else None

    def get(self, ident: str) -> Node:
        node = self.by_id(ident)
        assert node is not None, f"no element #{ident} on the page"
        return node


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {}, None)
        self.current = self.root

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs}, self.current)
        self.current.children.append(node)
        if tag not in VOID:
            self.current = node

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.current.children.append(Node(tag, {k: v or "" for k, v in attrs}, self.current))

    def handle_endtag(self, tag: str) -> None:
        node: Node | None = self.current
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.current = node.parent

    def handle_data(self, data: str) -> None:
        self.current.children.append(data)


def parse(html: str) -> Node:
    builder = _Builder()
    builder.feed(html)
    builder.close()
    return builder.root


def csrf_of(page: Node) -> str:
    tokens = {n.attrs["value"] for n in page.find_all("input", name="csrf")}
    assert len(tokens) == 1 and "" not in tokens, tokens
    return tokens.pop()


# -- the bot under test, signed in --------------------------------------------------------

PageFactory = Callable[..., Awaitable[BotUnderTest]]


@pytest.fixture
def make_page(github: tuple[FakeGitHub, str], key_pair: tuple[str, str], tmp_path: Path,
              aiohttp_client: Any) -> PageFactory:
    """The bot with its page: ``oauth`` signs in with the fake's OAuth client (else the page
    is the operator's only, and the client opens an operator session with the token from the
    data directory unless ``operator=False``); ``work=False`` is a web-only process."""
    fake, base_url = github

    async def factory(*, oauth: bool = True, config: ServiceConfig | None = None,
                      work: bool = True, public_url: str | None = None,
                      operator: bool | None = None) -> BotUnderTest:
        settings = Settings(
            app_id=APP_ID, private_key=PrivateKey(key_pair[0], source="test"),
            webhook_secret=SecretStr(SECRET), github_url=base_url,
            data_dir=tmp_path / "data", github_web_url=base_url,
            oauth_client_id=fake.oauth_client_id if oauth else None,
            oauth_client_secret=SecretStr(fake.oauth_client_secret) if oauth else None,
            public_url=public_url,
        )
        cfg = config or ServiceConfig(cluster_paths=[str(SAMPLE_CLUSTERS)])
        app = create_app(settings, cfg, work=work)
        client = await aiohttp_client(app)
        bot = BotUnderTest(client=client, app=app, github=fake, data_dir=tmp_path / "data")
        if operator if operator is not None else not oauth:
            await open_operator_session(bot)
        return bot

    return factory


def operator_token(bot: BotUnderTest) -> str:
    """What the operator finds in the data directory (and in the start-up link)."""
    return (bot.data_dir / OPERATOR_TOKEN_FILE).read_text().strip()


async def open_operator_session(bot: BotUnderTest, path: str = "/") -> None:
    resp = await bot.client.get(URL(path).update_query(token=operator_token(bot)),
                                allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == path, await resp.text()


async def sign_in(http: aiohttp.ClientSession, base: URL,
                  nxt: str | None = None) -> aiohttp.ClientResponse:
    """GitHub's sign-in by hand: /login (with ``next``), the fake's authorize page (approves
    at once), the callback; returns the callback's answer."""
    start = (base / "login").with_query({"next": nxt} if nxt is not None else {})
    async with http.get(start, allow_redirects=False) as resp:
        assert resp.status == 302, await resp.text()
        authorize = resp.headers["Location"]
    async with aiohttp.ClientSession() as outside, \
            outside.get(authorize, allow_redirects=False) as resp:
        assert resp.status == 302, await resp.text()
        callback = URL(resp.headers["Location"])
    assert callback.path == "/oauth/callback" and callback.query.get("code")
    async with http.get(base.with_path(callback.path).with_query(callback.query),
                        allow_redirects=False) as resp:
        await resp.read()
        return resp


def base_of(bot: BotUnderTest) -> URL:
    return bot.client.make_url("/")


async def signed_in(bot: BotUnderTest) -> None:
    resp = await sign_in(bot.client.session, base_of(bot))
    assert resp.status == 302 and resp.headers["Location"] == "/"


async def page(bot: BotUnderTest, path: str, status: int = 200) -> Node:
    resp = await bot.client.get(path, allow_redirects=False)
    text = await resp.text()
    assert resp.status == status, f"{path}: {resp.status} {text[:500]}"
    return parse(text)


async def post_preview(bot: BotUnderTest, title: str, body: str, csrf: str | None = None,
                       status: int = 200, repo: str = REPO) -> Node:
    if csrf is None:
        csrf = csrf_of(await page(bot, f"/repos/{repo}"))
    resp = await bot.client.post(f"/repos/{repo}/preview", allow_redirects=False,
                                 data={"csrf": csrf, "title": title, "body": body})
    text = await resp.text()
    assert resp.status == status, f"{resp.status} {text[:500]}"
    return parse(text)


def listed(home: Node) -> list[str]:
    """The repositories ``/`` links to, in lower case (the index keys repositories so; GitHub's
    names are case-insensitive)."""
    return [a.attrs["href"].lower() for a in home.get("repos").find_all("a")]


def comment_posts(fake: FakeGitHub) -> list[str]:
    return [r.path for r in fake.calls("POST", "/comments")]


# -- 1. operator mode ---------------------------------------------------------------------

async def test_operator_mode_needs_the_operator_token_and_has_no_sign_in(
        make_page: PageFactory) -> None:
    bot = await make_page(oauth=False, operator=False)
    # Loopback is not a credential: a request from 127.0.0.1 to 127.0.0.1 without the
    # operator's session is refused, and told where the link is (not the file's path).
    for path in ("/", f"/repos/{REPO}", f"/repos/{REPO}/backtest"):
        refused = await bot.client.get(path, headers={"Host": "127.0.0.1:8000"})
        text = await refused.text()
        assert refused.status == 403, path
        assert "operator link" in text and str(bot.data_dir) not in text
    wrong = await bot.client.get("/?token=not-the-token", allow_redirects=False)
    assert wrong.status == 403 and "not-the-token" not in await wrong.text()

    # The link: the token is exchanged for a session and leaves the URL at once.
    token = operator_token(bot)
    assert stat.S_IMODE(os.stat(bot.data_dir / OPERATOR_TOKEN_FILE).st_mode) == 0o600
    resp = await bot.client.get(f"/repos/{REPO}?token={token}", allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == f"/repos/{REPO}"
    assert token not in resp.headers["Location"]
    home = await page(bot, "/")
    assert "the operator" in home.get("operator-notice").text()
    assert token not in str(home.text())
    assert listed(home) == [f"/repos/{REPO.lower()}"]
    repo_page = await page(bot, listed(home)[0])  # the link works as written
    assert repo_page.by_id("operator-notice") is not None and repo_page.by_id("mode")
    # Whatever headers a proxy adds, the session is what counts.
    relayed = await bot.client.get("/", headers={"X-Forwarded-For": "1.2.3.4"})
    assert relayed.status == 200

    login = await bot.client.get("/login", allow_redirects=False)
    assert login.status == 404
    # The operator asks GitHub nothing on a user's behalf.
    assert bot.github.calls("GET", "/collaborators/") == []


async def test_with_sign_in_configured_the_operator_token_still_opens_the_page(
        make_page: PageFactory) -> None:
    bot = await make_page()
    assert (await bot.client.get("/", allow_redirects=False)).status == 302
    await open_operator_session(bot, f"/repos/{REPO}")
    repo_page = await page(bot, f"/repos/{REPO}")
    assert repo_page.by_id("operator-notice") is not None
    assert bot.github.calls("GET", "/collaborators/") == []


# -- 2. sign-in ---------------------------------------------------------------------------

async def test_without_a_session_the_page_sends_you_to_sign_in(make_page: PageFactory) -> None:
    bot = await make_page()
    for path in ("/", f"/repos/{REPO}"):
        resp = await bot.client.get(path, allow_redirects=False)
        assert resp.status == 302
        location = URL(resp.headers["Location"])
        assert location.path == "/login" and location.query["next"] == path
    # Sign-in goes to GitHub's authorize page with this client and a state.
    resp = await bot.client.get("/login", allow_redirects=False)
    authorize = URL(resp.headers["Location"])
    assert authorize.path == "/login/oauth/authorize"
    assert authorize.query["client_id"] == bot.github.oauth_client_id
    assert len(authorize.query["state"]) >= 20
    assert authorize.query["redirect_uri"] == str(base_of(bot) / "oauth/callback")


async def test_full_sign_in_sets_a_session(make_page: PageFactory) -> None:
    bot = await make_page()
    resp = await sign_in(bot.client.session, base_of(bot))
    assert resp.status == 302 and resp.headers["Location"] == "/"
    home = await page(bot, "/")
    header = home.find_all("header")[0]
    assert "signed in as maintainer" in header.text()
    assert [r.path for r in bot.github.calls("POST", "/login/oauth/access_token")] == [
        "/login/oauth/access_token"]
    assert bot.github.calls("GET", "/user")[0].headers["Authorization"].split()[1] in \
        bot.github.user_tokens


async def test_sign_in_returns_to_the_page_asked_for(make_page: PageFactory) -> None:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, "triage")
    first = await bot.client.get(f"/repos/{REPO}", allow_redirects=False)
    nxt = URL(first.headers["Location"]).query["next"]
    resp = await sign_in(bot.client.session, base_of(bot), nxt)
    assert resp.status == 302 and resp.headers["Location"] == f"/repos/{REPO}"
    assert (await bot.client.get(f"/repos/{REPO}", allow_redirects=False)).status == 200


@pytest.mark.parametrize("target", ["//evil.example/x", "https://evil.example/x",
                                    "evil.example"])
async def test_sign_in_never_returns_to_another_site(make_page: PageFactory,
                                                     target: str) -> None:
    bot = await make_page()
    resp = await sign_in(bot.client.session, base_of(bot), target)
    assert resp.status == 302 and resp.headers["Location"] == "/"


async def test_sign_in_never_returns_to_another_site_through_a_tab(
        make_page: PageFactory) -> None:
    bot = await make_page()
    resp = await sign_in(bot.client.session, base_of(bot), "/\t/evil.example/x")
    location = resp.headers["Location"]
    assert resp.status == 302
    # A browser resolves "//host/..." (and "/\\host/...") on another site.
    assert location.startswith("/") and location[1:2] not in ("/", "\\"), location


@pytest.mark.parametrize("tamper", ["wrong", "missing"])
async def test_a_callback_with_a_wrong_or_missing_state_signs_nobody_in(
        make_page: PageFactory, tamper: str) -> None:
    bot = await make_page()
    resp = await bot.client.get("/login", allow_redirects=False)
    async with aiohttp.ClientSession() as outside, \
            outside.get(resp.headers["Location"], allow_redirects=False) as r:
        callback = URL(r.headers["Location"])
    query = dict(callback.query)
    if tamper == "wrong":
        query["state"] = "not-the-state-the-bot-gave"
    else:
        del query["state"]
    resp = await bot.client.get(URL("/oauth/callback").with_query(query),
                                allow_redirects=False)
    assert resp.status == 400
    assert "sign in again" in await resp.text()
    # GitHub was never asked for a token with the (valid) code, and nobody is signed in.
    assert bot.github.calls("POST", "/login/oauth/access_token") == []
    assert bot.github.user_tokens == {}
    home = await bot.client.get("/", allow_redirects=False)
    assert home.status == 302 and URL(home.headers["Location"]).path == "/login"


async def test_a_callback_with_no_sign_in_started_is_refused(make_page: PageFactory) -> None:
    bot = await make_page()
    resp = await bot.client.get("/oauth/callback?code=abc&state=abc", allow_redirects=False)
    assert resp.status == 400
    assert bot.github.calls("POST", "/login/oauth/access_token") == []


async def test_the_session_cookie_is_httponly_and_samesite_lax(make_page: PageFactory) -> None:
    bot = await make_page()
    resp = await bot.client.get("/login", allow_redirects=False)
    cookies = [c for c in resp.headers.getall("Set-Cookie") if c.startswith(COOKIE + "=")]
    callback = await sign_in(bot.client.session, base_of(bot))
    cookies += [c for c in callback.headers.getall("Set-Cookie")
                if c.startswith(COOKIE + "=")]
    assert len(cookies) == 2
    for cookie in cookies:
        attrs = [a.strip().lower() for a in cookie.split(";")]
        assert "httponly" in attrs, cookie
        assert "samesite=lax" in attrs, cookie
        assert "path=/" in attrs, cookie
        # Over plain http it is not Secure (a browser would drop it); see the https test.
        assert "secure" not in attrs, cookie
        # Encrypted: neither the login nor the token can be read in it.
        assert MAINTAINER not in cookie and "ghu_" not in cookie


async def test_the_session_cookie_is_secure_behind_an_https_url(
        make_page: PageFactory) -> None:
    bot = await make_page(public_url="https://dejafix.example")
    # Through the https proxy in front: Secure.
    resp = await bot.client.get("/login", allow_redirects=False,
                                headers={"X-Forwarded-Proto": "https"})
    cookie = next(c for c in resp.headers.getall("Set-Cookie") if c.startswith(COOKIE + "="))
    assert "secure" in [a.strip().lower() for a in cookie.split(";")], cookie
    # A request from 127.0.0.1 to Host 127.0.0.1 with no forwarding header: the operator on
    # this machine, or a same-host proxy that rewrote Host (nginx's default). Secure as well: a
    # visitor's cookie must never be sent over http, and browsers keep Secure cookies from
    # http://127.0.0.1 (a secure context), so the operator's page still works.
    direct = await bot.client.get("/login", allow_redirects=False)
    plain = next(c for c in direct.headers.getall("Set-Cookie") if c.startswith(COOKIE + "="))
    assert "secure" in [a.strip().lower() for a in plain.split(";")], plain
    # The callback GitHub is sent back to is the public one.
    redirect = URL(resp.headers["Location"]).query["redirect_uri"]
    assert redirect == "https://dejafix.example/oauth/callback"


async def test_logout_needs_the_csrf_token_and_ends_the_session(make_page: PageFactory) -> None:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, "triage")
    await signed_in(bot)
    home = await page(bot, "/")
    csrf = csrf_of(home)
    assert home.find_all("form", action="/logout")

    for data in ({}, {"csrf": "forged"}):
        refused = await bot.client.post("/logout", data=data, allow_redirects=False)
        assert refused.status == 403
    assert "signed in as maintainer" in (await page(bot, "/")).text()

    assert (await bot.client.get(f"/repos/{REPO}")).status == 200
    jar = bot.client.session.cookie_jar
    copied = jar.filter_cookies(bot.client.make_url("/"))
    assert len(bot.github.user_tokens) == 1
    resp = await bot.client.post("/logout", data={"csrf": csrf}, allow_redirects=False)
    assert resp.status == 302 and resp.headers["Location"] == "/"
    after = await bot.client.get("/", allow_redirects=False)
    assert after.status == 302 and URL(after.headers["Location"]).path == "/login"
    # The token is revoked with GitHub: a copy of the old cookie signs nobody in.
    assert bot.github.user_tokens == {}
    assert bot.github.calls("DELETE", "/applications/")
    jar.update_cookies(copied, bot.client.make_url("/"))
    replayed = await bot.client.get(f"/repos/{REPO}", allow_redirects=False)
    assert replayed.status == 302 and URL(replayed.headers["Location"]).path == "/login"


async def test_a_signed_out_cookie_does_not_ride_on_another_sessions_cached_answer(
        make_page: PageFactory) -> None:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, "triage")
    base = base_of(bot)
    await signed_in(bot)
    assert (await bot.client.get(f"/repos/{REPO}")).status == 200
    copied = bot.client.session.cookie_jar.filter_cookies(base)
    csrf = csrf_of(await page(bot, "/"))
    # Cookie jars that keep cookies of an IP address, as a browser does.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as other:
        # The same user in another browser, signed in with a token of its own.
        assert (await sign_in(other, base)).status == 302
        # The first browser signs out: its token is revoked with GitHub.
        resp = await bot.client.post("/logout", data={"csrf": csrf}, allow_redirects=False)
        assert resp.status == 302 and len(bot.github.user_tokens) == 1
        # The other session looks at the page: the answer for (user, repository) is warm.
        async with other.get(base / "repos" / REPO, allow_redirects=False) as warm:
            assert warm.status == 200
    # A copy of the signed-out cookie, replayed within the cache's lifetime, is refused.
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as thief:
        thief.cookie_jar.update_cookies(copied, base)
        async with thief.get(base / "repos" / REPO, allow_redirects=False) as replayed:
            assert replayed.status == 302, await replayed.text()
            assert URL(replayed.headers["Location"]).path == "/login"


async def test_a_cookie_whose_login_is_not_its_tokens_owner_is_refused(
        make_page: PageFactory) -> None:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, "triage")
    await signed_in(bot)
    assert (await bot.client.get(f"/repos/{REPO}")).status == 200  # warms (maintainer, repo)
    # Someone without a role on the repository signs in with their own account.
    bot.github.oauth_login = "intruder"
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as own:
        assert (await sign_in(own, base_of(bot))).status == 302
    theirs = next(t for t, login in bot.github.user_tokens.items() if login == "intruder")
    # A cookie naming the maintainer with the intruder's token (as a leaked session key or a
    # bug could make one), sealed with the deployment's own key.
    key = session_key(Settings(oauth_client_secret=SecretStr(bot.github.oauth_client_secret)))
    forged = Fernet(key).encrypt(json.dumps({"created": int(time.time()), "session": {
        "login": MAINTAINER, "token": theirs}}).encode()).decode()
    async with aiohttp.ClientSession(cookies={COOKIE: forged}) as other, \
            other.get(base_of(bot) / "repos" / REPO, allow_redirects=False) as resp:
        assert resp.status == 302, await resp.text()
        assert URL(resp.headers["Location"]).path == "/login"


# -- 3. permission ------------------------------------------------------------------------

@pytest.mark.parametrize("role", ["triage", "write", "maintain", "admin"])
async def test_triage_or_more_sees_the_repository(make_page: PageFactory, role: str) -> None:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, role)
    await signed_in(bot)
    repo_page = await page(bot, f"/repos/{REPO}")
    assert repo_page.find_all("h1")[0].text() == REPO
    assert repo_page.by_id("mode") is not None
    home = await page(bot, "/")
    assert listed(home) == [f"/repos/{REPO.lower()}"]


async def test_read_role_is_forbidden(make_page: PageFactory) -> None:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, "read")
    await signed_in(bot)
    resp = await bot.client.get(f"/repos/{REPO}", allow_redirects=False)
    assert resp.status == 403
    assert "triage permission" in await resp.text()
    assert (await bot.client.get(f"/repos/{REPO}/backtest")).status == 403
    home = await page(bot, "/")
    assert home.by_id("repos") is None and home.by_id("no-repos") is not None


async def test_a_private_repository_without_a_role_is_not_found_and_not_listed(
        make_page: PageFactory) -> None:
    bot = await make_page()
    fake = bot.github
    visible = "acme/private-gadgets"
    fake.private_repos.update({OTHER.lower(), visible.lower()})
    fake.set_role(REPO, MAINTAINER, "triage")
    fake.set_role(visible, MAINTAINER, "triage")
    store = bot.app[SERVICES].store
    for repo in (OTHER, visible):  # known to Dejafix: it answered there
        store.record_suggestion(repo, 7, "1", 0.9, "comment", "body", "{}")
    await signed_in(bot)

    resp = await bot.client.get(f"/repos/{OTHER}", allow_redirects=False)
    assert resp.status == 404
    assert "triage" not in await resp.text()  # the same answer as no repository at all
    assert (await bot.client.get(f"/repos/{OTHER}/backtest")).status == 404
    shown = listed(await page(bot, "/"))
    assert f"/repos/{OTHER.lower()}" not in shown
    # Control: a private repository where the user has triage is listed and shown.
    assert shown == sorted([f"/repos/{REPO.lower()}", f"/repos/{visible}"])
    assert (await bot.client.get(f"/repos/{visible}")).status == 200


async def test_a_repository_without_the_app_installed_is_not_found(
        make_page: PageFactory) -> None:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, "admin")
    bot.github.not_installed.add(REPO.lower())
    await signed_in(bot)
    resp = await bot.client.get(f"/repos/{REPO}", allow_redirects=False)
    assert resp.status == 404
    assert bot.github.calls("GET", f"/repos/{REPO}/installation")
    # Not installed: the permission there is never asked.
    assert bot.github.calls("GET", "/collaborators/") == []
    home = await page(bot, "/")
    assert home.by_id("no-repos") is not None


async def test_the_permission_answer_is_cached(make_page: PageFactory) -> None:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, "triage")
    await signed_in(bot)
    await page(bot, f"/repos/{REPO}")
    asked = bot.github.calls("GET", "/collaborators/")
    assert [r.path for r in asked] == [f"/repos/{REPO}/collaborators/{MAINTAINER}/permission"]
    await page(bot, f"/repos/{REPO}")
    await page(bot, "/")
    await page(bot, f"/repos/{REPO}/backtest")
    assert len(bot.github.calls("GET", "/collaborators/")) == 1
    assert len(bot.github.calls("GET", f"/repos/{REPO}/installation")) == 1


async def test_an_expired_user_token_sends_the_user_to_sign_in_again(
        make_page: PageFactory) -> None:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, "triage")
    bot.github.set_role(OTHER, MAINTAINER, "triage")
    await signed_in(bot)
    await page(bot, f"/repos/{REPO}")
    bot.github.user_tokens.clear()  # GitHub's user tokens expire after eight hours
    resp = await bot.client.get(f"/repos/{OTHER}", allow_redirects=False)
    assert resp.status == 302
    assert URL(resp.headers["Location"]).path == "/login"
    assert URL(resp.headers["Location"]).query["next"] == f"/repos/{OTHER}"
    # The session is over: the next page asks for sign-in at once, asking GitHub nothing.
    again = await bot.client.get("/", allow_redirects=False)
    assert again.status == 302 and URL(again.headers["Location"]).path == "/login"


async def test_one_repository_github_fails_on_is_left_off_the_list(
        make_page: PageFactory) -> None:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, "triage")
    bot.github.set_role(OTHER, MAINTAINER, "triage")  # would be listed, but for GitHub's 502
    store = bot.app[SERVICES].store
    store.record_suggestion(OTHER, 3, "c", 0.9, "comment", "b", "{}")
    await signed_in(bot)
    bot.github.failures[f"GET /repos/{OTHER}/installation"] = [502] * 10
    home = await bot.client.get("/")
    assert home.status == 200
    text = await home.text()
    assert f"/repos/{REPO.lower()}" in text and f"/repos/{OTHER.lower()}" not in text


# -- 4. the preview form ------------------------------------------------------------------

async def preview_bot(make_page: PageFactory, config: str | None = None) -> BotUnderTest:
    bot = await make_page()
    bot.github.set_role(REPO, MAINTAINER, "triage")
    if config is not None:
        bot.github.add_file(REPO, ".github/dejafix.yml", config)
    await signed_in(bot)
    return bot


async def test_preview_of_a_matching_issue_shows_the_comment_and_posts_nothing(
        make_page: PageFactory) -> None:
    bot = await preview_bot(make_page)
    result = await post_preview(bot, FROZEN_RESET["title"], FROZEN_RESET["body"])
    action = result.get("preview-action").text()
    assert action.startswith("It would comment"), action
    comment = result.get("preview-comment")
    assert comment.find_all("table"), "the comment's table is rendered as HTML"
    assert "#52090" in comment.text() or "52090" in " ".join(
        a.attrs.get("href", "") for a in comment.find_all("a"))
    assert "<!--" not in comment.text()
    assert result.get("candidates").find_all("td")[0].text() == "35994"
    # The form keeps what was typed.
    assert result.find_all("input", name="title")[0].attrs["value"] == FROZEN_RESET["title"]
    # Nothing written to GitHub: no comment, no label, no check run.
    assert comment_posts(bot.github) == []
    assert bot.github.writes() == [r for r in bot.github.writes()
                                   if r.path == "/login/oauth/access_token"]
    assert bot.app[SERVICES].store.suggestions(REPO) == []


async def test_preview_echoes_the_issue_text_inert(make_page: PageFactory) -> None:
    bot = await preview_bot(make_page)
    title = FROZEN_RESET["title"] + ' "><script>alert(1)</script>'
    body = FROZEN_RESET["body"] + "\n</textarea><img src=x onerror=alert(2)> @octo-org/all\n"
    resp = await bot.client.post(f"/repos/{REPO}/preview", data={
        "csrf": csrf_of(await page(bot, f"/repos/{REPO}")), "title": title, "body": body})
    html = await resp.text()
    assert resp.status == 200
    assert "<script>alert(1)" not in html and "<img src=x" not in html
    tree = parse(html)
    assert tree.find_all("script") == [] and tree.find_all("img") == []
    # What was typed comes back as typed, in the form.
    assert tree.find_all("input", name="title")[0].attrs["value"] == title
    assert tree.find_all("textarea", name="body")[0].text() == " ".join(body.split())
    assert tree.get("preview-action").text().startswith("It would comment")
    assert "<script" not in str(tree.get("preview-comment").text())


async def test_preview_without_a_title_is_a_bad_request(make_page: PageFactory) -> None:
    bot = await preview_bot(make_page)
    await post_preview(bot, "   ", "a body", status=400)


@pytest.mark.parametrize("forgery", ["none", "wrong", "another session"])
async def test_a_forged_preview_post_is_refused(make_page: PageFactory, forgery: str) -> None:
    bot = await preview_bot(make_page)
    own = csrf_of(await page(bot, f"/repos/{REPO}"))
    data = dict(FROZEN_RESET)
    if forgery == "wrong":
        data["csrf"] = own[:-2] + ("xy" if not own.endswith("xy") else "zz")
    elif forgery == "another session":
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as other:
            await sign_in(other, base_of(bot))
            async with other.get(base_of(bot) / "repos" / REPO.split("/")[0] /
                                 REPO.split("/")[1]) as resp:
                assert resp.status == 200
                theirs = csrf_of(parse(await resp.text()))
        assert theirs != own
        data["csrf"] = theirs
    resp = await bot.client.post(f"/repos/{REPO}/preview", data=data, allow_redirects=False)
    assert resp.status == 403
    assert "preview-result" not in await resp.text()
    # Control: the same post with this session's own token is answered.
    ok = await bot.client.post(f"/repos/{REPO}/preview", data={**FROZEN_RESET, "csrf": own})
    assert ok.status == 200


async def test_preview_of_an_unrelated_issue_stays_silent_with_the_reason(
        make_page: PageFactory) -> None:
    bot = await preview_bot(make_page)
    result = await post_preview(bot, OFF_TOPIC["title"], OFF_TOPIC["body"])
    action = result.get("preview-action").text()
    assert action.startswith("It would stay silent"), action
    reason = action.partition(":")[2].strip()
    assert "threshold" in reason and "best: cluster" in reason, action
    assert result.by_id("preview-comment") is None
    assert comment_posts(bot.github) == []


async def test_preview_in_shadow_mode_says_it_would_be_recorded_not_posted(
        make_page: PageFactory) -> None:
    bot = await preview_bot(make_page, "mode: shadow\n")
    result = await post_preview(bot, FROZEN_RESET["title"], FROZEN_RESET["body"])
    notes = [n.text() for n in result.get("preview-result").find_all("p", cls="notice")]
    assert any("shadow mode" in n and "recorded" in n and "not posted" in n for n in notes), notes
    assert "shadow" in result.get("mode").text()
    assert comment_posts(bot.github) == []


async def test_preview_without_shadow_mode_has_no_shadow_note(make_page: PageFactory) -> None:
    bot = await preview_bot(make_page, "mode: comment\n")
    result = await post_preview(bot, FROZEN_RESET["title"], FROZEN_RESET["body"])
    assert "shadow" not in result.get("preview-result").text()


async def test_preview_with_an_invalid_config_is_silent_and_names_the_error(
        make_page: PageFactory) -> None:
    bot = await preview_bot(make_page, "mode: comment\nthreshhold: 0.5\n")
    result = await post_preview(bot, FROZEN_RESET["title"], FROZEN_RESET["body"])
    action = result.get("preview-action").text()
    assert action.startswith("It would stay silent"), action
    assert "invalid" in action and "threshhold" in action, action
    assert result.by_id("preview-comment") is None
    # The health table names it too.
    assert "threshhold" in result.get("config").text()


# -- 5. suggestions and health ------------------------------------------------------------

async def delivered(make_page: PageFactory, config: str | None) -> BotUnderTest:
    bot = await preview_bot(make_page, config)
    resp = await bot.deliver("issues", issue_payload(number=90001, title=FROZEN_RESET["title"],
                                                   body=FROZEN_RESET["body"]))
    assert resp.status == 202
    await bot.settle()
    return bot


def suggestion_rows(repo_page: Node) -> list[Node]:
    return repo_page.find_all("tr", cls="suggestion")


async def test_a_shadow_suggestion_is_listed_and_nothing_is_posted(
        make_page: PageFactory) -> None:
    bot = await delivered(make_page, "mode: shadow\n")
    assert comment_posts(bot.github) == []
    repo_page = await page(bot, f"/repos/{REPO}")
    rows = suggestion_rows(repo_page)
    assert [(r.attrs["data-issue"], r.attrs["data-mode"]) for r in rows] == [("90001", "shadow")]
    assert rows[0].find_all("span", cls="state")[0].text() == "shadow (not posted)"
    assert "#issuecomment-" not in str([a.attrs for a in rows[0].find_all("a")])
    assert "35994" in rows[0].text()
    assert repo_page.get("mode").text().startswith("shadow")
    assert "0 of 20" in repo_page.get("cap").text()


async def test_a_posted_suggestion_links_its_comment_and_counts_against_the_cap(
        make_page: PageFactory, github: tuple[FakeGitHub, str]) -> None:
    bot = await delivered(make_page, None)
    posts = bot.github.calls("POST", f"/repos/{REPO}/issues/90001/comments")
    assert len(posts) == 1
    comment_id = bot.github.comments[(REPO.lower(), 90001)][0]["id"]
    repo_page = await page(bot, f"/repos/{REPO}")
    rows = suggestion_rows(repo_page)
    assert [(r.attrs["data-issue"], r.attrs["data-mode"]) for r in rows] == [("90001", "comment")]
    assert rows[0].find_all("span", cls="state")[0].text() == "posted"
    links = [a.attrs["href"] for a in rows[0].find_all("a")]
    assert f"{github[1]}/{REPO}/issues/90001#issuecomment-{comment_id}" in links, links
    health = repo_page.get("health")
    assert health is not None
    assert repo_page.get("mode").text().startswith("comment")
    assert "1 of 20" in repo_page.get("cap").text()
    assert repo_page.get("config").text() == "valid"
    assert repo_page.get("pause").text() == "running"


async def test_a_dismissed_suggestion_shows_as_dismissed(make_page: PageFactory) -> None:
    bot = await delivered(make_page, None)
    dismiss = issue_payload("created", number=90001, login="reporter")
    dismiss["comment"] = {"id": 4242, "body": "Not my problem, sorry.\n/dejafix not-this",
                          "user": {"login": "reporter", "type": "User"}}
    assert (await bot.deliver("issue_comment", dismiss)).status == 202
    await bot.settle()
    repo_page = await page(bot, f"/repos/{REPO}")
    rows = suggestion_rows(repo_page)
    assert len(rows) == 1
    state = rows[0].find_all("span", cls="state")[0].text()
    assert state.startswith("dismissed") and "not-this" in state and "reporter" in state, state
    assert repo_page.get("dismissals").text().startswith("1 of the latest 1")


async def test_health_names_the_config_errors_of_an_invalid_file(
        make_page: PageFactory) -> None:
    bot = await preview_bot(make_page, "mode: loud\n")
    repo_page = await page(bot, f"/repos/{REPO}")
    config = repo_page.get("config")
    assert "cannot be used" in config.text()
    errors = [li.text() for li in config.find_all("li")]
    assert errors and any("mode" in e for e in errors), errors
    # The defaults stand in: the deployment's default mode.
    assert repo_page.get("mode").text().startswith("comment")
    assert "deployment" in repo_page.get("mode").text()
    assert repo_page.get("clusters").text().startswith("3 curated")
    assert repo_page.get("backfill").text() == "never"


# -- 6. comment_html ----------------------------------------------------------------------

def test_comment_html_removes_everything_active_and_keeps_the_markup_github_renders() -> None:
    markdown = "\n".join([
        "<!-- dejafix:known-fix -->",
        "This looks like **a known bug**.<br>Second line <sub>small print</sub>",
        "",
        "<script>alert('x')</script>",
        "",
        "Inline <img src=x onerror=\"alert('img')\"> picture",
        "",
        "[click me](javascript:alert('link'))",
        "",
        '<iframe src="https://evil.example"></iframe><form action="https://evil.example">'
        '<input name="q"></form><span style="position:fixed">styled</span>',
        "",
        "A raw one: <a href=\"javascript:alert('raw')\">raw link</a> and "
        "[data](data:text/html;base64,PHNjcmlwdD4=)",
        "",
        '<a href="https://example.com/fix" onclick="alert(\'a\')">the fix</a>',
        "",
        "| fix | merged |",
        "| --- | --- |",
        "| #52090 | `_handle_reset_command` |",
        "",
        "Run `pip install -U pkg` to get it.",
    ])
    html = comment_html(markdown)
    low = html.lower()
    for active in ("<script", "alert('x')", "<img", "onerror", "onclick", "alert('raw')",
                   "<iframe", "<form", "<input", "style="):
        assert active not in low, (active, html)
    tree = parse(html)
    hrefs = [a.attrs["href"] for a in tree.find_all("a") if "href" in a.attrs]
    assert hrefs == ["https://example.com/fix"], html
    # A javascript: link in markdown is not a link at all: at most its inert text is left.
    assert all("javascript:" not in a.text() for a in tree.find_all("a"))
    assert "raw link" in tree.text()
    assert tree.find_all("br") and tree.find_all("sub")[0].text() == "small print"
    table = tree.find_all("table")
    assert table and [th.text() for th in table[0].find_all("th")] == ["fix", "merged"]
    codes = [c.text() for c in tree.find_all("code")]
    assert "_handle_reset_command" in codes and "pip install -U pkg" in codes
    assert [a.text() for a in tree.find_all("a") if "href" in a.attrs] == ["the fix"]
    assert "click me" in tree.text()  # the text stays, the link does not
    assert tree.find_all("strong")[0].text() == "a known bug"


# -- 7. the backtest ----------------------------------------------------------------------

HISTORY_REPO = "octo/widgets"


def _history_cluster(public_id: str, pr: int, title: str, merged: str,
                     issues: list[tuple[int, str, str]], files: list[str]) -> dict[str, Any]:
    """A cluster record shaped like config/clusters/*.json, its issues carrying the
    ``created_at`` (and ``body_excerpt``) that learning keeps."""
    return {
        "repo": HISTORY_REPO, "public_id": public_id, "display_label": title,
        "summary": title, "subsystem": "core",
        "counts": {"members": len(issues) + 1, "closed_issues": len(issues), "merged_prs": 1},
        "landed_fix": {"status": "merged_to_main", "basis": "structural", "pr": pr,
                       "merged_at": merged},
        "resolution": {"state": "resolved", "by": f"pr-{pr}"},
        "fix_edges": [{"issue_number": issues[0][0], "pr_number": pr, "tier": "verified",
                       "basis": "closing_ref", "confidence": 0.95, "pr_merged_at": merged}],
        "members": [
            *({"kind": "issue", "number": n, "title": t, "url": None, "state": "closed",
               "created_at": created, "body_excerpt": t} for n, t, created in issues),
            {"kind": "pr", "number": pr, "title": f"fix: {title.lower()}", "url": None,
             "state": "merged", "merged": True, "is_fix_pr": True, "fix_tier": "verified",
             "files_changed": files},
        ],
    }


def history_clusters(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    records = [
        _history_cluster("501", 601, "Exporter flush_queue hangs forever on shutdown",
                         "2026-02-02T00:00:00+00:00",
                         [(11, "Exporter flush_queue hangs forever on shutdown",
                           "2026-02-01T00:00:00+00:00"),
                          (14, "exporter flush_queue hangs forever at shutdown again",
                           "2026-02-10T00:00:00+00:00")],
                         ["widgets/exporter/queue.py"]),
        _history_cluster("502", 602, "Tooltip renders behind the modal dialog overlay",
                         "2026-02-03T00:00:00+00:00",
                         [(12, "Tooltip renders behind the modal dialog overlay",
                           "2026-02-01T12:00:00+00:00"),
                          (15, "tooltip renders behind modal dialog overlay",
                           "2026-02-11T00:00:00+00:00")],
                         ["widgets/ui/tooltip.py"]),
    ]
    file = folder / "history.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


async def test_backtest_replays_clusters_with_dates_and_says_when_there_are_none(
        make_page: PageFactory, tmp_path: Path) -> None:
    folder = history_clusters(tmp_path / "history")
    bot = await make_page(oauth=False, config=ServiceConfig(
        cluster_paths=[str(SAMPLE_CLUSTERS), str(folder)]))
    home = await page(bot, "/")
    assert listed(home) == sorted([f"/repos/{HISTORY_REPO}", f"/repos/{REPO.lower()}"])

    replayed = await page(bot, f"/repos/{HISTORY_REPO}/backtest")
    summary = replayed.get("backtest-summary").text()
    # Four issues of two clusters; the two later reports were opened after their fix.
    assert summary.startswith("4 issues of 2 clusters replayed"), summary
    assert "2 were opened after their bug's fix" in summary, summary
    rows = replayed.get("pr-table").find_all("tr")
    assert len(rows) == 1 + 10  # the header, thresholds 0.95 down to 0.50
    assert rows[1].find_all("td")[0].text() == "0.95"
    assert replayed.by_id("pr-plot") is not None
    assert replayed.by_id("backtest-empty") is None

    sample = await page(bot, f"/repos/{REPO}/backtest")
    assert sample.by_id("backtest-empty") is not None
    assert sample.by_id("backtest-summary") is None and sample.by_id("pr-table") is None


# -- 8. fixes that look incomplete --------------------------------------------------------

async def test_reports_after_a_fix_shipped_show_as_incomplete_regressions_first(
        make_page: PageFactory, tmp_path: Path) -> None:
    folder = history_clusters(tmp_path / "history")
    records = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    # 501's fix was released; 502's only merged (the bot only ever suggests landed fixes, so
    # a merge alone says nothing about reports after it).
    records[0]["landed_fix"].update(released_in="v2.1", released_at="2026-02-05T00:00:00Z")
    (folder / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    bot = await make_page(oauth=False, config=ServiceConfig(cluster_paths=[str(folder)]))
    store = bot.app[SERVICES].store
    store.record_suggestion(HISTORY_REPO, 91001, "501", 0.9, "comment", "b", "{}")
    store.record_suggestion(HISTORY_REPO, 91002, "501", 0.8, "shadow", "b", "{}")
    store.record_suggestion(HISTORY_REPO, 91004, "502", 0.9, "comment", "b", "{}")
    repo_page = await page(bot, f"/repos/{HISTORY_REPO}")
    rows = repo_page.find_all("tr", cls="incomplete-fix")
    assert [r.find_all("code")[0].text() for r in rows] == ["501"]
    # A possible regression counts whatever the dates, and comes first.
    store.record_suggestion(HISTORY_REPO, 91003, "502", 0.9, "label", "b", "{}",
                            regression="opened after the fix, on the version with it")
    repo_page = await page(bot, f"/repos/{HISTORY_REPO}")
    rows = repo_page.find_all("tr", cls="incomplete-fix")
    assert [r.find_all("code")[0].text() for r in rows] == ["502", "501"]
    first, second = rows
    assert first.find_all("td")[-1].text() == "1"
    assert "regression?" in first.text() and "#91003" in first.text()
    assert "#91004" not in first.text()
    assert second.find_all("td")[-1].text() == "0"
    assert "#91001" in second.text() and "#91002" in second.text()
    assert "regression?" not in second.text()
    fix_links = [a.attrs["href"] for a in second.find_all("a") if "/pull/" in a.attrs["href"]]
    assert fix_links and fix_links[0].endswith(f"/{HISTORY_REPO}/pull/601")
    assert "released v2.1 2026-02-05" in second.text()
    assert repo_page.by_id("no-incomplete") is None


async def test_no_incomplete_fix_without_reports(make_page: PageFactory) -> None:
    bot = await make_page(oauth=False)
    repo_page = await page(bot, f"/repos/{REPO}")
    assert repo_page.find_all("tr", cls="incomplete-fix") == []
    assert repo_page.by_id("no-incomplete") is not None


# -- 9. a web-only process ----------------------------------------------------------------

async def test_a_web_only_process_says_it_has_no_index(make_page: PageFactory) -> None:
    bot = await make_page(oauth=False, work=False)
    for path in (f"/repos/{REPO}", f"/repos/{REPO}/backtest", "/"):
        resp = await bot.client.get(path)
        text = await resp.text()
        assert resp.status == 503, (path, resp.status)
        assert "no worker" in text and "Traceback" not in text, text


# -- the preview of a possible regression --------------------------------------------------

@pytest.mark.parametrize(("config", "says", "comment", "shadow_note"), [
    ("regressions: label\n", "It would label, not comment", True, False),
    ("regressions: off\n", "It would stay silent", True, False),
    ("regressions: comment\n", "It would comment", True, False),
    # Shadow mode with regressions off records nothing: the page must not say it would.
    ("regressions: off\nmode: shadow\n", "It would stay silent", True, False),
    ("regressions: comment\nmode: shadow\n", "It would comment", True, True),
])
async def test_preview_of_a_possible_regression_follows_the_regressions_setting(
        make_page: PageFactory, config: str, says: str, comment: bool,
        shadow_note: bool) -> None:
    from tests.samples import CAUSED, SAMPLES

    bot = await make_page(config=SAMPLES)
    bot.github.set_role(REPO, MAINTAINER, "triage")
    bot.github.add_file(REPO, ".github/dejafix.yml", config)
    await signed_in(bot)
    result = await post_preview(bot, CAUSED["title"], CAUSED["body"])
    action = result.get("preview-action").text()
    assert action.startswith(says), action
    assert "possible regression" in action
    assert (result.by_id("preview-comment") is not None) == comment
    assert ("shadow mode" in result.get("preview-result").text()) == shadow_note
    assert [w for w in bot.github.writes() if w.path.startswith("/repos/")] == []


async def test_a_long_history_replays_its_latest_clusters_and_says_so(
        make_page: PageFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bot.web import dashboard

    monkeypatch.setattr(dashboard, "BACKTEST_CLUSTERS", 1)
    folder = history_clusters(tmp_path / "history")
    bot = await make_page(oauth=False, config=ServiceConfig(cluster_paths=[str(folder)]))
    summary = (await page(bot, f"/repos/{HISTORY_REPO}/backtest")).get("backtest-summary").text()
    # The cluster whose fix merged last (502, a day after 501), of the two.
    assert summary.startswith("2 issues of 1 clusters replayed"), summary
    assert "whose fix merged last, of 2" in summary, summary
