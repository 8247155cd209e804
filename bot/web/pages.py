"""The web page: server-rendered HTML (Jinja2 templates, no JavaScript needed). ``/`` lists the
repositories the viewer may see; ``/repos/{owner}/{name}`` shows one (suggestions, health,
fixes that look incomplete, the "what would Dejafix say?" form), and ``.../backtest`` its
history replayed. Handlers are thin: the data comes from ``dashboard`` and ``preview``."""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from collections.abc import Callable
from typing import Any
from urllib.parse import urlencode

import aiohttp
import aiohttp_jinja2
import aiohttp_session
import cachetools
import gidgethub
import jinja2
import nh3
from aiohttp import web
from markdown_it import MarkdownIt

from bot.features.context import Services
from bot.features.preview import page_context, preview, repo_config_or_error
from bot.settings import Settings
from bot.web import dashboard
from bot.web.auth import (
    WHERE_THE_LINK_IS,
    Access,
    TokenRefused,
    Viewer,
    check_csrf,
    csrf_token,
    install_sessions,
    is_operator,
    local_path,
)

log = logging.getLogger("dejafix.web")

# Whether sign-in with GitHub is configured, for the operator's notice.
OAUTH = web.AppKey("oauth", bool)
# Set on the request by the page's access check: who is looking (auth.Viewer), or absent.
VIEWER = "dejafix.viewer"
_REPO = r"[A-Za-z0-9_.-]+"
# Repositories the list checks permission on, at most (the rest: open /repos/OWNER/NAME).
INDEX_REPOS = 100
# GitHub's own markdown flavour as far as the comment uses it (tables, <br>, <sub>); the HTML
# is then sanitised, since titles and terms in it come from public issues.
_MD = MarkdownIt("commonmark", {"html": True, "linkify": False}).enable("table")
_ALLOWED = nh3.ALLOWED_TAGS - {"img", "map", "area"}


def comment_html(markdown: str) -> str:
    """The comment as GitHub would show it, with nothing active left in it."""
    return nh3.clean(_MD.render(markdown), tags=_ALLOWED)


def inline_html(markdown: str) -> str:
    """One table cell's markdown (code spans, escapes) as inline HTML, sanitised."""
    return nh3.clean(_MD.renderInline(markdown), tags=_ALLOWED)


async def render(name: str, request: web.Request, context: dict[str, Any], *,
                 status: int = 200) -> web.Response:
    """A page with what base.html reads: who is looking, the CSRF token for its forms, and
    whether to say that the page is the operator's alone. (Not a context processor: those run
    on every request, the webhook's included, and would give each delivery a session.)"""
    viewer = request.get(VIEWER)
    return aiohttp_jinja2.render_template(name, request, {
        "viewer": viewer, "operator_notice": viewer is not None and viewer.operator,
        "oauth": request.app.get(OAUTH, False),
        "csrf": await csrf_token(request), **context}, status=status)


def install_templates(app: web.Application, settings: Settings) -> None:
    """Templates and the session cookie, before any page route is added."""
    # Sessions first: middlewares run in the order added, and the context processor's
    # middleware reads the session (the CSRF token).
    install_sessions(app, settings)
    app[OAUTH] = settings.has_oauth
    aiohttp_jinja2.setup(app, loader=jinja2.PackageLoader("bot.web", "templates"),
                         autoescape=jinja2.select_autoescape(default=True),
                         undefined=jinja2.StrictUndefined,
                         filters={"comment_html": comment_html,
                                  "inline_html": inline_html})


def base_url(settings: Settings, request: web.Request) -> str:
    return settings.public_url or str(request.url.origin())


class Pages:
    """The page's routes. ``services`` is None until the worker's services are up, and in a
    web-only process (``serve --no-worker``), which has no index to show."""

    def __init__(self, settings: Settings, services: Callable[[], Services | None],
                 session: Callable[[], aiohttp.ClientSession | None]) -> None:
        self.settings = settings
        self._services = services
        self._session = session
        self.access = Access()
        # (repo, index version, threshold) -> the backtest; one replay at a time.
        self._backtests: cachetools.TTLCache[tuple[str, str, float],
                                             dashboard.BacktestView | None] = \
            cachetools.TTLCache(maxsize=64, ttl=600)
        # One replay at a time, in a thread: seconds of CPU, but the GIL is handed over every
        # few ms, so the loop's worst lag stays near 10 ms (bench/page.py, which measured a
        # process of its own at 4 ms: not worth one more process to manage).
        self._replaying = asyncio.Semaphore(1)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/", self.index)
        app.router.add_get("/login", self.login)
        app.router.add_get("/oauth/callback", self.oauth_callback)
        app.router.add_post("/logout", self.logout)
        app.router.add_get(f"/repos/{{owner:{_REPO}}}/{{name:{_REPO}}}", self.repo)
        app.router.add_post(f"/repos/{{owner:{_REPO}}}/{{name:{_REPO}}}/preview", self.preview)
        app.router.add_get(f"/repos/{{owner:{_REPO}}}/{{name:{_REPO}}}/backtest",
                           self.backtest)

    # -- who is looking -------------------------------------------------------------------

    async def viewer(self, request: web.Request) -> Viewer:
        """The operator (a session opened with the operator token), else the signed-in user;
        otherwise a redirect to sign in, or 403 when sign-in is not configured. Where the
        request comes from counts for nothing: a proxy on this host looks local."""
        if await is_operator(request):
            viewer = Viewer(None)
        elif not self.settings.has_oauth:
            raise web.HTTPForbidden(
                text="This page is the operator's: sign-in with GitHub is not configured "
                     "(DEJAFIX_OAUTH_CLIENT_ID, DEJAFIX_OAUTH_CLIENT_SECRET). "
                     + WHERE_THE_LINK_IS)
        else:
            session = await aiohttp_session.get_session(request)
            login, token = session.get("login"), session.get("token")
            if not isinstance(login, str) or not isinstance(token, str):
                raise web.HTTPFound("/login?" + urlencode({"next": self._back_to(request)}))
            viewer = Viewer(login, token)
        request[VIEWER] = viewer
        return viewer

    @staticmethod
    def _back_to(request: web.Request) -> str:
        """Where sign-in returns: the page asked for; for a form post, the page it is on (a
        GET of the form's own URL would be 405)."""
        if request.method == "GET":
            return request.path_qs
        return request.path.rsplit("/", 1)[0] or "/"

    async def check(self, request: web.Request, services: Services, viewer: Viewer,
                    repo: str) -> str:
        """``Access.check``; a user token GitHub no longer accepts (they expire after eight
        hours) ends the session and sends the user to sign in again."""
        try:
            return await self.access.check(services, viewer, repo)
        except TokenRefused:
            session = await aiohttp_session.get_session(request)
            session.invalidate()
            raise web.HTTPFound("/login?" + urlencode({"next": self._back_to(request)})) \
                from None

    def services(self) -> Services:
        services = self._services()
        if services is None:
            raise web.HTTPServiceUnavailable(
                text="This process runs no worker (serve --no-worker) or is still starting: "
                     "the page is served by the processes that hold the cluster index.")
        return services

    async def allowed(self, request: web.Request) -> tuple[Viewer, Services, str]:
        viewer = await self.viewer(request)
        services = self.services()
        repo = f"{request.match_info['owner']}/{request.match_info['name']}"
        answer = await self.check(request, services, viewer, repo)
        if answer == "hidden":
            # The same answer as a repository that does not exist: a private one stays
            # invisible to those who cannot see it on GitHub.
            raise web.HTTPNotFound(text=f"No repository {repo} that you can see here.")
        if answer != "ok":
            raise web.HTTPForbidden(text=f"You need triage permission or more on {repo} to see "
                                         "Dejafix's page for it.")
        return viewer, services, repo

    # -- sign-in --------------------------------------------------------------------------

    async def login(self, request: web.Request) -> web.StreamResponse:
        if not self.settings.has_oauth:
            raise web.HTTPNotFound(text="Sign-in with GitHub is not configured.")
        session = await aiohttp_session.get_session(request)
        state = session["oauth_state"] = secrets.token_urlsafe(24)
        session["next"] = local_path(request.query.get("next", "/"))
        query = urlencode({"client_id": self.settings.oauth_client_id, "state": state,
                           "redirect_uri": base_url(self.settings, request) + "/oauth/callback"})
        raise web.HTTPFound(f"{self.settings.github_web_url}/login/oauth/authorize?{query}")

    async def oauth_callback(self, request: web.Request) -> web.StreamResponse:
        if not self.settings.has_oauth or self.settings.oauth_client_secret is None:
            raise web.HTTPNotFound(text="Sign-in with GitHub is not configured.")
        session = await aiohttp_session.get_session(request)
        expected = session.pop("oauth_state", None)
        if not expected or request.query.get("state") != expected:
            raise web.HTTPBadRequest(text="This sign-in link is stale or was not started here: "
                                          "sign in again from the page.")
        http = self._session()
        if http is None:
            raise web.HTTPServiceUnavailable(text="Still starting: try again in a moment.")
        try:
            async with http.post(
                f"{self.settings.github_web_url}/login/oauth/access_token",
                data={"client_id": self.settings.oauth_client_id,
                      "client_secret": self.settings.oauth_client_secret.get_secret_value(),
                      "code": request.query.get("code", "")},
                headers={"Accept": "application/json"},
            ) as resp:
                grant = await resp.json(content_type=None)
            token = grant.get("access_token") if isinstance(grant, dict) else None
            if not token:
                log.warning("web: sign-in refused by GitHub: %s",
                            grant.get("error") if isinstance(grant, dict) else "no answer")
                raise web.HTTPForbidden(text="GitHub did not accept this sign-in; try again.")
            user = await self.services().github.as_user(token).getitem("/user")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.warning("web: sign-in failed: %s", type(exc).__name__)
            raise web.HTTPBadGateway(text="GitHub could not be reached to sign you in.") \
                from exc
        nxt = session.get("next")  # only the target stored at /login is followed
        session.clear()
        session["login"], session["token"] = str(user["login"]), token
        self.access.owned(token, str(user["login"]))
        raise web.HTTPFound(local_path(nxt) if isinstance(nxt, str) else "/")

    async def logout(self, request: web.Request) -> web.StreamResponse:
        await check_csrf(request)
        session = await aiohttp_session.get_session(request)
        token = session.get("token")
        if isinstance(token, str):
            self.access.forget(token)
            # The cookie is stateless: a copy of it would outlive the sign-out, so the token
            # it carries is revoked with GitHub.
            await self._revoke(token)
        session.invalidate()
        raise web.HTTPFound("/")

    async def _revoke(self, token: str) -> None:
        http = self._session()
        secret = self.settings.oauth_client_secret
        client_id = self.settings.oauth_client_id
        if http is None or secret is None or client_id is None:
            return
        basic = base64.b64encode(f"{client_id}:{secret.get_secret_value()}".encode()).decode()
        try:
            async with http.delete(
                f"{self.settings.github_url}/applications/{client_id}/token",
                json={"access_token": token},
                headers={"Accept": "application/vnd.github+json",
                         "Authorization": f"Basic {basic}"},
            ) as resp:
                if resp.status not in (204, 404):
                    log.warning("web: sign-out: GitHub answered %d to revoking the token",
                                resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("web: sign-out: the token could not be revoked (%s)",
                        type(exc).__name__)

    # -- pages ----------------------------------------------------------------------------

    async def index(self, request: web.Request) -> web.StreamResponse:
        viewer = await self.viewer(request)
        services = self.services()
        index = services.index.current
        # The most recently active first (those with suggestions), then the rest.
        active = await asyncio.to_thread(services.store.suggestion_repos)
        learned = await asyncio.to_thread(services.store.learned_counts)
        known = list(dict.fromkeys([*active, *sorted({*index.repos, *learned})]))
        shown = known[:INDEX_REPOS]
        # One permission answer per repository (cached), a few at a time; a repository GitHub
        # fails to answer for is left out, not the whole page.
        gate = asyncio.Semaphore(8)

        async def allowed(repo: str) -> bool:
            async with gate:
                try:
                    return await self.access.check(services, viewer, repo) == "ok"
                except TokenRefused:
                    raise
                except (gidgethub.GitHubException, aiohttp.ClientError, TimeoutError) as exc:
                    log.warning("web: %s left off the list: GitHub did not answer (%s)", repo,
                                type(exc).__name__)
                    return False

        try:
            answers = await asyncio.gather(*(allowed(r) for r in shown))
        except TokenRefused:
            session = await aiohttp_session.get_session(request)
            session.invalidate()
            raise web.HTTPFound("/login?next=/") from None
        return await render("index.html", request, {
            # Curated and learned: a curated cluster that a learned one repeats counts twice.
            "repos": [(r, index.count(r) + learned.get(r.lower(), 0))
                      for r, ok in zip(shown, answers, strict=True) if ok],
            "more": max(len(known) - INDEX_REPOS, 0)})

    async def _repo_page(self, request: web.Request, services: Services, repo: str,
                         extra: dict[str, Any]) -> web.Response:
        """The repository page, for a viewer ``allowed`` already let in."""
        ctx = await page_context(services, repo, "page")
        config, errors = await repo_config_or_error(ctx)
        web_url = self.settings.github_web_url
        repos = [repo, *config.upstreams]
        index = await services.index.view(repos)

        def read() -> tuple[list[dashboard.SuggestionView], dashboard.Health,
                            list[dashboard.IncompleteFix]]:
            store = services.store
            return (dashboard.suggestions_view(store, index, repos, web_url),
                    dashboard.health(store, index, repo, config, services.config.default_mode,
                                     errors, service_config=services.config),
                    dashboard.incomplete_fixes(store, index, repos, web_url))

        suggestions, health, incomplete = await asyncio.to_thread(read)
        return await render("repo.html", request, {
            "repo": repo, "suggestions": suggestions, "health": health,
            "incomplete": incomplete, "web_url": web_url, "title": "", "body": "",
            "result": None, **extra})

    async def repo(self, request: web.Request) -> web.Response:
        _, services, repo = await self.allowed(request)
        return await self._repo_page(request, services, repo, {})

    async def preview(self, request: web.Request) -> web.Response:
        _, services, repo = await self.allowed(request)
        form = await check_csrf(request)
        title, body = str(form.get("title", "")).strip(), str(form.get("body", ""))
        if not title:
            raise web.HTTPBadRequest(text="Give the issue a title.")
        result = await preview(services, repo, title, body)
        best = result.best
        # The rows read the cluster's record and tokenise its titles: CPU work, in a thread.
        evidence = (await asyncio.to_thread(dashboard.evidence_view, best.evidence,
                                            best.cluster, repo, best.score)
                    if best is not None else None)
        return await self._repo_page(request, services, repo, {
            "title": title, "body": body, "result": result, "evidence": evidence})

    async def backtest(self, request: web.Request) -> web.Response:
        _, services, repo = await self.allowed(request)
        ctx = await page_context(services, repo, "backtest")
        config, _ = await repo_config_or_error(ctx)
        policy = services.config.matching
        threshold = config.threshold or policy.threshold
        index = await services.index.view([repo])
        key = (repo.lower(), index.version, threshold)
        if key in self._backtests:
            view = self._backtests[key]
        else:
            async with self._replaying:
                if key in self._backtests:
                    view = self._backtests[key]
                else:
                    clusters, total = await asyncio.to_thread(dashboard.latest_clusters, index,
                                                              repo)
                    view = self._backtests[key] = await asyncio.to_thread(
                        dashboard.backtest, clusters, threshold, policy.margin, 0.9, total)
        return await render("backtest.html", request, {"repo": repo, "bt": view})

